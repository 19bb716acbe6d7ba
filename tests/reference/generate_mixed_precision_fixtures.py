#!/usr/bin/env python3
"""Generates tests/fixtures/mixed_precision.safetensors: PyTorch's master-weight recipe and
torch.amp.GradScaler, step by step, for tests/unit/test_mixed_precision.cpp.

The recipe (Megatron, DeepSpeed, llm.c and Apex O2 all do this): the model holds f16/bf16
parameters; the optimizer holds an f32 copy ("master weights") and steps that; after each
step the model is overwritten with the master rounded to nearest even. Gradients arrive in
the model's dtype (or in f32) and are widened into master.grad. In torch:

    master = [p.detach().float().requires_grad_() for p in model]
    opt = torch.optim.Adam(master, ...)
    each step: m.grad = p.grad.float(); [scaler.unscale_(opt); clip_grad_norm_(master)];
               opt.step() (or scaler.step(opt); scaler.update()); p.copy_(m)

Two kinds of cases:
  * master_*: bf16 or f16 models, gradients in the model's dtype or in f32, SGD (momentum,
    Nesterov, weight decay), Adam and AdamW (amsgrad); some gradients absent (None);
  * scaler_*: fp16 models (and one f32 model) under GradScaler with a short growth interval,
    gradients that overflow on purpose (f16: large values times the scale; f32: an inf and a
    NaN injected), one case with clipping after unscale_. Per step the file records the scale
    used, whether the step was skipped, and (with clipping) the total norm.

Needs a current torch (2.x) and safetensors from PyPI:
    python3 -m venv /tmp/torch && /tmp/torch/bin/pip install torch safetensors numpy
    /tmp/torch/bin/python tests/reference/generate_mixed_precision_fixtures.py
"""
import argparse
import json
import os
import zlib

import torch
from safetensors.torch import save_file

OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "fixtures", "mixed_precision.safetensors")
SHAPES = [[3, 4], [7], [2, 3, 5], [257]]
STEPS = 20
MISSING = {(1, 2), (1, 3), (3, 0), (2, 11)}
DTYPES = {"f32": torch.float32, "f16": torch.float16, "bf16": torch.bfloat16}
BUFFERS = {"SGD": ["momentum_buffer"], "Adam": ["exp_avg", "exp_avg_sq", "max_exp_avg_sq"],
           "AdamW": ["exp_avg", "exp_avg_sq", "max_exp_avg_sq"]}

OPTIMIZERS = [
    ("sgd", "SGD", {"lr": 0.05, "momentum": 0.9, "nesterov": True, "weight_decay": 0.01}),
    ("adam", "Adam", {"lr": 1e-2}),
    ("adamw_amsgrad", "AdamW", {"lr": 1e-2, "weight_decay": 0.1, "amsgrad": True}),
]
# Gradient magnitude per step for the master cases: ordinary, small (f16 subnormal range
# after rounding) and large.
MAGNITUDES = [1.0, 1e-3, 10.0, 1e-6]
# GradScaler cases: (name, model dtype, optimizer, options, clip max_norm, magnitudes, injected)
# `injected` maps a step to the value written into one gradient element (f32 overflow).
SCALER_CASES = [
    ("scaler_adam_f16", "f16", "Adam", {"lr": 1e-2}, None,
     [1.0, 1.0, 1.0, 0.01, 0.01, 0.01, 0.01, 0.01, 0.01, 0.01, 50.0, 0.01, 0.01, 0.01, 1e-4, 1e-4, 1e-4, 1e-4, 1e-4, 1e-4], {}),
    ("scaler_clip_adamw_f16", "f16", "AdamW", {"lr": 1e-2, "weight_decay": 0.05}, 0.5,
     [0.1, 0.1, 2.0, 0.1, 0.1, 0.1, 0.1, 0.1, 0.1, 0.1, 0.1, 5.0, 0.1, 0.1, 0.1, 0.1, 0.1, 0.1, 0.1, 0.1], {}),
    ("scaler_sgd_f32", "f32", "SGD", {"lr": 0.05, "momentum": 0.9}, None,
     [1.0] * STEPS, {4: float("inf"), 9: float("nan")}),
]
SCALER = {"init_scale": 2.0 ** 16, "growth_factor": 2.0, "backoff_factor": 0.5, "growth_interval": 3}


def options_json(options):
    return {k: v for k, v in options.items()}


def record_final(name, kind, model, master, optimizer, tensors):
    for i, (p, m) in enumerate(zip(model, master)):
        tensors[f"{name}.model.{i}"] = p.detach().clone()
        if m is not p:
            tensors[f"{name}.master.{i}"] = m.detach().clone()
        state = optimizer.state[m]
        for buffer in BUFFERS[kind]:
            value = state.get(buffer)
            if isinstance(value, torch.Tensor):
                tensors[f"{name}.state.{i}.{buffer}"] = value.clone()
        if "step" in state:
            tensors[f"{name}.step.{i}"] = torch.tensor([int(state["step"])], dtype=torch.int64)


