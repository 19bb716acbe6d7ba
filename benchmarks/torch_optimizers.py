#!/usr/bin/env python3
"""Side-by-side: our optimizer steps (bench_optimizers) against torch.optim on the same work.

    python3 benchmarks/torch_optimizers.py build/benchmarks/bench_optimizers [--sizes 1,4,16,64]

Runs torch.optim.SGD(momentum=0.9) and torch.optim.Adam with foreach=True on one f32
tensor of N parameters, single thread (torch.set_num_threads(1), as our CPU kernel uses one
thread), best of 5 steps after a warm-up, then prints torch's time, ours, and
ours / torch (below 1 means we are faster). Needs torch (Debian's python3-torch works);
it is a benchmark companion, never a dependency of the library or its tests.
"""
import argparse
import subprocess
import time

import torch


def best_ms(fn, repetitions=5):
    fn()
    best = float("inf")
    for _ in range(repetitions):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best * 1e3


def torch_step_ms(kind, n):
    param = torch.nn.Parameter(torch.full((n,), 0.5))
    param.grad = torch.full((n,), 1e-3)
    if kind == "sgd_momentum":
        optimizer = torch.optim.SGD([param], lr=1e-3, momentum=0.9, foreach=True)
    else:
        optimizer = torch.optim.Adam([param], lr=1e-3, foreach=True)
    return best_ms(optimizer.step)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("bench_optimizers")
    parser.add_argument("--sizes", default="1,4,16,64")
    args = parser.parse_args()
    torch.set_num_threads(1)
    output = subprocess.run([args.bench_optimizers, "--sizes", args.sizes], check=True, capture_output=True,
                            text=True).stdout
    ours = {}
    for line in output.splitlines():
        fields = line.split()
        if len(fields) >= 3 and fields[0].endswith("Mi") and fields[1] in ("sgd_momentum", "adam"):
            ours[(fields[0], fields[1])] = float(fields[2])
    print(output)
    print(f"torch {torch.__version__}, foreach=True, 1 thread")
    print(f"{'params':<9} {'optimizer':<13} {'torch ms':>9} {'ours ms':>9} {'ours/torch':>11} {'speed-up':>9}")
    for (size, kind), ours_ms in ours.items():
        n = int(size[:-2]) << 20
        torch_ms = torch_step_ms(kind, n)
        print(f"{size:<9} {kind:<13} {torch_ms:9.2f} {ours_ms:9.2f} {ours_ms / torch_ms:11.3f} {torch_ms / ours_ms:8.1f}x")


if __name__ == "__main__":
    main()
