#!/usr/bin/env python3
"""The interop fixture of the example trainers: an MLP trained by PyTorch, to be reproduced by
digits_ddp from the same initial weights and data.

    /usr/bin/python3 tests/reference/generate_mlp_fixture.py tests/fixtures/mlp_sgd

Writes three safetensors files:
    init.safetensors   fc1.weight [16, 12], fc1.bias, fc2.weight [5, 16], fc2.bias (PyTorch's init, seed 0)
    data.safetensors   images f32 [64, 12], labels i64 [64] (a random teacher's classes)
    final.safetensors  the weights after 25 full-batch steps of plain SGD (lr 0.1, momentum 0)
                       on the mean cross-entropy, as torch.nn.CrossEntropyLoss and torch.optim.SGD do
digits_ddp --data data --init init --optimizer sgd --momentum 0 --lr 0.1 --batch 64 --no-shuffle
--holdout 0 --hidden 16 --max-steps 25 must end within 1e-5 of final.
"""
import argparse
import os

import torch
from safetensors.torch import save_file

parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
parser.add_argument("out", help="the folder to write (tests/fixtures/mlp_sgd)")
out = parser.parse_args().out
os.makedirs(out, exist_ok=True)
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(12, 16), torch.nn.ReLU(), torch.nn.Linear(16, 5))
names = {"0.weight": "fc1.weight", "0.bias": "fc1.bias", "2.weight": "fc2.weight", "2.bias": "fc2.bias"}
state = lambda: {names[k]: v.detach().clone().contiguous() for k, v in model.state_dict().items()}
save_file(state(), os.path.join(out, "init.safetensors"))

generator = torch.Generator().manual_seed(1)
images = torch.randn(64, 12, generator=generator)
teacher = torch.randn(12, 5, generator=generator)
labels = (images @ teacher).argmax(dim=1)
save_file({"images": images.contiguous(), "labels": labels.to(torch.int64).contiguous()},
          os.path.join(out, "data.safetensors"))

optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.0)
loss_fn = torch.nn.CrossEntropyLoss()
for step in range(25):
    optimizer.zero_grad()
    loss = loss_fn(model(images), labels)
    loss.backward()
    optimizer.step()
save_file(state(), os.path.join(out, "final.safetensors"))
print(f"torch {torch.__version__}: final loss {loss.item():.6f}; fixture in {out}")
