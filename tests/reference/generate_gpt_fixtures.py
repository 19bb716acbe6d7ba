#!/usr/bin/env python3
"""Generates tests/fixtures/gpt.safetensors: one forward and backward of nanoGPT's GPT in PyTorch,
for tests/examples/test_gpt_model.cpp (GptModel.MatchesPyTorch*).

The model is nanoGPT's model.py (token and position embeddings, pre-LayerNorm blocks of causal
self-attention and a GELU MLP, a final LayerNorm, lm_head tied to wte; bias=True, dropout 0),
written out here with the same module names, so its state dict has nanoGPT's keys. A small
config (vocabulary 17, block 8, 2 layers, 2 heads, width 16), nanoGPT's initialisation from a
fixed seed, 3 sequences of 8 tokens. For each GELU form (tanh, as GPT-2 and llm.c; erf, as
nanoGPT's nn.GELU()) the file holds the weights, the tokens and targets, the mean cross-entropy
and every parameter's gradient ("<case>.grad.<name>"), all f32.

Then 20 training steps as examples/gpt_ddp.cpp takes them (nanoGPT's AdamW groups, warmup and
cosine, clipping at 1, a global batch of 4 sequences of 8 from a small structured corpus): the
corpus (gpt_train.bin), the initial weights (gpt_init.safetensors), each step's loss
(gpt_train_losses.txt) and the final weights (gpt_final.safetensors).

Needs a current torch (2.x) and safetensors from PyPI:
    python3 -m venv /tmp/torch && /tmp/torch/bin/pip install torch safetensors numpy
    /tmp/torch/bin/python tests/reference/generate_gpt_fixtures.py
"""
import math
import os

import torch
import torch.nn as nn
import torch.nn.functional as F
from safetensors.torch import save_file

OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "fixtures", "gpt.safetensors")
VOCAB, BLOCK, LAYERS, HEADS, EMBD = 17, 8, 2, 2, 16
BATCH, LENGTH = 3, 8


class CausalSelfAttention(nn.Module):
    def __init__(self):
        super().__init__()
        self.c_attn = nn.Linear(EMBD, 3 * EMBD)
        self.c_proj = nn.Linear(EMBD, EMBD)

    def forward(self, x):
        B, T, C = x.size()
        q, k, v = self.c_attn(x).split(EMBD, dim=2)
        k = k.view(B, T, HEADS, C // HEADS).transpose(1, 2)
        q = q.view(B, T, HEADS, C // HEADS).transpose(1, 2)
        v = v.view(B, T, HEADS, C // HEADS).transpose(1, 2)
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=None, dropout_p=0, is_causal=True)
        return self.c_proj(y.transpose(1, 2).contiguous().view(B, T, C))


class MLP(nn.Module):
    def __init__(self, approximate):
        super().__init__()
        self.c_fc = nn.Linear(EMBD, 4 * EMBD)
        self.gelu = nn.GELU(approximate=approximate)
        self.c_proj = nn.Linear(4 * EMBD, EMBD)

    def forward(self, x):
        return self.c_proj(self.gelu(self.c_fc(x)))


class Block(nn.Module):
    def __init__(self, approximate):
        super().__init__()
        self.ln_1 = nn.LayerNorm(EMBD)
        self.attn = CausalSelfAttention()
        self.ln_2 = nn.LayerNorm(EMBD)
        self.mlp = MLP(approximate)

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self, approximate):
        super().__init__()
        self.transformer = nn.ModuleDict(dict(
            wte=nn.Embedding(VOCAB, EMBD), wpe=nn.Embedding(BLOCK, EMBD),
            h=nn.ModuleList([Block(approximate) for _ in range(LAYERS)]), ln_f=nn.LayerNorm(EMBD)))
        self.lm_head = nn.Linear(EMBD, VOCAB, bias=False)
        self.transformer.wte.weight = self.lm_head.weight  # tied, as nanoGPT
        self.apply(self._init_weights)
        for name, p in self.named_parameters():
            if name.endswith("c_proj.weight"):
                torch.nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * LAYERS))

    def _init_weights(self, module):
        if isinstance(module, nn.Linear):
            torch.nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if module.bias is not None:
                torch.nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            torch.nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def forward(self, idx, targets):
        pos = torch.arange(0, idx.size(1), dtype=torch.long)
        x = self.transformer.wte(idx) + self.transformer.wpe(pos)
        for block in self.transformer.h:
            x = block(x)
        logits = self.lm_head(self.transformer.ln_f(x))
        return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))


