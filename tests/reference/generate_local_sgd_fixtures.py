#!/usr/bin/env python3
"""Generates tests/fixtures/local_sgd.safetensors: PyTorch's LocalSGD (PostLocalSGDOptimizer over a
PeriodicModelAverager) for tests/multirank/test_local_sgd.cpp.

W gloo processes (2, 3, 4) train generate_fsdp_fixtures.py's MLP on its batches (each rank its
own), STEPS steps: before `warmup` steps each gradient is averaged over the ranks (divided by W,
then allreduced: what DDP's post_localSGD_hook does before start_localSGD_iter), after it none
is, and the averager averages the models every `period` steps from step `warmup` on. Cases:
SGD (momentum, weight decay) with period 4 after 5 warm-up steps, Adam likewise, AdamW with
period 3 and no warm-up. Recorded: every rank's loss per step and every rank's final weights.

    $(scripts/torch_env.sh) tests/reference/generate_local_sgd_fixtures.py   (with safetensors installed)
"""
import json
import os
import sys

import torch
import torch.distributed as dist
from safetensors.torch import save_file
from torch.distributed.algorithms.model_averaging.averagers import PeriodicModelAverager
from torch.distributed.optim import PostLocalSGDOptimizer

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import generate_fsdp_fixtures as fsdp  # noqa: E402

OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "fixtures", "local_sgd.safetensors")
STEPS = 24
CASES = {"sgd": ("sgd", 4, 5), "adam": ("adam", 4, 5), "adamw": ("adamw", 3, 0)}  # optimizer, period, warm-up


def worker(rank, world, case, store_path, results):
    dist.init_process_group("gloo", init_method=f"file://{store_path}", rank=rank, world_size=world)
    optimizer_name, period, warmup = CASES[case]
    net = fsdp.model()
    optimizer = PostLocalSGDOptimizer(optim=fsdp.OPTIMIZERS[optimizer_name](net.parameters()),
                                      averager=PeriodicModelAverager(period=period, warmup_steps=warmup))
    losses = []
    for step in range(STEPS):
        x, y = fsdp.batch(step, rank)
        optimizer.zero_grad()
        loss = torch.nn.functional.cross_entropy(net(x), y)
        loss.backward()
        if step < warmup:
            for p in net.parameters():
                p.grad /= world
                dist.all_reduce(p.grad)
        optimizer.step()
        losses.append(loss.item())
    results[rank] = (losses, {name: p.detach().clone() for name, p in net.named_parameters()})
    dist.destroy_process_group()


def main():
    tensors = {f"init.{name}": p.detach().clone() for name, p in fsdp.model().named_parameters()}
    fsdp.run_worlds(tensors, (2, 3, 4), CASES, worker, STEPS, every_rank_final=True)
    settings = {name: fsdp.SETTINGS[optimizer] | {"period": period, "warmup": warmup}
                for name, (optimizer, period, warmup) in CASES.items()}
    meta = {"steps": str(STEPS), "settings": json.dumps(settings), "torch": torch.__version__}
    save_file({k: v.contiguous() for k, v in tensors.items()}, OUT, metadata=meta)
    print(f"wrote {OUT}: {len(tensors)} tensors")


if __name__ == "__main__":
    main()
