#!/usr/bin/env python3
"""The layering check (scripts/check_layers.py) on this repository, and on copies of it with a
planted upward include, a public header reaching into src/, an include of a later folder inside
dist and inside comm, a folder the folder order does not list, and a folder without its README
(its contract): the first must pass, each plant must fail, naming its edge."""
import os
import sys
import tempfile

from check_harness import CheckTest

test = CheckTest(sys.argv[1], "check_layers.py")

status, output = test.run(test.root)
test.expect("the repository follows the layer order", status == 0, output)

PLANTS = [
    ("an upward include (core -> dist)", "src/core/tensor.cpp", '#include "gradsync/dist/reducer/reducer.h"\n',
     "src/core/tensor.cpp:1: core -> dist (gradsync/dist/reducer/reducer.h): an upward include"),
    ("an upward relative include (kernels -> optim)", "src/kernels/ops.cpp", '#include "../optim/group_helpers.h"\n',
     "src/kernels/ops.cpp:1: kernels -> optim (../optim/group_helpers.h)"),
    ("a public header including an internal one", "include/gradsync/core/tensor.h", '#include "core/staging.h"\n',
     "include/gradsync/core/tensor.h:1: public header includes the internal src/core/staging.h"),
    ("ZeRO reaching into fault tolerance (a later folder of dist)", "src/dist/zero/units.cpp",
     '#include "gradsync/dist/fault_tolerance/fault_tolerance.h"\n',
     "src/dist/zero/units.cpp:1: dist/zero -> dist/fault_tolerance "
     "(gradsync/dist/fault_tolerance/fault_tolerance.h): a later folder against replicas < reducer"),
    ("the store reaching into the CPU engine (a later folder of comm, relative)", "src/comm/store/socket_io.cpp",
     '#include "../cpu/backend.h"\n',
     "src/comm/store/socket_io.cpp:1: comm/store -> comm/cpu (../cpu/backend.h): a later folder against comm <"),
    ("a file of comm's own level reaching into a folder", "src/comm/collective.cpp",
     '#include "records/flight_recorder.h"\n',
     "src/comm/collective.cpp:1: comm/comm -> comm/records (records/flight_recorder.h): a later folder"),
    ("a folder of dist that the order does not list", "src/dist/unlisted/room.cpp",
     '#include "gradsync/dist/join/join.h"\n',
     "dist/unlisted: a folder the line 'Folder order in dist: ...' of docs/architecture.md does not list"),
]
with tempfile.TemporaryDirectory() as copy:
    test.copy(copy, ("src", "include", "docs"))
    os.remove(os.path.join(copy, "src", "dist", "zero", "README.md"))
    status, output = test.run(copy)
    test.expect("a folder without its contract (README.md) is caught",
                status == 1 and "src/dist/zero/README.md: missing" in output, output)

for name, path, line, edge in PLANTS:
    with tempfile.TemporaryDirectory() as copy:
        test.copy(copy, ("src", "include", "docs"))
        os.makedirs(os.path.dirname(os.path.join(copy, path)), exist_ok=True)
        text = ""
        if os.path.exists(os.path.join(copy, path)):
            with open(os.path.join(copy, path), encoding="utf-8") as source:
                text = source.read()
        with open(os.path.join(copy, path), "w", encoding="utf-8") as source:
            source.write(line + text)
        status, output = test.run(copy)
        test.expect(f"{name} is caught and its edge printed", status == 1 and edge in output, output)

test.exit()
