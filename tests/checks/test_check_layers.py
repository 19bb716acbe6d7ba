#!/usr/bin/env python3
"""The layering check (scripts/check_layers.py) on this repository, and on copies of it with a
planted upward include and a public header reaching into src/: the first must pass, each plant
must fail, naming its edge."""
import os
import shutil
import subprocess
import sys
import tempfile

root = os.path.abspath(sys.argv[1])
script = os.path.join(root, "scripts", "check_layers.py")
failures = []


def run(tree):
    result = subprocess.run([sys.executable, script, tree], capture_output=True, text=True)
    return result.returncode, result.stdout + result.stderr


def expect(name, condition, output):
    print(("ok   " if condition else "FAIL ") + name)
    if not condition:
        print(output)
        failures.append(name)


status, output = run(root)
expect("the repository follows the layer order", status == 0, output)

PLANTS = [
    ("an upward include (core -> dist)", "src/core/tensor.cpp", '#include "gradsync/dist/reducer.h"\n',
     "src/core/tensor.cpp:1: core -> dist (gradsync/dist/reducer.h): an upward include"),
    ("an upward relative include (kernels -> optim)", "src/kernels/ops.cpp", '#include "../optim/group_helpers.h"\n',
     "src/kernels/ops.cpp:1: kernels -> optim (../optim/group_helpers.h)"),
    ("a public header including an internal one", "include/gradsync/core/tensor.h", '#include "core/staging.h"\n',
     "include/gradsync/core/tensor.h:1: public header includes the internal src/core/staging.h"),
]
for name, path, line, edge in PLANTS:
    with tempfile.TemporaryDirectory() as copy:
        for folder in ("src", "include", "docs"):
            shutil.copytree(os.path.join(root, folder), os.path.join(copy, folder))
        with open(os.path.join(copy, path), encoding="utf-8") as source:
            text = source.read()
        with open(os.path.join(copy, path), "w", encoding="utf-8") as source:
            source.write(line + text)
        status, output = run(copy)
        expect(f"{name} is caught and its edge printed", status == 1 and edge in output, output)

sys.exit(1 if failures else 0)
