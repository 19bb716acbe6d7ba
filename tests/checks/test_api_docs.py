#!/usr/bin/env python3
"""The API reference (scripts/docs.sh: Doxygen over include/gradsync/) builds with no warning, so
every public class, function and member is documented; and on a copy of the tree with a planted
undocumented public function and class, the build fails naming each. Skips (exit 77) without
Doxygen, which scripts/setup.sh installs."""
import os
import shutil
import subprocess
import sys
import tempfile

from check_harness import CheckTest

test = CheckTest(sys.argv[1], "docs.sh")
if shutil.which("doxygen") is None:
    print("skipped: doxygen is not installed (scripts/setup.sh installs it)")
    sys.exit(77)


def build(tree):
    with tempfile.TemporaryDirectory() as out:
        result = subprocess.run(["bash", os.path.join(tree, "scripts", "docs.sh"), out], cwd=tree,
                                capture_output=True, text=True)
        return result.returncode, result.stdout + result.stderr


status, output = build(test.root)
test.expect("the API reference builds with every public declaration documented", status == 0, output)

with tempfile.TemporaryDirectory() as tree:
    test.copy(tree, ("include", "docs", "scripts"))
    header = os.path.join(tree, "include", "gradsync", "core", "error.h")
    with open(header, encoding="utf-8") as source:
        text = source.read()
    planted = ("namespace gradsync {\n\n// Documented, as a neighbour.\nint documented_neighbour();\n"
               "int planted_undocumented(int x);\n\nclass PlantedClass {\n public:\n  // A documented member.\n"
               "  void member();\n};\n\n}  // namespace gradsync\n")
    with open(header, "w", encoding="utf-8") as source:
        source.write(text + "\n" + planted)
    status, output = build(tree)
    test.expect("a planted undocumented function is caught, named", status == 1 and "planted_undocumented" in output,
                output)
    test.expect("a planted undocumented class is caught, named", status == 1 and "PlantedClass is not documented"
                in output, output)

test.exit()
