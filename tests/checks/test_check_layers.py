#!/usr/bin/env python3
"""The layering check (scripts/check_layers.py) on this repository, and on copies of it with a
planted upward include and a public header reaching into src/: the first must pass, each plant
must fail, naming its edge."""
import os
import sys
import tempfile

from check_harness import CheckTest

test = CheckTest(sys.argv[1], "check_layers.py")

status, output = test.run(test.root)
test.expect("the repository follows the layer order", status == 0, output)

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
        test.copy(copy, ("src", "include", "docs"))
        with open(os.path.join(copy, path), encoding="utf-8") as source:
            text = source.read()
        with open(os.path.join(copy, path), "w", encoding="utf-8") as source:
            source.write(line + text)
        status, output = test.run(copy)
        test.expect(f"{name} is caught and its edge printed", status == 1 and edge in output, output)

test.exit()
