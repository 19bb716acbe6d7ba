#!/usr/bin/env python3
"""Generates tests/fixtures/join.safetensors: PyTorch DDP under torch.distributed.algorithms.Join
with uneven inputs, for tests/multirank/test_join.cpp (JoinReference.*).

Three gloo processes train a linear regression (Linear(8, 1), loss 0.5 * mean((x.w + b - y)^2))
on rank-dependent numbers of batches (5, 3, 4). Each step is M microbatches, the first M - 1
under no_sync (gradient accumulation), the last one synchronized. The cases cross SGD (momentum
0.9) and Adam with divide_by_initial_world_size True and False and M = 1, 2. The file holds the
data (x, y per rank/step/microbatch), the initial weights and, per case, the final weights
(every rank's, equal after Join's final broadcast from the last joiner) and the last joiner.

Needs a current torch (2.x) and safetensors from PyPI:
    python3 -m venv /tmp/torch && /tmp/torch/bin/pip install torch safetensors numpy
    /tmp/torch/bin/python tests/reference/generate_join_fixtures.py
"""
import json
import os
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from safetensors.torch import save_file
from torch.distributed.algorithms.join import Join
from torch.nn.parallel import DistributedDataParallel as DDP

OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "fixtures", "join.safetensors")
WORLD = 3
COUNTS = [5, 3, 4]
FEATURES = 8
PER_MICRO = 4
MAX_MICRO = 2
CASES = [(opt, div, micro) for opt in ("sgd", "adam") for div in (True, False) for micro in (1, 2)]


def case_name(opt, div, micro):
    return f"{opt}.{'initial' if div else 'active'}.m{micro}"


def data():
    g = torch.Generator().manual_seed(11)
    truth = torch.randn(FEATURES, generator=g)
    x = torch.randn(WORLD, max(COUNTS), MAX_MICRO, PER_MICRO, FEATURES, generator=g)
    y = x @ truth + 0.5 + 0.1 * torch.randn(WORLD, max(COUNTS), MAX_MICRO, PER_MICRO, generator=g)
    w0 = 0.1 * torch.randn(1, FEATURES, generator=g)
    b0 = torch.tensor([0.2])
    return x, y, w0, b0


def worker(rank, store_path, results):
    dist.init_process_group("gloo", init_method=f"file://{store_path}", rank=rank, world_size=WORLD)
    torch.set_num_threads(1)
    x, y, w0, b0 = data()
    out = {}
    for opt_name, div, micro in CASES:
        model = torch.nn.Linear(FEATURES, 1)
        with torch.no_grad():
            model.weight.copy_(w0)
            model.bias.copy_(b0)
        ddp = DDP(model)
        if opt_name == "sgd":
            opt = torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=0.9)
        else:
            opt = torch.optim.Adam(ddp.parameters(), lr=0.01)
        with Join([ddp], divide_by_initial_world_size=div):
            for step in range(COUNTS[rank]):
                for mb in range(micro):
                    def backward():
                        pred = ddp(x[rank, step, mb]).squeeze(1)
                        loss = 0.5 * ((pred - y[rank, step, mb]) ** 2).mean()
                        loss.backward()
                    if mb + 1 < micro:
                        with ddp.no_sync():
                            backward()
                    else:
                        backward()
                opt.step()
                opt.zero_grad()
        name = case_name(opt_name, div, micro)
        out[name + ".weight"] = model.weight.detach().clone().reshape(-1)
        out[name + ".bias"] = model.bias.detach().clone()
        out[name + ".authoritative_rank"] = torch.tensor([float(ddp._authoritative_rank)], dtype=torch.float64)
    results[rank] = out
    dist.destroy_process_group()


def main():
    with tempfile.TemporaryDirectory() as scratch:
        manager = mp.Manager()
        results = manager.dict()
        mp.spawn(worker, args=(os.path.join(scratch, "store"), results), nprocs=WORLD, join=True)
        results = dict(results)
    x, y, w0, b0 = data()
    tensors = {"x": x.contiguous(), "y": y.contiguous(), "w0": w0.reshape(-1).contiguous(), "b0": b0,
               "counts": torch.tensor(COUNTS, dtype=torch.int64)}
    for key, value in results[0].items():
        for r in range(1, WORLD):
            assert torch.equal(results[r][key], value), f"{key}: rank {r} differs from rank 0 after Join"
        tensors[key] = value.contiguous()
    meta = {"torch": torch.__version__, "world": str(WORLD), "features": str(FEATURES), "per_micro": str(PER_MICRO),
            "cases": json.dumps([case_name(*c) for c in CASES])}
    save_file(tensors, OUT, metadata=meta)
    print(f"wrote {OUT} ({len(tensors)} tensors, torch {torch.__version__})")


if __name__ == "__main__":
    main()
