#!/usr/bin/python3
"""gpt_ddp's --save is nanoGPT's model, as PyTorch loads it: the file goes into nanoGPT's GPT
(tests/reference/generate_gpt_fixtures.py's, the test configuration: 2 layers, 2 heads, width 16,
block 8, vocabulary 17) with load_state_dict(strict=True), the tied lm_head equals the token
embedding, the config in the metadata is the model's, no optimizer tensor is in the file, and
(with torch 2, whose attention the model calls) the model's loss on a batch is finite.

    check_gpt_nanogpt_load.py SAVED.safetensors
Exit 77 (skipped) without torch or safetensors.
"""
import json
import os
import sys

try:
    import torch
    from safetensors import safe_open
    from safetensors.torch import load_file
except ImportError as error:
    print(f"skipped: {error} (scripts/setup.sh --with-reference installs Debian's torch and safetensors)")
    sys.exit(77)

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import generate_gpt_fixtures as nanogpt  # noqa: E402  (nanoGPT's model, by the fixtures' generator)

path = sys.argv[1]
with safe_open(path, "pt") as file:
    metadata = file.metadata()
config = json.loads(metadata["config"])
expected = {"n_layer": nanogpt.LAYERS, "n_head": nanogpt.HEADS, "n_embd": nanogpt.EMBD,
            "block_size": nanogpt.BLOCK, "vocab_size": nanogpt.VOCAB, "bias": True, "dropout": 0.0, "gelu": "tanh"}
assert config == expected, f"config {config} is not {expected}"
state = load_file(path)
stray = [name for name in state if name.startswith("optimizer.")]
assert not stray, f"optimizer tensors in the model file: {stray[:3]}"
model = nanogpt.GPT("tanh")
model.load_state_dict(state, strict=True)  # raises on a missing or unexpected key
assert torch.equal(model.lm_head.weight, state["transformer.wte.weight"]), "lm_head is not the token embedding"
loss = "not run (this torch has no scaled_dot_product_attention)"
if hasattr(torch.nn.functional, "scaled_dot_product_attention"):
    tokens = torch.arange(nanogpt.LENGTH).remainder(nanogpt.VOCAB).unsqueeze(0)
    with torch.no_grad():
        value = model(tokens, tokens.roll(-1, 1))
    assert torch.isfinite(value), value
    loss = f"{value.item():.4f}"
print(f"{path}: nanoGPT's GPT loads it with strict=True ({len(state)} tensors, config {config}), loss {loss}")
