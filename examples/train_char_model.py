"""Train a small character-level transformer whose attention is attnx's,
and compare softmax, linear (elu + 1 features) and cosFormer attention.

    python examples/train_char_model.py                    # all three, 300 steps each
    python examples/train_char_model.py --attention cosformer --steps 1000

The text is examples/data/seasons.txt (about 4 KB of prose written for
this example, dedicated to the public domain). Every attention layer calls
attnx.torch (causal attention over the context window), so the forward and
the backward both run in attnx's C kernels; the rest of the model is
plain PyTorch. The last 10% of the text is held out; the script prints
the training loss as it goes and the held-out loss (nats per character)
and the time per step at the end.
"""
import argparse
import math
import os
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

import attnx.torch as at

TEXT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "seasons.txt")


def attend(kind, q, k, v):
    """Causal attention of kind `kind` on (batch, heads, n, head_dim)."""
    if kind == "softmax":
        return at.scaled_dot_product_attention(q, k, v, is_causal=True)
    if kind == "linear":
        return at.linear_attention(q, k, v, causal=True)
    if kind == "cosformer":
        return at.cosformer_attention(q, k, v, causal=True)
    raise ValueError(f"unknown attention {kind!r}")


class Block(nn.Module):
    def __init__(self, dim, heads, attention):
        super().__init__()
        self.heads, self.attention = heads, attention
        self.norm1, self.norm2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x):
        B, n, dim = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(B, n, 3, self.heads, dim // self.heads).permute(2, 0, 3, 1, 4)
        y = attend(self.attention, q, k, v)           # (B, heads, n, head_dim)
        x = x + self.proj(y.transpose(1, 2).reshape(B, n, dim))
        return x + self.mlp(self.norm2(x))


class CharModel(nn.Module):
    def __init__(self, vocab, context, dim=64, heads=4, layers=2, attention="softmax"):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.position = nn.Parameter(torch.zeros(context, dim))
        self.blocks = nn.Sequential(*(Block(dim, heads, attention) for _ in range(layers)))
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab)

    def forward(self, ids):
        x = self.embed(ids) + self.position[: ids.shape[1]]
        return self.head(self.norm(self.blocks(x)))


def load_text(path=TEXT):
    with open(path, encoding="utf-8") as f:
        text = f.read()
    alphabet = sorted(set(text))
    ids = torch.tensor([alphabet.index(c) for c in text], dtype=torch.long)
    split = int(0.9 * len(ids))
    return alphabet, ids[:split], ids[split:]


def batches(ids, batch, context, generator):
    while True:
        starts = torch.randint(0, len(ids) - context - 1, (batch,), generator=generator)
        x = torch.stack([ids[s:s + context] for s in starts])
        y = torch.stack([ids[s + 1:s + context + 1] for s in starts])
        yield x, y


def held_out_loss(model, ids, context):
    model.eval()
    with torch.no_grad():
        usable = (len(ids) - 1) // context * context
        x = ids[:usable].view(-1, context)
        y = ids[1:usable + 1].view(-1, context)
        loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten()).item()
    model.train()
    return loss


def train(attention="softmax", steps=300, batch=16, context=64, lr=3e-3, seed=0, log_every=50,
          log=print):
    """Train one model; returns (training losses per step, held-out loss,
    seconds per step)."""
    torch.manual_seed(seed)
    alphabet, train_ids, test_ids = load_text()
    model = CharModel(len(alphabet), context, attention=attention)
    optimiser = torch.optim.AdamW(model.parameters(), lr=lr)
    data = batches(train_ids, batch, context, torch.Generator().manual_seed(seed))
    losses = []
    start = time.perf_counter()
    for step in range(steps):
        x, y = next(data)
        loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
        optimiser.zero_grad()
        loss.backward()
        optimiser.step()
        losses.append(loss.item())
        if log and log_every and (step + 1) % log_every == 0:
            log(f"  {attention:<9} step {step + 1:>5}: train loss {loss.item():.3f}")
    seconds = (time.perf_counter() - start) / max(steps, 1)
    return losses, held_out_loss(model, test_ids, context), seconds


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--attention", nargs="+", default=["softmax", "linear", "cosformer"],
                        choices=["softmax", "linear", "cosformer"],
                        help="the attention of the model, one training run each: softmax "
                             "(scaled dot product), linear (elu + 1 features) or cosformer")
    parser.add_argument("--steps", type=int, default=300,
                        help="optimiser steps (AdamW) per training run")
    parser.add_argument("--batch", type=int, default=16,
                        help="sequences of the training text per step")
    parser.add_argument("--context", type=int, default=64,
                        help="characters per sequence: the causal attention's window")
    parser.add_argument("--seed", type=int, default=0,
                        help="seed of the model's initial weights and of the batches drawn")
    args = parser.parse_args()
    alphabet, _, _ = load_text()
    print(f"{len(alphabet)} characters; uniform guessing: {math.log(len(alphabet)):.3f} nats per character")
    results = {}
    for kind in args.attention:
        results[kind] = train(kind, args.steps, args.batch, args.context, seed=args.seed)
    print(f"\n{'attention':<10} {'first loss':>10} {'last 20':>8} {'held out':>9} {'ms/step':>8}")
    for kind, (losses, test_loss, seconds) in results.items():
        tail = sum(losses[-20:]) / len(losses[-20:])
        print(f"{kind:<10} {losses[0]:>10.3f} {tail:>8.3f} {test_loss:>9.3f} {seconds * 1e3:>8.1f}")


if __name__ == "__main__":
    main()
