#!/usr/bin/env python3
"""torch.distributed on gloo: the same collectives, ranks and sizes as bench_collectives.

    python3 benchmarks/torch_collectives.py --ranks 2 --max-bytes 67108864 --out torch.txt

Spawns the ranks as processes (as torchrun would), times allreduce (sum), all_gather_into_tensor
(all_gather on old torch) and broadcast of f32 tensors from 4 B to --max-bytes by factors of 4:
average per call, best of three rounds, the slowest rank's figure, exactly as
bench_collectives times ours. Rank 0 writes "op bytes microseconds" lines that
bench_collectives --torch reads. Needs torch (Debian's python3-torch); a benchmark companion,
never a dependency of the library or its tests.
"""
import argparse
import os
import socket
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def time_calls(iterations, call):
    call()
    best = float("inf")
    for _ in range(3):
        dist.barrier()
        start = time.perf_counter()
        for _ in range(iterations):
            call()
        best = min(best, (time.perf_counter() - start) / iterations)
    slowest = torch.tensor([best], dtype=torch.float64)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
    return slowest.item()


def worker(rank, size, port, max_bytes, out):
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=size)
    lines = []
    for op in ("allreduce", "allgather", "broadcast"):
        nbytes = 4
        while nbytes <= max_bytes:
            count = nbytes // 4
            iterations = max(3, min(100, (32 << 20) // nbytes))
            per_rank = max(count // size, 1) if op == "allgather" else count
            data = torch.zeros(per_rank, dtype=torch.float32)
            if op == "allreduce":
                call = lambda: dist.all_reduce(data)
                reported = data.numel() * 4
            elif op == "allgather":
                gathered = [torch.zeros_like(data) for _ in range(size)]
                call = lambda: dist.all_gather(gathered, data)
                reported = data.numel() * 4 * size
            else:
                call = lambda: dist.broadcast(data, 0)
                reported = data.numel() * 4
            seconds = time_calls(iterations, call)
            lines.append(f"{op} {reported} {seconds * 1e6:.3f}")
            nbytes *= 4
    if rank == 0:
        with open(out, "w") as f:
            f.write("\n".join(lines) + "\n")
    # Leave without destroy_process_group(): torch 1.13's gloo teardown can hang at exit
    # once the work is done; the barrier makes sure every rank has finished.
    dist.barrier()
    os._exit(0)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--max-bytes", type=int, default=64 << 20)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    with socket.socket() as s:
        s.bind(("", 0))
        port = s.getsockname()[1]
    mp.spawn(worker, args=(args.ranks, port, args.max_bytes, args.out), nprocs=args.ranks)
    print(f"torch {torch.__version__} gloo, {args.ranks} ranks: table in {args.out}")


if __name__ == "__main__":
    main()