# ---- 20 training steps, as examples/gpt_ddp.cpp trains (tests/examples/trainers.sh, case gpt) ----
TRAIN_STEPS, GLOBAL_BATCH, LR, MIN_LR, WARMUP, WEIGHT_DECAY, CLIP = 20, 4, 3e-3, 3e-4, 5, 0.1, 1.0
# Adam's eps above nanoGPT's 1e-8: the key bias's gradient is zero but for rounding (softmax does
# not see a constant added to every key), and with eps 1e-8 Adam turns that noise into steps of
# the full learning rate, which no two summation orders share; with 1e-6 they stay below 1e-5.
EPS = 1e-6
FIXTURES = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "fixtures")


def corpus():
    """A small corpus with structure to learn: 12 random phrases of 3-8 tokens, repeated in a
    random order (uint16 tokens, nanoGPT's train.bin format)."""
    generator = torch.Generator().manual_seed(5)
    phrases = [torch.randint(0, VOCAB, (int(torch.randint(3, 9, (1,), generator=generator)),), generator=generator)
               for _ in range(12)]
    order = torch.randint(0, 12, (800,), generator=generator)
    return torch.cat([phrases[int(i)] for i in order])


def get_lr(step):  # nanoGPT's
    if step < WARMUP:
        return LR * (step + 1) / (WARMUP + 1)
    if step > TRAIN_STEPS:
        return MIN_LR
    ratio = (step - WARMUP) / (TRAIN_STEPS - WARMUP)
    return MIN_LR + 0.5 * (1.0 + math.cos(math.pi * ratio)) * (LR - MIN_LR)


def adamw(parameters):
    """nanoGPT's AdamW groups: weight decay on the matrices only."""
    parameters = list(parameters)
    return torch.optim.AdamW([{"params": [p for p in parameters if p.dim() >= 2], "weight_decay": WEIGHT_DECAY},
                              {"params": [p for p in parameters if p.dim() < 2], "weight_decay": 0.0}],
                             lr=LR, betas=(0.9, 0.95), eps=EPS)


def batch_at(data, step, optimizer):
    """Step `step`'s learning rate set, and its global batch (gpt_ddp's deterministic rule)."""
    for group in optimizer.param_groups:
        group["lr"] = get_lr(step)
    span = len(data) - LENGTH - 1
    starts = [((step * GLOBAL_BATCH + i) * LENGTH) % span for i in range(GLOBAL_BATCH)]
    return torch.stack([data[s:s + LENGTH] for s in starts]), torch.stack([data[s + 1:s + 1 + LENGTH] for s in starts])


def training():
    data = corpus()
    data.to(torch.int32).numpy().astype("<u2").tofile(os.path.join(FIXTURES, "gpt_train.bin"))
    torch.manual_seed(1337)
    model = GPT("tanh")
    save_file({k: v.contiguous() for k, v in model.state_dict().items() if k != "lm_head.weight"},
              os.path.join(FIXTURES, "gpt_init.safetensors"))
    optimizer = adamw(model.parameters())
    losses = []
    for step in range(TRAIN_STEPS):
        x, y = batch_at(data, step, optimizer)
        loss = model(x, y)  # the mean over every token: the average of the ranks' means
        optimizer.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        optimizer.step()
        losses.append(loss.item())
    with open(os.path.join(FIXTURES, "gpt_train_losses.txt"), "w") as out:
        out.write("".join(f"{value:.9g}\n" for value in losses))
    save_file({k: v.contiguous() for k, v in model.state_dict().items() if k != "lm_head.weight"},
              os.path.join(FIXTURES, "gpt_final.safetensors"))
    print("training losses:", " ".join(f"{value:.4f}" for value in losses))


