#!/usr/bin/env python3
"""Checks that every #include in src/ and include/ follows the layer order.

The order is the one docs/architecture.md states on its line "Layer order: core < kernels < ...":
a file of one layer may include its own layer's files and those of layers before it, never a
later one. Public headers (include/gradsync/) may include only public headers. Every include
that breaks a rule is printed as an edge, with the file and line, and the exit status is 1.

    scripts/check_layers.py [ROOT]      ROOT: the repository (default: this script's parent)
"""
import os
import re
import sys

SOURCE_SUFFIXES = (".h", ".cpp", ".cu", ".inc")
INCLUDE = re.compile(r'^\s*#\s*include\s*[<"]([^>"]+)[>"]')
ORDER_LINE = re.compile(r"^Layer order[^:]*:\s*(.+?)\s*$")


def layer_order(root):
    path = os.path.join(root, "docs", "architecture.md")
    with open(path, encoding="utf-8") as document:
        for line in document:
            match = ORDER_LINE.match(line.strip().strip("*`"))
            if match:
                layers = [name.strip(" `*") for name in match.group(1).split("<")]
                return {name: position for position, name in enumerate(layers)}
    sys.exit(f"{path}: no line 'Layer order: core < kernels < ...' to check against")


def layer_of(relative, layers):
    """The layer a repository path belongs to, or None (generated or top-level files)."""
    parts = relative.split("/")
    if parts[0] == "src" and len(parts) > 2:
        return parts[1] if parts[1] in layers else None
    if parts[:2] == ["include", "gradsync"] and len(parts) > 3:
        return parts[2] if parts[2] in layers else None
    return None


def resolve(root, including, target):
    """The repository path an include names, or None for system and generated headers."""
    if target.startswith("gradsync/"):
        candidate = os.path.join("include", target)
        return candidate if os.path.exists(os.path.join(root, candidate)) else None  # gradsync/config.h is generated
    for base in (os.path.dirname(including), "src"):  # the including file's folder, then src/ (an include dir)
        candidate = os.path.normpath(os.path.join(base, target))
        if os.path.exists(os.path.join(root, candidate)):
            return candidate
    return None  # a system or third-party header


def check(root):
    layers = layer_order(root)
    chain = " < ".join(sorted(layers, key=layers.get))
    problems = []
    for top in ("src", "include"):
        for folder, _, files in os.walk(os.path.join(root, top)):
            for name in sorted(files):
                if not name.endswith(SOURCE_SUFFIXES):
                    continue
                path = os.path.relpath(os.path.join(folder, name), root)
                source_layer = layer_of(path, layers)
                with open(os.path.join(root, path), encoding="utf-8") as text:
                    for number, line in enumerate(text, 1):
                        match = INCLUDE.match(line)
                        if not match:
                            continue
                        target = resolve(root, path, match.group(1))
                        if target is None:
                            continue
                        if path.startswith("include/") and not target.startswith("include/"):
                            problems.append(f"{path}:{number}: public header includes the internal {target}")
                            continue
                        target_layer = layer_of(target, layers)
                        if source_layer is None or target_layer is None:
                            continue
                        if layers[target_layer] > layers[source_layer]:
                            problems.append(f"{path}:{number}: {source_layer} -> {target_layer} ({match.group(1)}): "
                                            f"an upward include against {chain}")
    return problems


def main():
    root = os.path.abspath(sys.argv[1] if len(sys.argv) > 1 else os.path.join(os.path.dirname(__file__), ".."))
    problems = check(root)
    for problem in problems:
        print(problem)
    if problems:
        print(f"check_layers: {len(problems)} include(s) against the layer order of docs/architecture.md")
        return 1
    print("check_layers: every include in src/ and include/ follows the layer order")
    return 0


if __name__ == "__main__":
    sys.exit(main())
