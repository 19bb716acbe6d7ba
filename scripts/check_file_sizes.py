#!/usr/bin/env python3
"""Checks the size rule: no file in src/ or examples/ is over 450 lines unless
docs/architecture.md lists it, with its one idea and why it is not split.

The list is the table under the heading "## File sizes" of docs/architecture.md, one row a file:

    | `src/dist/reducer/reducer.cpp` | the round engine ... | its parts share ... |

A row names a file by its repository path in backticks, then its one idea, then why it is not
split; a row whose cells are empty is an error too. Every file over the limit and not listed is
printed with its length, and so is every listed file that is missing or no longer over the limit
(the list stays true). The exit status is 1 when anything is printed.

    scripts/check_file_sizes.py [ROOT]      ROOT: the repository (default: this script's parent)
"""
import os
import re
import sys

LIMIT = 450
FOLDERS = ("src", "examples")
SUFFIXES = (".h", ".cpp", ".cu", ".inc", ".py", ".sh")
HEADING = "## File sizes"
ROW = re.compile(r"^\|\s*`([^`]+)`\s*\|(.*)\|\s*$")


def listed_exceptions(root):
    """{path: (idea, why)} from the table under HEADING; problems with its rows."""
    path = os.path.join(root, "docs", "architecture.md")
    exceptions, problems, inside = {}, [], False
    with open(path, encoding="utf-8") as document:
        for number, line in enumerate(document, 1):
            if line.startswith("## "):
                inside = line.strip() == HEADING
                continue
            match = ROW.match(line.strip()) if inside else None
            if not match:
                continue
            cells = [cell.strip() for cell in match.group(2).split("|")]
            if len(cells) != 2 or not all(cells):
                problems.append(f"docs/architecture.md:{number}: the row for {match.group(1)} needs its one idea "
                                "and why it is not split")
                continue
            exceptions[match.group(1)] = tuple(cells)
    return exceptions, problems


def line_count(path):
    with open(path, "rb") as source:
        return sum(1 for _ in source)


def check(root):
    exceptions, problems = listed_exceptions(root)
    for top in FOLDERS:
        for folder, _, files in os.walk(os.path.join(root, top)):
            for name in sorted(files):
                if not name.endswith(SUFFIXES):
                    continue
                relative = os.path.relpath(os.path.join(folder, name), root).replace(os.sep, "/")
                lines = line_count(os.path.join(folder, name))
                if lines > LIMIT and relative not in exceptions:
                    problems.append(f"{relative}: {lines} lines, over {LIMIT}: split it by idea, or list it in "
                                    f"docs/architecture.md ({HEADING}) with its one idea and why it is not split")
    for relative in sorted(exceptions):
        full = os.path.join(root, relative)
        if not os.path.isfile(full):
            problems.append(f"docs/architecture.md lists {relative}, which does not exist")
        elif line_count(full) <= LIMIT:
            problems.append(f"docs/architecture.md lists {relative}, which is {line_count(full)} lines, no longer "
                            f"over {LIMIT}: take it off the list")
    return problems


def main():
    root = os.path.abspath(sys.argv[1] if len(sys.argv) > 1 else os.path.join(os.path.dirname(__file__), ".."))
    problems = check(root)
    for problem in problems:
        print(problem)
    if not problems:
        print(f"file sizes: every file in {' and '.join(FOLDERS)}/ is at most {LIMIT} lines or listed")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
