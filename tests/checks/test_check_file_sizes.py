#!/usr/bin/env python3
"""The size rule (scripts/check_file_sizes.py) on this repository, and on copies of it with a
planted file of 451 lines (caught, naming it), one of 450 (passes), the 451-line one listed in
docs/architecture.md (passes), a listed file that shrank (caught) and a row without its reason
(caught)."""
import os
import sys
import tempfile

from check_harness import CheckTest

test = CheckTest(sys.argv[1], "check_file_sizes.py")


def plant(tree, relative, lines):
    with open(os.path.join(tree, relative), "w", encoding="utf-8") as planted:
        planted.write("".join(f"// line {n}\n" for n in range(lines)))


def add_row(tree, row):
    """Adds a row to the size table of the copy's docs/architecture.md."""
    path = os.path.join(tree, "docs", "architecture.md")
    with open(path, encoding="utf-8") as document:
        lines = document.read().split("\n")
    heading = lines.index("## File sizes")
    table = next(i for i in range(heading, len(lines)) if lines[i].startswith("|---"))
    lines.insert(table + 1, row)
    with open(path, "w", encoding="utf-8") as document:
        document.write("\n".join(lines))


status, output = test.run(test.root)
test.expect("the repository keeps the size rule", status == 0, output)

with tempfile.TemporaryDirectory() as tree:
    test.copy(tree, ("src", "examples", "docs"))
    plant(tree, "src/dist/planted.cpp", 451)
    status, output = test.run(tree)
    test.expect("a planted 451-line file is caught, named with its length", status == 1 and
           "src/dist/planted.cpp: 451 lines, over 450" in output, output)
    add_row(tree, "| `src/dist/planted.cpp` | a planted idea | a planted reason |")
    status, output = test.run(tree)
    test.expect("listed with its idea and reason, it passes", status == 0, output)
    plant(tree, "src/dist/planted.cpp", 450)
    status, output = test.run(tree)
    test.expect("a listed file that shrank to 450 lines is caught", status == 1 and
           "lists src/dist/planted.cpp, which is 450 lines, no longer over 450" in output, output)

with tempfile.TemporaryDirectory() as tree:
    test.copy(tree, ("src", "examples", "docs"))
    plant(tree, "examples/planted.py", 450)
    status, output = test.run(tree)
    test.expect("a file of exactly 450 lines passes", status == 0, output)
    plant(tree, "examples/planted.py", 451)
    add_row(tree, "| `examples/planted.py` |  | a reason without an idea |")
    status, output = test.run(tree)
    test.expect("a row without its one idea is caught", status == 1 and "needs its one idea" in output, output)

test.exit()
