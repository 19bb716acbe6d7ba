#!/usr/bin/env python3
"""Interop test: a file written by gradsync is read by the reference safetensors library
(with PyTorch) and must hold exactly the tensors the fixture generator would write.

Usage: check_interop.py PATH/TO/interop_writer
Exits 77 (meson's "skipped") when torch or safetensors is not installed: the rest of the
test suite never needs Python.
"""
import argparse
import os
import subprocess
import sys
import tempfile

try:
    import torch
    from safetensors import safe_open
    from safetensors.torch import load_file
except ImportError as error:
    print(f"skipped: the reference library is not installed ({error}); pip install safetensors torch")
    sys.exit(77)

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from generate_fixtures import reference_value  # noqa: E402  (the one formula both sides use)

DTYPES = {"f32": torch.float32, "f64": torch.float64, "f16": torch.float16, "bf16": torch.bfloat16,
          "i32": torch.int32, "i64": torch.int64}
SHAPES = {"scalar": [], "vector": [5], "matrix": [3, 4], "cube": [2, 3, 2], "empty": [0, 3]}


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("writer", help="the interop_writer program (build/tests/interop_writer)")
    writer = parser.parse_args().writer
    with tempfile.TemporaryDirectory() as folder:
        path = os.path.join(folder, "ours.safetensors")
        subprocess.run([writer, path], check=True)
        tensors = load_file(path)
        with safe_open(path, framework="pt") as handle:
            metadata = handle.metadata()
        assert metadata == {"writer": "gradsync"}, metadata
        expected_names = {f"{d}.{s}" for d in DTYPES for s in SHAPES}
        assert set(tensors) == expected_names, sorted(set(tensors) ^ expected_names)
        for dtype_name, dtype in DTYPES.items():
            for shape_name, shape in SHAPES.items():
                name = f"{dtype_name}.{shape_name}"
                numel = 1
                for extent in shape:
                    numel *= extent
                expected = torch.tensor([reference_value(i, dtype) for i in range(numel)], dtype=dtype).reshape(shape)
                got = tensors[name]
                assert got.dtype == dtype, (name, got.dtype)
                assert list(got.shape) == shape, (name, got.shape)
                assert torch.equal(got, expected), (name, got, expected)
    print(f"interop: {len(expected_names)} tensors written by gradsync read back exactly by safetensors")
    print("1 passed, 0 failed")


if __name__ == "__main__":
    main()
