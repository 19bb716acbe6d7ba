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
the models, LocalSGD). Streaming DiLoCo (Douillard et al. 2025, with torchft's schedule: fragment i
first synchronized at floor(H (i + 1) / F)): 3 fragments with H = 6; 3 fragments, each reduction
applied one inner step after its launch (tau = 1) and the local values mixed in at 0.5; 2
fragments with the pseudo-gradients in bf16 on the wire; and 5 warm-up steps of averaged
gradients (DDP's) before DiLoCo starts. STEPS = 24. Recorded: every rank's loss per step and
final weights.

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
# name -> inner optimizer, H, outer lr, outer momentum, Nesterov, and streaming DiLoCo's
# fragments F, delay tau, mixing alpha, the wire dtype, and the warm-up steps.
CASES = {
    "adamw": ("adamw", 4, 0.7, 0.9, True, 1, 0, 0.0, None, 0),
    "sgd": ("sgd", 3, 0.5, 0.8, True, 1, 0, 0.0, None, 0),
    "adam": ("adam", 6, 1.0, 0.0, False, 1, 0, 0.0, None, 0),
    "stream3": ("adamw", 6, 0.7, 0.9, True, 3, 0, 0.0, None, 0),
    "stream3.overlap": ("adamw", 6, 0.7, 0.9, True, 3, 1, 0.5, None, 0),
    "stream2.bf16": ("adamw", 4, 0.7, 0.9, True, 2, 1, 0.0, torch.bfloat16, 0),
    "warmup": ("sgd", 4, 0.7, 0.9, True, 2, 0, 0.0, None, 5),
}


def split_into_fragments(sizes, fragments):
    """Parameter k goes to the fragment its middle element falls in (gradsync's DiLoCo rule)."""
    total, start, fragment_of = sum(sizes), 0, []
    for size in sizes:
        fragment_of.append(min(fragments - 1, fragments * (2 * start + size) // (2 * total)))
        start += size
    return fragment_of


def worker(rank, world, case, store_path, results):
    dist.init_process_group("gloo", init_method=f"file://{store_path}", rank=rank, world_size=world)
    inner_name, sync_every, outer_lr, outer_momentum, nesterov, fragments, delay, alpha, wire, warmup = CASES[case]
    net = fsdp.model()
    inner = fsdp.OPTIMIZERS[inner_name](net.parameters())
    outer = torch.optim.SGD(net.parameters(), lr=outer_lr, momentum=outer_momentum, nesterov=nesterov)
    named = list(net.named_parameters())
    fragment_of = split_into_fragments([p.numel() for _, p in named], fragments)
    members = [[(name, p) for (name, p), f in zip(named, fragment_of) if f == i] for i in range(fragments)]
    offsets = [sync_every * (i + 1) // fragments for i in range(fragments)]  # torchft's schedule
    original = {name: p.detach().clone() for name, p in named}
    pending = {}
    losses = []
    for step in range(STEPS):
        x, y = fsdp.batch(step, rank)
        inner.zero_grad()
        loss = torch.nn.functional.cross_entropy(net(x), y)
        loss.backward()
        if step < warmup:  # synchronous steps first: the gradients averaged, as DDP
            for _, p in named:
                p.grad /= world
                dist.all_reduce(p.grad)
        inner.step()
        losses.append(loss.item())
        n = step + 1
        if n <= warmup:
            if n == warmup:
                original = {name: p.detach().clone() for name, p in named}
            continue
        s = n - warmup
        for i in range(fragments):  # a fragment's reduction launched (the reference waits at once)
            if s >= offsets[i] and (s - offsets[i]) % sync_every == 0:
                deltas = {}
                with torch.no_grad():
                    for name, p in members[i]:
                        delta = (original[name] - p) / world
                        if wire is not None:
                            delta = delta.to(wire)
                        dist.all_reduce(delta)
                        deltas[name] = delta.float()
                pending[i] = deltas
        for i in sorted(pending):  # ... and applied tau inner steps later
            if s >= offsets[i] + delay and (s - offsets[i] - delay) % sync_every == 0:
                with torch.no_grad():
                    for _, p in named:
                        p.grad = None
                    local = {name: p.detach().clone() for name, p in members[i]}
                    for name, p in members[i]:
                        p.copy_(original[name])
                        p.grad = pending[i][name]
                    outer.step()
                    for name, p in members[i]:
                        original[name] = p.detach().clone()
                        if alpha != 0:
                            p.copy_(alpha * local[name] + (1 - alpha) * p)
                outer.zero_grad(set_to_none=True)
                del pending[i]
    results[rank] = (losses, {name: p.detach().clone() for name, p in net.named_parameters()})
    dist.destroy_process_group()


def main():
    tensors = {f"init.{name}": p.detach().clone() for name, p in fsdp.model().named_parameters()}
    fsdp.run_worlds(tensors, (2, 3, 4), CASES, worker, STEPS)
    settings = {name: {"inner": inner, "inner_settings": fsdp.SETTINGS[inner], "sync_every": h, "outer_lr": lr,
                       "outer_momentum": momentum, "nesterov": nesterov, "fragments": fragments, "delay": delay,
                       "mixing": alpha, "compression": "bf16" if wire is not None else "none", "warmup_steps": warmup}
                for name, (inner, h, lr, momentum, nesterov, fragments, delay, alpha, wire, warmup) in CASES.items()}
    meta = {"steps": str(STEPS), "settings": json.dumps(settings), "torch": torch.__version__}
    save_file({k: v.contiguous() for k, v in tensors.items()}, OUT, metadata=meta)
    print(f"wrote {OUT}: {len(tensors)} tensors")


if __name__ == "__main__":
    main()
