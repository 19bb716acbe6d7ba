#!/usr/bin/env python3
"""PyTorch DDP (gloo) training the GPT that examples/gpt_ddp.cpp trains, the same config, batches
and optimizer, one thread per rank; prints tokens/s, the step time and the share of it spent
in synchronisation and the optimizer (the step minus forward and backward without DDP's hooks),
for benchmarks/compare_gpt.sh:
    python benchmarks/torch_gpt.py --ranks 2 --layers 4 --heads 4 --embd 128 --block 64 --batch 8 --steps 30
"""
import argparse
import math
import os
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.nn.parallel import DistributedDataParallel as DDP

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "reference"))


def build(args):
    import generate_gpt_fixtures as g  # the reference model, nanoGPT's module names
    g.VOCAB, g.BLOCK, g.LAYERS, g.HEADS, g.EMBD = args.vocab, args.block, args.layers, args.heads, args.embd
    return g.GPT("tanh")


def worker(rank, args, store, out):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=args.ranks)
    torch.manual_seed(1)
    model = DDP(build(args))
    params = dict(model.module.named_parameters())
    optimizer = torch.optim.AdamW([{"params": [p for p in params.values() if p.dim() >= 2], "weight_decay": 0.1},
                                   {"params": [p for p in params.values() if p.dim() < 2], "weight_decay": 0.0}],
                                  lr=1e-3, betas=(0.9, 0.95))
    data = torch.randint(0, args.vocab, (200000,), generator=torch.Generator().manual_seed(3))
    span = len(data) - args.block - 1

    def batch(step):
        starts = [((step * args.batch * args.ranks + rank * args.batch + j) * args.block) % span for j in range(args.batch)]
        return (torch.stack([data[s:s + args.block] for s in starts]),
                torch.stack([data[s + 1:s + 1 + args.block] for s in starts]))

    def step(s, sync=True):
        x, y = batch(s)
        optimizer.zero_grad(set_to_none=True)
        if sync:
            model(x, y).backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
        else:
            with model.no_sync():
                model(x, y).backward()

    for s in range(3):
        step(s)
    dist.barrier()
    start = time.perf_counter()
    for s in range(args.steps):
        step(s)
    dist.barrier()
    full = (time.perf_counter() - start) / args.steps
    start = time.perf_counter()
    for s in range(args.steps):
        step(s, sync=False)
    dist.barrier()
    local = (time.perf_counter() - start) / args.steps
    if rank == 0:
        out.put((full, local))
    dist.destroy_process_group()


def main():
    parser = argparse.ArgumentParser()
    for name, default in (("ranks", 2), ("layers", 4), ("heads", 4), ("embd", 128), ("block", 64), ("batch", 8),
                          ("steps", 30), ("vocab", 65)):
        parser.add_argument("--" + name, type=int, default=default)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as folder:
        queue = mp.get_context("spawn").SimpleQueue()
        mp.spawn(worker, args=(args, os.path.join(folder, "store"), queue), nprocs=args.ranks)
        full, local = queue.get()
    tokens = args.batch * args.ranks * args.block
    print(f"torch {torch.__version__} DDP: step {full * 1e3:.1f} ms, {tokens / full:.0f} tokens/s, "
          f"forward+backward alone {local * 1e3:.1f} ms, synchronisation + optimizer {(full - local) / full * 100:.0f}% of the step")


if __name__ == "__main__":
    main()
