#!/usr/bin/env python3
"""Generates tests/fixtures/diloco.safetensors: DiLoCo (Douillard et al. 2023, Algorithm 1) written
in torch, for tests/multirank/test_diloco.cpp.

W gloo processes (2, 3, 4) train generate_fsdp_fixtures.py's MLP on its batches (each rank its
own) with an inner optimizer and no gradient synchronization; every H inner steps each parameter's
pseudo-gradient (the model of the last synchronization minus the rank's) is averaged over the
ranks (divided by W, then allreduced), the parameters go back to the last synchronized model and
the outer optimizer, torch.optim.SGD with Nesterov momentum, steps them with it. This is what
torchft's DiLoCo does with one replica group per rank (its _save_grads / _restore_parameters /
outer step); torchft itself is not a dependency. Cases: inner AdamW with H = 4 and outer
(lr 0.7, momentum 0.9, Nesterov), inner SGD (momentum) with H = 3 and outer (lr 0.5, momentum
0.8, Nesterov), inner Adam with H = 6 and outer plain SGD (lr 1.0, no momentum: the average of
the models, LocalSGD). STEPS = 24. Recorded: every rank's loss per step and final weights.

    $(scripts/torch_env.sh) tests/reference/generate_diloco_fixtures.py   (with safetensors installed)
"""
import json
import os
import sys
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from safetensors.torch import save_file

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import generate_fsdp_fixtures as fsdp  # noqa: E402

OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "fixtures", "diloco.safetensors")
STEPS = 24
# name -> inner optimizer, H, outer lr, outer momentum, Nesterov
CASES = {"adamw": ("adamw", 4, 0.7, 0.9, True), "sgd": ("sgd", 3, 0.5, 0.8, True), "adam": ("adam", 6, 1.0, 0.0, False)}


def worker(rank, world, case, store_path, results):
    dist.init_process_group("gloo", init_method=f"file://{store_path}", rank=rank, world_size=world)
    inner_name, sync_every, outer_lr, outer_momentum, nesterov = CASES[case]
    net = fsdp.model()
    inner = fsdp.OPTIMIZERS[inner_name](net.parameters())
    outer = torch.optim.SGD(net.parameters(), lr=outer_lr, momentum=outer_momentum, nesterov=nesterov)
    original = {name: p.detach().clone() for name, p in net.named_parameters()}
    losses = []
    for step in range(STEPS):
        x, y = fsdp.batch(step, rank)
        inner.zero_grad()
        loss = torch.nn.functional.cross_entropy(net(x), y)
        loss.backward()
        inner.step()
        losses.append(loss.item())
        if (step + 1) % sync_every == 0:
            with torch.no_grad():
                for name, p in net.named_parameters():
                    delta = (original[name] - p) / world
                    dist.all_reduce(delta)
                    p.copy_(original[name])
                    p.grad = delta
            outer.step()
            outer.zero_grad()
            original = {name: p.detach().clone() for name, p in net.named_parameters()}
    results[rank] = (losses, {name: p.detach().clone() for name, p in net.named_parameters()})
    dist.destroy_process_group()


def main():
    tensors = {f"init.{name}": p.detach().clone() for name, p in fsdp.model().named_parameters()}
    fsdp.run_worlds(tensors, (2, 3, 4), CASES, worker, STEPS)
    settings = {name: {"inner": inner, "inner_settings": fsdp.SETTINGS[inner], "sync_every": h, "outer_lr": lr,
                       "outer_momentum": momentum, "nesterov": nesterov}
                for name, (inner, h, lr, momentum, nesterov) in CASES.items()}
    meta = {"steps": str(STEPS), "settings": json.dumps(settings), "torch": torch.__version__}
    save_file({k: v.contiguous() for k, v in tensors.items()}, OUT, metadata=meta)
    print(f"wrote {OUT}: {len(tensors)} tensors")


if __name__ == "__main__":
    main()
