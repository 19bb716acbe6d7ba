#!/usr/bin/env python3
"""Checks that every #include in src/ and include/ follows the layer order, and the folder order
inside a layer that has one.

The layer order is the one docs/architecture.md states on its line "Layer order: core < kernels
< ...": a file of one layer may include its own layer's files and those of layers before it,
never a later one. A layer whose folders have an order states it on a line "Folder order in
LAYER: LAYER < first < second < ..." (LAYER itself standing for the files directly in the
layer's folder): inside that layer, a file may include files of its own folder and of folders
before it, never a later one, every folder of the layer must be in the line, and each folder
(and the layer's own) must open with its contract, a README.md. Public headers
(include/gradsync/) may include only public headers; a public header's folder is the one below
include/gradsync/LAYER/, as a source file's is the one below src/LAYER/. Every include that breaks
a rule is printed as an edge, with the file and line, and the exit status is 1.

    scripts/check_layers.py [ROOT]      ROOT: the repository (default: this script's parent)
"""
import os
import re
import sys

SOURCE_SUFFIXES = (".h", ".cpp", ".cu", ".inc")
INCLUDE = re.compile(r'^\s*#\s*include\s*[<"]([^>"]+)[>"]')
ORDER_LINE = re.compile(r"^Layer order[^:]*:\s*(.+?)\s*$")
FOLDER_ORDER_LINE = re.compile(r"^Folder order in (\w+)[^:]*:\s*(.+?)\s*$")


def positions(chain):
    names = [name.strip(" `*") for name in chain.split("<")]
    return {name: position for position, name in enumerate(names)}


def orders(root):
    """The layer order, and the folder order of each layer that states one."""
    path = os.path.join(root, "docs", "architecture.md")
    layers, folders = None, {}
    with open(path, encoding="utf-8") as document:
        for line in document:
            line = line.strip().strip("*`")
            match = ORDER_LINE.match(line)
            if match and layers is None:
                layers = positions(match.group(1))
            match = FOLDER_ORDER_LINE.match(line)
            if match:
                folders[match.group(1)] = positions(match.group(2))
    if layers is None:
        sys.exit(f"{path}: no line 'Layer order: core < kernels < ...' to check against")
    return layers, folders


def place_of(relative, layers):
    """(layer, folder) of a repository path; folder is the layer's own name for a file directly in
    it. None for generated or top-level files."""
    parts = relative.split("/")
    if parts[0] == "src" and len(parts) > 2:
        inside = parts[2:]
    elif parts[:2] == ["include", "gradsync"] and len(parts) > 3:
        inside = parts[3:]
    else:
        return None
    layer = parts[1] if parts[0] == "src" else parts[2]
    if layer not in layers:
        return None
    return layer, inside[0] if len(inside) > 1 else layer


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


def chain_of(order):
    return " < ".join(sorted(order, key=order.get))


def check(root):
    layers, folders = orders(root)
    chain = chain_of(layers)
    problems = []
    unlisted = set()
    for top in ("src", "include"):
        for folder, _, files in os.walk(os.path.join(root, top)):
            for name in sorted(files):
                if not name.endswith(SOURCE_SUFFIXES):
                    continue
                path = os.path.relpath(os.path.join(folder, name), root)
                source = place_of(path, layers)
                if source is not None and source[0] in folders and source[1] not in folders[source[0]]:
                    unlisted.add(f"{source[0]}/{source[1]}")
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
                        target_place = place_of(target, layers)
                        if source is None or target_place is None:
                            continue
                        (source_layer, source_folder), (target_layer, target_folder) = source, target_place
                        if layers[target_layer] > layers[source_layer]:
                            problems.append(f"{path}:{number}: {source_layer} -> {target_layer} ({match.group(1)}): "
                                            f"an upward include against {chain}")
                            continue
                        order = folders.get(source_layer)
                        if target_layer != source_layer or order is None:
                            continue
                        if order.get(target_folder, -1) > order.get(source_folder, len(order)):
                            problems.append(f"{path}:{number}: {source_layer}/{source_folder} -> "
                                            f"{target_layer}/{target_folder} ({match.group(1)}): a later folder "
                                            f"against {chain_of(order)}")
    for layer, order in sorted(folders.items()):
        for folder_name in [layer] + sorted(name for name in order if name != layer):
            readme = os.path.join("src", layer, "" if folder_name == layer else folder_name, "README.md")
            if not os.path.isfile(os.path.join(root, readme)):
                problems.append(f"{os.path.normpath(readme)}: missing; each folder of {layer} opens with its contract "
                                f"(what lives there, what it may use, what uses it)")
    for place in sorted(unlisted):
        layer = place.split("/")[0]
        problems.append(f"{place}: a folder the line 'Folder order in {layer}: ...' of docs/architecture.md does "
                        f"not list ({chain_of(folders[layer])})")
    return problems


def main():
    root = os.path.abspath(sys.argv[1] if len(sys.argv) > 1 else os.path.join(os.path.dirname(__file__), ".."))
    problems = check(root)
    for problem in problems:
        print(problem)
    if problems:
        print(f"check_layers: {len(problems)} problem(s) against the layer and folder orders of docs/architecture.md")
        return 1
    print("check_layers: every include in src/ and include/ follows the layer order and the folder orders")
    return 0


if __name__ == "__main__":
    sys.exit(main())
