"""A GPT-style decoder for the end-to-end benchmarks (pre-norm blocks, SDPA attention)."""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F


class Block(nn.Module):
    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.fc, self.out = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.heads, d // self.heads).unbind(2)
        a = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True
        )
        x = x + self.proj(a.transpose(1, 2).reshape(b, t, d))
        return x + self.out(F.gelu(self.fc(self.ln2(x)), approximate="tanh"))


class GPT(nn.Module):
    def __init__(self, vocab=50304, d=2048, layers=32, heads=16, ctx=1024) -> None:
        super().__init__()
        self.wte, self.wpe = nn.Embedding(vocab, d), nn.Embedding(ctx, d)
        self.layers = nn.ModuleList(Block(d, heads) for _ in range(layers))
        self.ln_f = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)

    def hidden(self, idx):
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1], device=idx.device))
        for blk in self.layers:
            x = blk(x)
        return self.ln_f(x)

    def forward(self, idx, targets):
        logits = self.head(self.hidden(idx))
        return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())


CONFIGS = {
    "6.85b": dict(vocab=50304, d=4096, layers=32, heads=32),
    "1.8b": dict(vocab=50304, d=2048, layers=32, heads=16),
    "350m": dict(vocab=50304, d=1024, layers=24, heads=16),
    "tiny": dict(vocab=512, d=128, layers=2, heads=4),
}