def training_bf16():
    """The same 20 steps with --precision bf16, as gpt_ddp takes them: bf16 parameters; each
    step widens them to f32 and computes in f32; each gradient is rounded to bf16 once (the bf16
    .grad); the clipping coefficient comes from the bf16 gradients' norm and multiplies their f32
    values; AdamW updates an f32 master copy (made from the bf16 initial weights), which is then
    rounded to the bf16 parameters (round to nearest even). Writes gpt_train_losses_bf16.txt and
    gpt_final_bf16.safetensors (the bf16 parameters)."""
    data = corpus()
    torch.manual_seed(1337)
    compute = GPT("tanh")  # the f32 arithmetic; its weights are set from the bf16 parameters
    master = {n: p.detach().to(torch.bfloat16).float().clone().requires_grad_(True)
              for n, p in compute.named_parameters()}
    optimizer = adamw(master.values())
    losses = []
    for step in range(TRAIN_STEPS):
        x, y = batch_at(data, step, optimizer)
        with torch.no_grad():
            for n, p in compute.named_parameters():
                p.copy_(master[n].to(torch.bfloat16).float())
        compute.zero_grad()
        loss = compute(x, y)
        loss.backward()
        grads = {n: p.grad.to(torch.bfloat16).float() for n, p in compute.named_parameters()}
        total = torch.sqrt(sum((g.double() ** 2).sum() for g in grads.values()))
        coef = min(CLIP / (float(total) + 1e-6), 1.0)
        for n, p in master.items():
            p.grad = grads[n] * torch.tensor(coef, dtype=torch.float32)
        optimizer.step()
        losses.append(loss.item())
    with open(os.path.join(FIXTURES, "gpt_train_losses_bf16.txt"), "w") as out:
        out.write("".join(f"{value:.9g}\n" for value in losses))
    save_file({n: p.detach().to(torch.bfloat16).contiguous() for n, p in master.items() if n != "lm_head.weight"},
              os.path.join(FIXTURES, "gpt_final_bf16.safetensors"))
    print("bf16 training losses:", " ".join(f"{value:.4f}" for value in losses))


def main():
    tensors = {}
    generator = torch.Generator().manual_seed(11)
    tokens = torch.randint(0, VOCAB, (BATCH, LENGTH), generator=generator)
    targets = torch.randint(0, VOCAB, (BATCH, LENGTH), generator=generator)
    tensors["tokens"] = tokens.to(torch.int32).contiguous()
    tensors["targets"] = targets.to(torch.int32).contiguous()
    for case, approximate in (("tanh", "tanh"), ("erf", "none")):
        torch.manual_seed(1337)
        model = GPT(approximate)
        # Spread the weights beyond nanoGPT's 0.02, and the LayerNorms off 1 and 0, so every path
        # carries a gradient worth comparing.
        with torch.no_grad():
            for name, p in model.named_parameters():
                p.add_(torch.randn_like(p) * 0.2)
        loss = model(tokens, targets)
        loss.backward()
        tensors[f"{case}.loss"] = loss.detach().reshape(1)
        for name, p in model.state_dict().items():
            if name == "lm_head.weight":
                continue  # the same tensor as transformer.wte.weight
            tensors[f"{case}.{name}"] = p.detach().clone().contiguous()
        for name, p in model.named_parameters():
            tensors[f"{case}.grad.{name}"] = p.grad.detach().clone().contiguous()
    save_file(tensors, OUT, metadata={"torch": torch.__version__, "config": f"{VOCAB} {BLOCK} {LAYERS} {HEADS} {EMBD}"})
    print(f"wrote {OUT}: {len(tensors)} tensors")
    training()
    training_bf16()


if __name__ == "__main__":
    main()
