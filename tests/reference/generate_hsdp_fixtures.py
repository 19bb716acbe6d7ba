#!/usr/bin/env python3
"""Generates tests/fixtures/hsdp_fsdp2.safetensors: PyTorch FSDP2 HSDP training (fully_shard over a
2-D DeviceMesh, ("replicate", "shard"): sharded inside a group of ranks, replicated across the
groups), for tests/multirank/test_hsdp.cpp (Hsdp.MatchesPyTorchFSDP2).

The model, data and optimizers are generate_fsdp_fixtures.py's (the MLP Linear(8, 16), ReLU,
Linear(16, 16), ReLU, Linear(16, 4), each Linear its own unit, then the root), trained for its
STEPS steps by R x S gloo processes: rank = group x S + place, so groups are consecutive ranks
(gradsync's dist::ShardGroups(world, S)). Meshes: 2 x 2 (the issue's 4 ranks) and 2 x 3 (groups
of 3, which pad). Cases: SGD (momentum, weight decay), Adam, AdamW, and AdamW with two
microbatches synchronized every microbatch ("adamw.multi"). Recorded: every rank's loss per
step and the final weights, per mesh and case (the initial weights and batches are in the
fixture too, drawn as generate_fsdp_fixtures.py draws them).

Needs a current torch (2.x) and safetensors (scripts/torch_env.sh's venv, plus pip install
safetensors):
    $(scripts/torch_env.sh) tests/reference/generate_hsdp_fixtures.py
"""
import json
import os
import sys

import torch
import torch.distributed as dist
from safetensors.torch import save_file
from torch.distributed.device_mesh import init_device_mesh

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import generate_fsdp_fixtures as fsdp  # noqa: E402
from generate_fsdp_fixtures import BATCH, OPTIMIZERS, SETTINGS, STEPS, model  # noqa: E402

OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "fixtures", "hsdp_fsdp2.safetensors")
MESHES = [(2, 2), (2, 3)]  # (replica groups, ranks per group)
CASES = {name: (name, 1) for name in OPTIMIZERS}
CASES["adamw.multi"] = ("adamw", 2)


def worker(rank, mesh_shape, case, store_path, results):
    world = mesh_shape[0] * mesh_shape[1]
    dist.init_process_group("gloo", init_method=f"file://{store_path}", rank=rank, world_size=world)
    mesh = init_device_mesh("cpu", mesh_shape, mesh_dim_names=("replicate", "shard"))
    optimizer_name, micro = CASES[case]
    net = fsdp.sharded_model(mesh)
    results[rank] = fsdp.train(net, OPTIMIZERS[optimizer_name](net.parameters()), rank, micro)
    dist.destroy_process_group()


def main():
    tensors = {f"init.{name}": p.detach().clone() for name, p in model().named_parameters()}
    for groups, size in MESHES:
        fsdp.record_batches(tensors, groups * size)
        for name in CASES:
            fsdp.run_case(tensors, f"m{groups}x{size}.{name}", groups * size, worker, ((groups, size), name))
            print(f"{groups} x {size}, {name}: done", flush=True)
    meta = {"steps": str(STEPS), "batch": str(BATCH), "settings": json.dumps(SETTINGS), "torch": torch.__version__,
            "meshes": json.dumps(MESHES)}
    save_file({k: v.contiguous() for k, v in tensors.items()}, OUT, metadata=meta)
    print(f"wrote {OUT}: {len(tensors)} tensors")


if __name__ == "__main__":
    main()