def make_model(name, dtype, tensors):
    generator = torch.Generator().manual_seed(zlib.crc32(name.encode()))
    model = [torch.randn(shape, generator=generator, dtype=torch.float64).to(dtype) for shape in SHAPES]
    for i, p in enumerate(model):
        tensors[f"{name}.init.{i}"] = p.clone()
    # The f32 master copy; an f32 model is its own master.
    master = [p if dtype == torch.float32 else p.float().clone() for p in model]
    for m in master:
        m.requires_grad_(True)
    return generator, model, master


def master_case(name, model_dtype, grad_dtype, kind, options, tensors):
    generator, model, master = make_model(name, DTYPES[model_dtype], tensors)
    optimizer = getattr(torch.optim, kind)(master, **options)
    for step in range(STEPS):
        optimizer.zero_grad(set_to_none=True)
        for i, (p, m) in enumerate(zip(model, master)):
            if (i, step) in MISSING:
                continue
            grad = (torch.randn(p.shape, generator=generator, dtype=torch.float64) * MAGNITUDES[step % len(MAGNITUDES)])
            grad = grad.to(DTYPES[grad_dtype])
            tensors[f"{name}.grad.{step}.{i}"] = grad.clone()
            m.grad = grad.float()
        optimizer.step()
        with torch.no_grad():
            for p, m in zip(model, master):
                p.copy_(m)  # round to nearest even
    record_final(name, kind, model, master, optimizer, tensors)
    return {"name": name, "kind": "master", "optimizer": kind, "options": options_json(options),
            "model_dtype": model_dtype, "grad_dtype": grad_dtype}


def scaler_case(name, model_dtype, kind, options, clip, magnitudes, injected, tensors):
    generator, model, master = make_model(name, DTYPES[model_dtype], tensors)
    optimizer = getattr(torch.optim, kind)(master, **options)
    scaler = torch.amp.GradScaler("cpu", **SCALER)
    scaler.scale(torch.ones(()))  # creates the scale tensor (a real loop scales its loss here)
    scales, skipped, norms = [], [], []
    for step in range(STEPS):
        optimizer.zero_grad(set_to_none=True)
        scale = scaler.get_scale()
        scales.append(scale)
        for i, (p, m) in enumerate(zip(model, master)):
            true_grad = torch.randn(p.shape, generator=generator, dtype=torch.float64) * magnitudes[step]
            if step in injected and i == 2:
                true_grad[0, 1, 2] = injected[step]
            # What a backward of the scaled loss leaves in the model's gradient: the true
            # gradient times the scale, rounded to the model's dtype (f16 overflows to inf).
            grad = (true_grad * scale).to(DTYPES[model_dtype])
            tensors[f"{name}.grad.{step}.{i}"] = grad.clone()
            m.grad = grad.float() if m is not p else grad.clone()
        if clip is not None:
            scaler.unscale_(optimizer)
            norms.append(float(torch.nn.utils.clip_grad_norm_(master, clip)))
        scaler.step(optimizer)
        scaler.update()
        skipped.append(1 if scaler.get_scale() < scale else 0)
        with torch.no_grad():
            for p, m in zip(model, master):
                if m is not p:
                    p.copy_(m)
    record_final(name, kind, model, master, optimizer, tensors)
    tensors[f"{name}.scales"] = torch.tensor(scales, dtype=torch.float64)
    tensors[f"{name}.skipped"] = torch.tensor(skipped, dtype=torch.int64)
    tensors[f"{name}.final_scale"] = torch.tensor([scaler.get_scale()], dtype=torch.float64)
    tensors[f"{name}.final_growth_tracker"] = torch.tensor([int(scaler.state_dict()["_growth_tracker"])],
                                                           dtype=torch.int64)
    if clip is not None:
        tensors[f"{name}.norms"] = torch.tensor(norms, dtype=torch.float64)
    return {"name": name, "kind": "scaler", "optimizer": kind, "options": options_json(options),
            "model_dtype": model_dtype, "grad_dtype": model_dtype, "clip": clip, "scaler": SCALER}


def main():
    argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter).parse_args()
    tensors = {}
    cases = []
    for short, kind, options in OPTIMIZERS:
        for model_dtype in ("bf16", "f16"):
            for grad_dtype in (model_dtype, "f32"):
                name = f"master_{short}_{model_dtype}_grad_{grad_dtype}"
                cases.append(master_case(name, model_dtype, grad_dtype, kind, options, tensors))
    for name, model_dtype, kind, options, clip, magnitudes, injected in SCALER_CASES:
        cases.append(scaler_case(name, model_dtype, kind, options, clip, magnitudes, injected, tensors))
    metadata = {"cases": json.dumps(cases), "steps": str(STEPS), "shapes": json.dumps(SHAPES),
                "torch": torch.__version__, "generator": "tests/reference/generate_mixed_precision_fixtures.py"}
    save_file(tensors, OUT, metadata=metadata)
    for case in cases:
        if case["kind"] == "scaler":
            print(case["name"], "scales", tensors[case["name"] + ".scales"].tolist(),
                  "skipped", tensors[case["name"] + ".skipped"].tolist())
    print(f"{len(cases)} cases written to {os.path.normpath(OUT)} with torch {torch.__version__}")


if __name__ == "__main__":
    main()
