#!/usr/bin/env python3
"""PyTorch DDP on gloo with bench_ddp's model, ranks and microbatches, for the side-by-side.

    python3 benchmarks/torch_ddp.py --ranks 2 --microbatches 1,4 --out torch_ddp.txt

Model: 24 x (Linear(1024, 1024) + ReLU), 8 samples per microbatch, MSE loss, SGD(momentum
0.9); one thread per rank (as our ranks). For each microbatch count: "local" (the same model
without DDP: torch's compute-only step), "sync" (every microbatch synchronized: MULTI) and
"no_sync" (all but the last under no_sync: SINGLE). Median step time of 3 after a warm-up, the
slowest rank's. Rank 0 writes "mode microbatches seconds" lines that bench_ddp --torch reads,
which then compares synchronization costs (step minus compute-only step) as well as whole
steps. Any torch works (a current one from PyPI, or Debian's python3-torch); never a dependency
of gradsync.
"""
import argparse
import contextlib
import os
import socket
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.nn.parallel import DistributedDataParallel as DDP


def worker(rank, size, port, args):
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=size)
    torch.manual_seed(1)
    layers = []
    for _ in range(args.layers):
        layers += [torch.nn.Linear(args.width, args.width), torch.nn.ReLU()]
    local = torch.nn.Sequential(*layers)
    local_optimizer = torch.optim.SGD(local.parameters(), lr=1e-4, momentum=0.9)
    model = DDP(torch.nn.Sequential(*[torch.nn.Linear(args.width, args.width) if isinstance(layer, torch.nn.Linear)
                                      else torch.nn.ReLU() for layer in layers]))
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-4, momentum=0.9)
    x = torch.full((args.batch, args.width), 0.5)
    target = torch.zeros(args.batch, args.width)
    lines = []
    for microbatches in [int(m) for m in args.microbatches.split(",")]:
        for mode in ("local", "no_sync", "sync"):
            net, opt = (local, local_optimizer) if mode == "local" else (model, optimizer)

            def step():
                for mb in range(microbatches):
                    last = mb + 1 == microbatches
                    context = model.no_sync() if mode == "no_sync" and not last else contextlib.nullcontext()
                    with context:
                        loss = torch.nn.functional.mse_loss(net(x), target) / microbatches
                        loss.backward()
                opt.step()
                opt.zero_grad()
            step()
            times = []
            for _ in range(args.steps):
                dist.barrier()
                start = time.perf_counter()
                step()
                times.append(time.perf_counter() - start)
            median = torch.tensor([sorted(times)[len(times) // 2]], dtype=torch.float64)
            dist.all_reduce(median, op=dist.ReduceOp.MAX)
            lines.append(f"{mode} {microbatches} {median.item():.6f}")
            if rank == 0:
                print(f"torch DDP gloo, {size} ranks, {microbatches} microbatch(es), {mode}: {median.item() * 1e3:.1f} ms/step",
                      flush=True)
    if rank == 0:
        with open(args.out, "w") as f:
            f.write("\n".join(lines) + "\n")
    # Leave without destroy_process_group(): torch 1.13's gloo teardown can hang at exit
    # once the work is done; the barrier makes sure every rank has finished.
    dist.barrier()
    os._exit(0)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--microbatches", default="1,4")
    parser.add_argument("--layers", type=int, default=24)
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    with socket.socket() as s:
        s.bind(("", 0))
        port = s.getsockname()[1]
    mp.spawn(worker, args=(args.ranks, port, args), nprocs=args.ranks)


if __name__ == "__main__":
    main()
