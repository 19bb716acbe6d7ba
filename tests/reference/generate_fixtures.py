#!/usr/bin/env python3
"""Generates the committed test fixtures from PyTorch and the reference safetensors library.

Tests never run this script; they read its output in tests/fixtures/. Rerun it only to
change the fixtures, and commit the result:

    python3 tests/reference/generate_fixtures.py

Needs: torch (Debian's python3-torch 1.13 is enough) and the reference `safetensors`
package (pip install safetensors).

Fixtures written:
  casts.safetensors       inputs and PyTorch's conversions f32/f64 -> f16/bf16 and back,
                          covering every 16-bit pattern and every rounding boundary.
  reference_tensors.safetensors
                          tensors of every dtype written by safetensors.torch.save_file,
                          with values given by a formula the C++ test recomputes.
  torch_dtypes.safetensors
                          f32 weights beside the dtypes PyTorch writes and gradsync does not
                          compute with (bool, uint8, int8, int16, float8): the file must open.
"""
import argparse
import os
import struct

import torch
from safetensors.torch import save_file

HERE = os.path.dirname(os.path.abspath(__file__))
OUT = os.path.join(HERE, "..", "fixtures")


def f32_from_bits(bits):
    return torch.as_tensor(bits, dtype=torch.int64).to(torch.int32).view(torch.float32)


def f32_bits(values):
    return torch.tensor(values, dtype=torch.float32).view(torch.int32).to(torch.int64) & 0xFFFFFFFF


def boundary_inputs_f32(widened, mantissa_shift):
    """For each finite non-negative 16-bit value: the midpoint to the next value, and one f32
    ulp either side of it, both signs. These are exactly the inputs where rounding decides."""
    bits = f32_bits(widened.tolist())
    finite = bits[(bits & 0x7F800000) != 0x7F800000]
    half_ulp = 1 << (mantissa_shift - 1)
    mids = finite + half_ulp
    candidates = torch.cat([mids - 1, mids, mids + 1, finite])
    candidates = candidates[(candidates >= 0) & (candidates < 0x7F800000)]
    return torch.cat([candidates, candidates | 0x80000000])


def casts():
    generator = torch.Generator().manual_seed(20261202)
    all16 = torch.arange(0, 65536, dtype=torch.int32).to(torch.int16)
    f16_all = all16.view(torch.float16)
    bf16_all = all16.view(torch.bfloat16)

    specials = [0x00000000, 0x80000000, 0x7F800000, 0xFF800000, 0x7FC00000, 0xFFC00000, 0x7F800001,
                0x7FBFFFFF, 0x00000001, 0x807FFFFF, 0x00800000, 0x7F7FFFFF, 0xFF7FFFFF,
                0x477FE000, 0x477FEFFF, 0x477FF000, 0x477FF001, 0x47800000,  # around f16 max
                0x33000000, 0x33000001, 0x32FFFFFF, 0x33800000, 0x33C00000,  # around 2^-25 / 2^-24
                0x38800000, 0x387FFFFF, 0x387FE000, 0x387FF000,              # around the smallest f16 normal
                0x7F7F8000, 0x7F7F7FFF, 0x7F7FFFFF]                           # around bf16 max
    random_bits = torch.randint(0, 2**32, (120000,), generator=generator, dtype=torch.int64)
    inputs_bits = torch.cat([
        torch.tensor(specials, dtype=torch.int64),
        boundary_inputs_f32(f16_all.float()[:31744], 13),
        boundary_inputs_f32(bf16_all.float()[:32640], 16)[::3],
        random_bits,
    ])
    f32_inputs = f32_from_bits(inputs_bits)

    # f64 inputs: random doubles across many magnitudes, plus double-rounding traps: values a
    # hair above a 16-bit midpoint, which PyTorch (going through f32) rounds down.
    magnitudes = torch.exp2(torch.randint(-30, 20, (40000,), generator=generator).double())
    random_f64 = torch.randn(40000, generator=generator, dtype=torch.float64) * magnitudes
    mids16 = (f16_all.double()[1:31744] + f16_all.double()[0:31743]) / 2
    traps = torch.cat([mids16 * (1 + 2.0**-40), mids16 * (1 - 2.0**-40)])
    f64_specials = torch.tensor([0.0, -0.0, float("inf"), float("-inf"), float("nan"), 1e300, -1e300,
                                 1e-300, 65504.0, 65520.0, 65519.999999, 3.4e38, 3.5e38,
                                 1 + 2.0**-11 + 2.0**-40], dtype=torch.float64)
    f64_inputs = torch.cat([f64_specials, random_f64, traps])

    tensors = {
        "f32_inputs": f32_inputs,
        "f32_to_f16": f32_inputs.half(),
        "f32_to_bf16": f32_inputs.bfloat16(),
        "f64_inputs": f64_inputs,
        "f64_to_f16": f64_inputs.half(),
        "f64_to_bf16": f64_inputs.bfloat16(),
        "f16_all": f16_all.clone(),
        "f16_all_to_f32": f16_all.float(),
        "bf16_all": bf16_all.clone(),
        "bf16_all_to_f32": bf16_all.float(),
    }
    save_file(tensors, os.path.join(OUT, "casts.safetensors"),
              metadata={"generator": "tests/reference/generate_fixtures.py", "torch": torch.__version__})


def reference_value(index, dtype):
    """Must match reference_value() in tests/unit/test_safetensors.cpp."""
    if dtype in (torch.int32,):
        return (index * 7919) % 100003 - 50000
    if dtype in (torch.int64,):
        return index * 1000000007 - 3 * 2**40
    return (index - 7) * 0.25  # exact in every float dtype for the sizes used here


def reference_tensors():
    shapes = {"scalar": [], "vector": [5], "matrix": [3, 4], "cube": [2, 3, 2], "empty": [0, 3]}
    dtypes = {"f32": torch.float32, "f64": torch.float64, "f16": torch.float16, "bf16": torch.bfloat16,
              "i32": torch.int32, "i64": torch.int64}
    tensors = {}
    for dtype_name, dtype in dtypes.items():
        for shape_name, shape in shapes.items():
            numel = 1
            for extent in shape:
                numel *= extent
            values = [reference_value(i, dtype) for i in range(numel)]
            tensors[f"{dtype_name}.{shape_name}"] = torch.tensor(values, dtype=dtype).reshape(shape)
    save_file(tensors, os.path.join(OUT, "reference_tensors.safetensors"),
              metadata={"writer": "safetensors.torch.save_file", "purpose": "gradsync interop fixture"})


def torch_dtypes():
    tensors = {
        "weight": torch.arange(6, dtype=torch.float32).reshape(2, 3) * 0.5,
        "mask": torch.tensor([[True, False, True], [False, False, True]]),
        "tokens": torch.arange(5, dtype=torch.uint8),
        "offsets": torch.tensor([-3, 0, 7], dtype=torch.int8),
        "positions": torch.tensor([1, 300, -2], dtype=torch.int16),
        "bias": torch.tensor([0.25, -1.5], dtype=torch.float16),
    }
    if hasattr(torch, "float8_e4m3fn"):
        tensors["scales"] = torch.tensor([1.0, 2.0, 0.5], dtype=torch.float8_e4m3fn)
    save_file(tensors, os.path.join(OUT, "torch_dtypes.safetensors"), metadata={"writer": "safetensors.torch.save_file"})


if __name__ == "__main__":
    # Only as a program: check_interop.py imports reference_value from here.
    argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter).parse_args()
    os.makedirs(OUT, exist_ok=True)
    casts()
    reference_tensors()
    torch_dtypes()
    print("fixtures written to", os.path.normpath(OUT))
