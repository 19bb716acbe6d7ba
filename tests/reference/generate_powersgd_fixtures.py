#!/usr/bin/env python3
"""Generates tests/fixtures/powersgd.safetensors: PyTorch DDP with its powerSGD_hook, for
tests/multirank/test_powersgd.cpp (PowerSGDReference.*).

W gloo processes train a small MLP (Linear(32, 32), Tanh, Linear(32, 32), Tanh, Linear(32, 4))
on random regression data with SGD for 20 steps; the model fits one DDP bucket. A wrapper around
powerSGD_hook records, per step and rank, the bucket's buffer as the hook receives it (before
error feedback) and after it (the reduced gradients), and the state's P and Q memories and error
feedback after the step; the numpy draws that seed each randomisation of Q are recorded too
(they check gradsync's copy of numpy's and torch's generators). Cases:
  w2_r1       2 ranks, rank 1 (Gram-Schmidt), start_powerSGD_iter 5
  w3_r4       3 ranks, rank 4 (torch.linalg.qr from rank 3 on), start 5
  w2_r2_batch 2 ranks, rank 2, batch_tensors_with_same_shape (the two 32 x 32 share a draw), start 5
  w2_r1_cold  2 ranks, rank 1, no warm start (a fresh random Q every step), start 3

Needs a current torch (2.x), numpy and safetensors from PyPI:
    python3 -m venv /tmp/torch && /tmp/torch/bin/pip install torch safetensors numpy
    /tmp/torch/bin/python tests/reference/generate_powersgd_fixtures.py
"""
import json
import os
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from safetensors.torch import save_file
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as powersgd
from torch.nn.parallel import DistributedDataParallel as DDP

OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "fixtures", "powersgd.safetensors")
STEPS = 20
BATCH = 8
CASES = {
    "w2_r1": dict(world=2, rank=1, start=5, batch=False, warm=True),
    "w3_r4": dict(world=3, rank=4, start=5, batch=False, warm=True),
    "w2_r2_batch": dict(world=2, rank=2, start=5, batch=True, warm=True),
    "w2_r1_cold": dict(world=2, rank=1, start=3, batch=False, warm=False),
}


def model():
    torch.manual_seed(1234)
    return torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.Tanh(), torch.nn.Linear(32, 32), torch.nn.Tanh(),
                               torch.nn.Linear(32, 4))


def worker(rank, name, store_path, results):
    case = CASES[name]
    dist.init_process_group("gloo", init_method=f"file://{store_path}", rank=rank, world_size=case["world"])
    net = model()
    names = {id(p): n for n, p in net.named_parameters()}
    ddp = DDP(net)
    state = powersgd.PowerSGDState(process_group=None, matrix_approximation_rank=case["rank"],
                                   start_powerSGD_iter=case["start"], warm_start=case["warm"],
                                   use_error_feedback=True, random_seed=7,
                                   batch_tensors_with_same_shape=case["batch"])
    seeds = []

    class Recording:  # numpy's RandomState, its draws noted
        def __init__(self, rng):
            self.rng = rng

        def randint(self, high):
            seeds.append(int(self.rng.randint(high)))
            return seeds[-1]

    state.rng = Recording(state.rng)
    record = {}

    def hook(s, bucket):
        buffer = bucket.buffer()
        record["input"] = buffer.detach().clone()
        # DDP rebuilds its buckets after the first step (in the order gradients became ready):
        # the layout of every step is recorded.
        base = buffer.data_ptr()
        record["layout"] = [(names[id(p)], list(g.shape), (g.data_ptr() - base) // 4)
                            for p, g in zip(bucket.parameters(), bucket.gradients())]
        return powersgd.powerSGD_hook(s, bucket)

    ddp.register_comm_hook(state, hook)
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.1)
    generator = torch.Generator().manual_seed(100 + rank)
    out = {}
    layouts = []
    for step in range(STEPS):
        x = torch.randn(BATCH, 32, generator=generator)
        y = torch.randn(BATCH, 4, generator=generator)
        optimizer.zero_grad()
        torch.nn.functional.mse_loss(ddp(x), y).backward()
        prefix = f"{name}.rank{rank}.step{step}"
        out[f"{prefix}.input"] = record["input"]
        # The reduced gradients, in the bucket's layout (the hook's output buffer).
        reduced = torch.zeros_like(record["input"])
        parameters = dict(ddp.module.named_parameters())
        for pname, shape, offset in record["layout"]:
            grad = parameters[pname].grad.reshape(-1)
            reduced[offset:offset + grad.numel()] = grad
        out[f"{prefix}.output"] = reduced
        layouts.append(record["layout"])
        if 0 in state.p_memory_dict:
            out[f"{prefix}.p"] = state.p_memory_dict[0].clone()
            out[f"{prefix}.q"] = state.q_memory_dict[0].clone()
        if 0 in state.error_dict:
            out[f"{prefix}.error"] = state.error_dict[0].clone()
        optimizer.step()
    results[rank] = (out, layouts, seeds)
    dist.destroy_process_group()


def main():
    tensors = {}
    meta = {}
    for name, case in CASES.items():
        with tempfile.TemporaryDirectory() as folder:
            manager = mp.Manager()
            results = manager.dict()
            mp.spawn(worker, args=(name, os.path.join(folder, "store"), results), nprocs=case["world"])
            for rank in range(case["world"]):
                out, layout, seeds = results[rank]
                tensors.update({k: v.contiguous() for k, v in out.items()})
            meta[f"{name}.layout"] = json.dumps(layout)
            meta[f"{name}.seeds"] = json.dumps(seeds)
            meta[f"{name}.case"] = json.dumps(case)
    # torch's generator itself, for the unit test of gradsync's copy: randn of 10 and of 40
    # elements after manual_seed(seed), for the first seed a case drew.
    seed = json.loads(meta["w2_r1.seeds"])[0]
    torch.manual_seed(seed)
    tensors["randn.small"] = torch.randn(10)
    tensors["randn.large"] = torch.randn(40)
    tensors["randn.double"] = torch.randn(40, dtype=torch.float64)
    meta["randn.seed"] = str(seed)
    meta["steps"] = str(STEPS)
    meta["torch"] = torch.__version__
    save_file(tensors, OUT, metadata=meta)
    print(f"wrote {OUT}: {len(tensors)} tensors")


if __name__ == "__main__":
    main()
