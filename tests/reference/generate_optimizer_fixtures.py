#!/usr/bin/env python3
"""Generates tests/fixtures/optimizer_trajectories.safetensors with torch.optim.

For every case (optimizer, hyperparameters, parameter groups, dtype) it records four
parameters' initial values, 30 steps of fixed random gradients (some absent: PyTorch skips a
parameter whose .grad is None), and the final parameters and optimizer state. Gradient
magnitudes cycle through 1, 1e-3, 1e3, 1e-20 (squares are f32 subnormals) and 1e15.

    python3 tests/reference/generate_optimizer_fixtures.py              (torch 1.13: Debian's)
    /tmp/torch/bin/python tests/reference/generate_optimizer_fixtures.py --current

The first writes optimizer_trajectories.safetensors with Debian's python3-torch 1.13, whose
CPU kernels gradsync reproduces to the bit. --current writes
optimizer_trajectories_current.safetensors with a current torch from PyPI (2.x), once per
implementation torch offers: the single-tensor loop (foreach=False), foreach=True and
fused=True; gradsync is held to a stated ULP bound against those (tests/unit/test_optimizers.cpp
says why they are not bit-identical). Needs safetensors too. The C++ tests read the cases from
the file's metadata.
"""
import argparse
import json
import os
import zlib

import torch
from safetensors.torch import save_file

OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "fixtures", "optimizer_trajectories.safetensors")
SHAPES = [[3, 4], [7], [2, 3, 5], [257]]
STEPS = 30
SCALES = [1.0, 1e-3, 1e3, 1e-20, 1e15]
# (parameter index, step) pairs whose gradient is None.
MISSING = {(1, 2), (1, 3), (1, 9), (3, 0), (2, 17)}

CASES = [
    ("sgd_plain", "SGD", [{"lr": 0.1}]),
    ("sgd_momentum", "SGD", [{"lr": 0.05, "momentum": 0.9}]),
    ("sgd_dampening", "SGD", [{"lr": 0.05, "momentum": 0.9, "dampening": 0.3}]),
    ("sgd_nesterov_wd", "SGD", [{"lr": 0.05, "momentum": 0.9, "nesterov": True, "weight_decay": 0.01}]),
    ("sgd_maximize", "SGD", [{"lr": 0.02, "momentum": 0.5, "maximize": True}]),
    ("sgd_groups", "SGD", [{"lr": 0.1, "momentum": 0.9, "params": [0, 1]},
                           {"lr": 0.01, "weight_decay": 0.1, "params": [2, 3]}]),
    ("adam_default", "Adam", [{"lr": 1e-3}]),
    ("adam_betas_eps", "Adam", [{"lr": 1e-2, "betas": (0.8, 0.95), "eps": 1e-6}]),
    ("adam_l2", "Adam", [{"lr": 1e-2, "weight_decay": 0.1}]),
    ("adam_amsgrad", "Adam", [{"lr": 1e-2, "amsgrad": True}]),
    ("adam_maximize", "Adam", [{"lr": 1e-2, "maximize": True}]),
    ("adam_groups", "Adam", [{"lr": 1e-2, "amsgrad": True, "params": [0, 2]},
                             {"lr": 1e-3, "weight_decay": 0.05, "betas": (0.5, 0.9), "params": [1, 3]}]),
    ("adamw_default", "AdamW", [{"lr": 1e-2}]),
    ("adamw_amsgrad", "AdamW", [{"lr": 1e-2, "weight_decay": 0.1, "amsgrad": True}]),
    ("adamw_groups", "AdamW", [{"lr": 1e-2, "weight_decay": 0.0, "params": [3]},
                               {"lr": 3e-3, "weight_decay": 0.2, "params": [0, 1, 2]}]),
]
BUFFERS = {"SGD": ["momentum_buffer"], "Adam": ["exp_avg", "exp_avg_sq", "max_exp_avg_sq"],
           "AdamW": ["exp_avg", "exp_avg_sq", "max_exp_avg_sq"]}


def run_case(name, kind, groups, dtype, tensors, implementation=None):
    generator = torch.Generator().manual_seed(zlib.crc32(name.encode()))
    params = [torch.nn.Parameter(torch.randn(shape, generator=generator, dtype=torch.float64).to(dtype))
              for shape in SHAPES]
    for i, p in enumerate(params):
        tensors[f"{name}.init.{i}"] = p.detach().clone()
    torch_groups = []
    for group in groups:
        group = dict(group)
        indices = group.pop("params", list(range(len(params))))
        torch_groups.append({"params": [params[i] for i in indices], **group})
    optimizer = getattr(torch.optim, kind)(torch_groups, **(implementation or {}))
    for step in range(STEPS):
        optimizer.zero_grad(set_to_none=True)
        scale = SCALES[step % len(SCALES)]
        for i, p in enumerate(params):
            if (i, step) in MISSING:
                continue
            grad = (torch.randn(p.shape, generator=generator, dtype=torch.float64) * scale).to(dtype)
            p.grad = grad
            tensors[f"{name}.grad.{step}.{i}"] = grad.clone()
        optimizer.step()
    for i, p in enumerate(params):
        tensors[f"{name}.final.{i}"] = p.detach().clone()
        state = optimizer.state[p]
        for buffer in BUFFERS[kind]:
            value = state.get(buffer)
            if isinstance(value, torch.Tensor):
                tensors[f"{name}.state.{i}.{buffer}"] = value.clone()
        if "step" in state:
            tensors[f"{name}.step.{i}"] = torch.tensor([int(state["step"])], dtype=torch.int64)
    description = []
    for group in groups:
        group = dict(group)
        indices = group.pop("params", list(range(len(params))))
        if "betas" in group:
            group["beta1"], group["beta2"] = group.pop("betas")
        description.append({"params": indices, "options": group})
    return {"name": name, "optimizer": kind, "groups": description}


# torch 2.x's implementations of the same optimizers (the keyword arguments that select them).
# fused=True only for Adam/AdamW: torch's fused CPU SGD fails on a step where a parameter has
# no gradient (TypeError in torch._fused_sgd_, torch 2.15), which these trajectories include.
IMPLEMENTATIONS = {"loop": {"foreach": False}, "foreach": {"foreach": True}, "fused": {"fused": True}}


def implementations(kind):
    return [(name, keywords) for name, keywords in IMPLEMENTATIONS.items() if name != "fused" or kind != "SGD"]


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--current", action="store_true",
                        help="a current torch: every implementation, into optimizer_trajectories_current.safetensors")
    current = parser.parse_args().current
    out = OUT.replace(".safetensors", "_current.safetensors") if current else OUT
    tensors = {}
    cases = []
    for dtype_name, dtype in (("f64", torch.float64), ("f32", torch.float32)):
        for name, kind, groups in CASES:
            for implementation, keywords in (implementations(kind) if current else [("", None)]):
                full_name = f"{name}_{dtype_name}" + (f"_{implementation}" if implementation else "")
                case = run_case(full_name, kind, groups, dtype, tensors, keywords)
                case["dtype"] = dtype_name
                if implementation:
                    case["implementation"] = implementation
                cases.append(case)
    metadata = {"cases": json.dumps(cases), "steps": str(STEPS), "shapes": json.dumps(SHAPES),
                "torch": torch.__version__, "generator": "tests/reference/generate_optimizer_fixtures.py"}
    OUT_FILE = out
    save_file(tensors, OUT_FILE, metadata=metadata)
    print(f"{len(cases)} cases written to {os.path.normpath(OUT_FILE)} with torch {torch.__version__}")


if __name__ == "__main__":
    main()
