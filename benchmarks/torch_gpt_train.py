#!/usr/bin/env python3
"""PyTorch DDP (gloo) training the GPT of examples/gpt_ddp.cpp as gpt_ddp trains it, for runs
compared with it side by side: a uint16 token file, gpt_ddp's deterministic batches, nanoGPT's
AdamW groups, warmup and cosine learning rate and clipping, optionally PyTorch's powerSGD_hook;
per-step losses into a JSON-lines file (gpt_ddp's --metrics format) and gpt_ddp's validation loss:
    python benchmarks/torch_gpt_train.py --data train.bin --val val.bin --vocab 73 --steps 1500 \\
        --powersgd-rank 1 --powersgd-start 100 --metrics torch_r1.jsonl
One thread per rank. The weights start from torch's initialisation of the reference model
(tests/reference/generate_gpt_fixtures.py), so runs compare as training curves, not bitwise.
"""
import argparse
import json
import math
import os
import sys
import tempfile

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.nn.parallel import DistributedDataParallel as DDP

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "reference"))


def tokens(path):
    return torch.from_numpy(np.fromfile(path, dtype="<u2").astype(np.int64))


def worker(rank, args, store, out):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=args.ranks)
    import generate_gpt_fixtures as g  # the reference model, nanoGPT's module names
    g.VOCAB, g.BLOCK, g.LAYERS, g.HEADS, g.EMBD = args.vocab, args.length, args.layers, args.heads, args.embd
    torch.manual_seed(args.seed)
    model = DDP(g.GPT("tanh"))
    if args.powersgd_rank > 0:
        from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as powersgd
        state = powersgd.PowerSGDState(process_group=None, matrix_approximation_rank=args.powersgd_rank,
                                       start_powerSGD_iter=args.powersgd_start)
        # powerSGD_hook launches its second and third allreduce from future callbacks; with two
        # buckets on Gloo those interleave differently on the ranks (a collective mismatch,
        # "Received data size doesn't match expected size", seen here). Waiting inside the hook
        # finishes each bucket before the next is launched, in the same order everywhere, as
        # gradsync's hook runs.
        def in_order(hook_state, bucket):
            future = powersgd.powerSGD_hook(hook_state, bucket)
            future.wait()
            return future
        model.register_comm_hook(state, in_order)
    parameters = list(model.module.parameters())
    optimizer = torch.optim.AdamW([{"params": [p for p in parameters if p.dim() >= 2], "weight_decay": 0.1},
                                   {"params": [p for p in parameters if p.dim() < 2], "weight_decay": 0.0}],
                                  lr=args.lr, betas=(0.9, 0.95))
    data = tokens(args.data)
    span = len(data) - args.length - 1

    def lr_at(step):  # nanoGPT's get_lr, as gpt_ddp's learning_rate
        if step < args.warmup:
            return args.lr * (step + 1) / (args.warmup + 1)
        ratio = (step - args.warmup) / max(args.steps - args.warmup, 1)
        return args.min_lr + 0.5 * (1.0 + math.cos(math.pi * ratio)) * (args.lr - args.min_lr)

    losses = []
    for step in range(args.steps):
        starts = [((step * args.batch * args.ranks + rank * args.batch + j) * args.length) % span for j in range(args.batch)]
        x = torch.stack([data[s:s + args.length] for s in starts])
        y = torch.stack([data[s + 1:s + 1 + args.length] for s in starts])
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step)
        optimizer.zero_grad(set_to_none=True)
        loss = model(x, y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        losses.append(loss.item())
    # The ranks' mean loss per step, in one collective after the run: one issued between steps
    # can interleave with powerSGD_hook's, which it launches from its futures' callbacks.
    mean_losses = torch.tensor(losses, dtype=torch.float64)
    dist.all_reduce(mean_losses)
    if args.metrics and rank == 0:
        with open(args.metrics, "w") as metrics:
            for step, value in enumerate(mean_losses.tolist(), 1):  # the steps done, as gpt_ddp numbers them
                metrics.write(json.dumps({"step": step, "loss": value / args.ranks}) + "\n")
    if args.val:
        val = tokens(args.val)
        val_span = len(val) - args.length - 1
        total = 0.0
        with torch.no_grad():
            for k in range(16):
                starts = [(((k * args.ranks + rank) * args.batch + j) * args.length) % val_span for j in range(args.batch)]
                x = torch.stack([val[s:s + args.length] for s in starts])
                y = torch.stack([val[s + 1:s + 1 + args.length] for s in starts])
                total += model.module(x, y).item() / 16
        mean = torch.tensor([total])
        dist.all_reduce(mean)
        if rank == 0:
            out.put(mean.item() / args.ranks)
    elif rank == 0:
        out.put(float("nan"))
    dist.destroy_process_group()


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    for name, default in (("ranks", 2), ("layers", 4), ("heads", 4), ("embd", 128), ("length", 64), ("batch", 8),
                          ("steps", 1500), ("vocab", 73), ("warmup", 50), ("powersgd-rank", 0), ("powersgd-start", 100),
                          ("seed", 1)):
        parser.add_argument("--" + name, type=int, default=default)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--min-lr", type=float, default=3e-4)
    parser.add_argument("--data", required=True)
    parser.add_argument("--val", default="")
    parser.add_argument("--metrics", default="")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as folder:
        queue = mp.get_context("spawn").SimpleQueue()
        mp.spawn(worker, args=(args, os.path.join(folder, "store"), queue), nprocs=args.ranks)
        print(f"torch {torch.__version__} DDP{' + powerSGD_hook rank ' + str(args.powersgd_rank) if args.powersgd_rank else ''}: "
              f"validation loss {queue.get():.4f}")


if __name__ == "__main__":
    main()
