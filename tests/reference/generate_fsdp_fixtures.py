#!/usr/bin/env python3
"""Generates tests/fixtures/zero3_fsdp2.safetensors: PyTorch FSDP2 (fully_shard) training, for
tests/multirank/test_zero.cpp (Zero3.MatchesPyTorchFSDP2).

W gloo processes train an MLP (Linear(8, 16), ReLU, Linear(16, 16), ReLU, Linear(16, 4); names
"0.weight" ... "4.bias", torch.nn.Sequential's) with softmax cross-entropy, each Linear its own
FSDP2 unit (fully_shard per layer, then the root; reshard_after_forward=True, the default), f32,
for STEPS steps. Each rank's batch at each step is drawn from a generator seeded by the step and
the rank, and recorded, as are the initial weights, every rank's loss per step and the final
weights. Cases: worlds 2, 3 and 4 (3 and 4 do not divide every dimension: FSDP2 pads) x SGD
(momentum, weight decay), Adam, AdamW; each with one microbatch, and with two microbatches of
half the batch (each loss halved, the step's loss their sum) synchronized every microbatch
(FSDP2's default: each microbatch reduce-scattered into the sharded gradients; "<opt>.multi");
and AdamW with the first microbatch under set_requires_gradient_sync(False) (the unsharded
gradients kept until the last microbatch; "adamw.nosync").

Needs a current torch (2.x) and safetensors from PyPI:
    python3 -m venv /tmp/torch && /tmp/torch/bin/pip install torch safetensors numpy
    /tmp/torch/bin/python tests/reference/generate_fsdp_fixtures.py
"""
import json
import os
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from safetensors.torch import save_file
from torch.distributed.fsdp import fully_shard

OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "fixtures", "zero3_fsdp2.safetensors")
STEPS = 6
BATCH = 6  # per rank
OPTIMIZERS = {
    "sgd": lambda params: torch.optim.SGD(params, lr=0.1, momentum=0.9, weight_decay=1e-3),
    "adam": lambda params: torch.optim.Adam(params, lr=0.01),
    "adamw": lambda params: torch.optim.AdamW(params, lr=0.01, weight_decay=0.05),
}
SETTINGS = {  # the same hyperparameters, for the C++ side
    "sgd": {"lr": 0.1, "momentum": 0.9, "weight_decay": 1e-3},
    "adam": {"lr": 0.01},
    "adamw": {"lr": 0.01, "weight_decay": 0.05},
}


def model():
    torch.manual_seed(2024)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 16), torch.nn.ReLU(),
                               torch.nn.Linear(16, 4))


def batch(step, rank):
    generator = torch.Generator().manual_seed(1000 * step + rank)
    x = torch.randn(BATCH, 8, generator=generator)
    y = torch.randint(0, 4, (BATCH,), generator=generator)
    return x, y


# name -> (optimizer, microbatches, synchronize every microbatch)
CASES = {name: (name, 1, True) for name in OPTIMIZERS}
CASES.update({f"{name}.multi": (name, 2, True) for name in OPTIMIZERS})
CASES["adamw.nosync"] = ("adamw", 2, False)


def sharded_model(mesh=None):
    """The model with each Linear its own FSDP2 unit, then the root (over `mesh`: HSDP when 2-D)."""
    net = model()
    for layer in net:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(net, mesh=mesh)
    return net


def train(net, optimizer, rank, micro, every=True):
    """STEPS steps of rank `rank`'s batches in `micro` microbatches (each loss divided by micro;
    every=False: only the last synchronizes); returns the losses and the final full weights."""
    losses = []
    for step in range(STEPS):
        x, y = batch(step, rank)
        optimizer.zero_grad()
        step_loss = 0.0
        part = BATCH // micro
        for m in range(micro):
            net.set_requires_gradient_sync(every or m == micro - 1)
            loss = torch.nn.functional.cross_entropy(net(x[m * part:(m + 1) * part]), y[m * part:(m + 1) * part]) / micro
            loss.backward()
            step_loss += loss.item()
        optimizer.step()
        losses.append(step_loss)
    return losses, {name: p.full_tensor().detach().clone() for name, p in net.named_parameters()}


def record_batches(tensors, world, steps=STEPS):
    for step in range(steps):
        for rank in range(world):
            x, y = batch(step, rank)
            tensors[f"data.step{step}.rank{rank}.x"] = x
            tensors[f"data.step{step}.rank{rank}.y"] = y


def run_case(tensors, prefix, world, worker, args, every_rank_final=False):
    """Spawns `world` processes of worker(rank, *args, store_path, results) and records every rank's
    losses and rank 0's final weights under `prefix` (every rank's, `every_rank_final`: replicas
    that differ at the end)."""
    with tempfile.TemporaryDirectory() as folder:
        manager = mp.Manager()
        results = manager.dict()
        mp.spawn(worker, args=(*args, os.path.join(folder, "store"), results), nprocs=world)
        for rank in range(world):
            tensors[f"{prefix}.rank{rank}.losses"] = torch.tensor(results[rank][0], dtype=torch.float64)
            for pname, value in results[rank][1].items():
                if every_rank_final:
                    tensors[f"{prefix}.rank{rank}.final.{pname}"] = value
                elif rank == 0:
                    tensors[f"{prefix}.final.{pname}"] = value


def run_worlds(tensors, worlds, cases, worker, steps=STEPS, every_rank_final=False):
    """Every case on every world: worker(rank, world, case, store_path, results), recorded under
    "w<world>.<case>", with the batches of `steps` steps."""
    for world in worlds:
        record_batches(tensors, world, steps)
        for name in cases:
            run_case(tensors, f"w{world}.{name}", world, worker, (world, name), every_rank_final)
            print(f"{world} ranks, {name}: done", flush=True)


def worker(rank, world, case, store_path, results):
    dist.init_process_group("gloo", init_method=f"file://{store_path}", rank=rank, world_size=world)
    optimizer_name, micro, every = CASES[case]
    net = sharded_model()
    results[rank] = train(net, OPTIMIZERS[optimizer_name](net.parameters()), rank, micro, every)
    dist.destroy_process_group()


def main():
    tensors = {f"init.{name}": p.detach().clone() for name, p in model().named_parameters()}
    run_worlds(tensors, (2, 3, 4), CASES, worker)
    meta = {"steps": str(STEPS), "batch": str(BATCH), "settings": json.dumps(SETTINGS), "torch": torch.__version__}
    save_file({k: v.contiguous() for k, v in tensors.items()}, OUT, metadata=meta)
    print(f"wrote {OUT}: {len(tensors)} tensors")


if __name__ == "__main__":
    main()
