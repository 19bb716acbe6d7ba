#!/usr/bin/env python3
"""Side-by-side: our optimizer steps (bench_optimizers) against torch.optim on the same work.

    python3 benchmarks/torch_optimizers.py build/benchmarks/bench_optimizers [--sizes 16,64]
    /tmp/torch/bin/python benchmarks/torch_optimizers.py build/benchmarks/bench_optimizers

For 1 thread and for all cores (torch.set_num_threads and GRADSYNC_NUM_THREADS alike), runs
torch.optim.SGD(momentum=0.9) and Adam on one f32 tensor of N parameters with foreach=True and,
where this torch has it (2.x), fused=True; best of 5 steps after a warm-up. Prints torch's
times, ours, and ours / the fastest torch (below 1 means we are faster). Any torch works;
a current one from PyPI gives the fused column. A benchmark companion, never a dependency of
the library or its tests.
"""
import argparse
import os
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


def torch_step_ms(kind, n, implementation):
    param = torch.nn.Parameter(torch.full((n,), 0.5))
    param.grad = torch.full((n,), 1e-3)
    try:
        if kind == "sgd_momentum":
            optimizer = torch.optim.SGD([param], lr=1e-3, momentum=0.9, **implementation)
        else:
            optimizer = torch.optim.Adam([param], lr=1e-3, **implementation)
        return best_ms(optimizer.step)
    except (RuntimeError, TypeError, ValueError):
        return float("nan")  # this torch has no such implementation on the CPU


def ours_ms(bench, sizes, threads):
    environment = dict(os.environ, GRADSYNC_NUM_THREADS=str(threads))
    output = subprocess.run([bench, "--sizes", sizes], check=True, capture_output=True, text=True,
                            env=environment).stdout
    times = {}
    for line in output.splitlines():
        fields = line.split()
        if len(fields) >= 3 and fields[0].endswith("Mi") and fields[1] in ("sgd_momentum", "adam"):
            times[(fields[0], fields[1])] = float(fields[2])
    return output, times


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("bench_optimizers")
    parser.add_argument("--sizes", default="16,64")
    args = parser.parse_args()
    cores = len(os.sched_getaffinity(0))
    for threads in sorted({1, cores}):
        torch.set_num_threads(threads)
        output, ours = ours_ms(args.bench_optimizers, args.sizes, threads)
        print(output)
        print(f"torch {torch.__version__}, {threads} thread(s)")
        print(f"{'params':<9} {'optimizer':<13} {'foreach ms':>11} {'fused ms':>9} {'ours ms':>9} {'ours/best torch':>16}")
        for (size, kind), ours_time in ours.items():
            n = int(size[:-2]) << 20
            foreach = torch_step_ms(kind, n, {"foreach": True})
            fused = torch_step_ms(kind, n, {"fused": True})
            best = min(t for t in (foreach, fused) if t == t)
            print(f"{size:<9} {kind:<13} {foreach:11.2f} {fused:9.2f} {ours_time:9.2f} {ours_time / best:16.3f}")
        print()


if __name__ == "__main__":
    main()
