"""The demo behind `ramstream demo`: a small GPT trained twice on the same data, once with plain
torch AdamW and once wrapped by ramstream; prints losses, parity and step times."""

from __future__ import annotations

import copy
import time

import torch
import torch.nn as nn
import torch.nn.functional as F


class _Block(nn.Module):
    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.fc, self.out = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)
        self.heads = heads

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.heads, d // self.heads).unbind(2)
        a = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True
        )
        x = x + self.proj(a.transpose(1, 2).reshape(b, t, d))
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class DemoGPT(nn.Module):
    def __init__(self, vocab=4096, d=256, layers=4, heads=4, ctx=128) -> None:
        super().__init__()
        self.wte, self.wpe = nn.Embedding(vocab, d), nn.Embedding(ctx, d)
        self.blocks = nn.ModuleList(_Block(d, heads) for _ in range(layers))
        self.ln_f = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)
        self.head.weight = self.wte.weight
        for p in self.parameters():
            if p.dim() == 2:
                nn.init.normal_(p, std=0.02)

    def forward(self, idx, targets):
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1], device=idx.device))
        for blk in self.blocks:
            x = blk(x)
        logits = self.head(self.ln_f(x))
        return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())


def run_demo(device: str | None = None, steps: int = 20) -> int:
    import ramstream

    dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    torch.manual_seed(0)
    base = DemoGPT().to(dev)
    # a task the model can learn in a few steps: each target is a fixed function of its token
    xs = [torch.randint(0, 4096, (8, 128), device=dev) for _ in range(steps)]
    data = [(x, (x * 7 + 3) % 4096) for x in xs]
    runs = {}
    for name in ("torch", "ramstream"):
        model = copy.deepcopy(base)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01, fused=True)
        if name == "ramstream":
            model, opt = ramstream.wrap(model, opt, offload=True)  # keep offloading: the demo
        losses, t0 = [], time.perf_counter()
        for x, y in data:
            loss = model(x, y)
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
        if name == "ramstream":
            opt.synchronize()
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        runs[name] = (model, losses, (time.perf_counter() - t0) / steps)
    n = sum(p.numel() for p in base.parameters())
    print(f"DemoGPT {n / 1e6:.1f}M params on {dev}, {steps} steps of 8x128 tokens")
    for name, (_, losses, dt) in runs.items():
        print(f"  {name:10s} loss {losses[0]:.4f} -> {losses[-1]:.4f}   {dt * 1e3:7.1f} ms/step")
    pa, pb = runs["torch"][0].parameters(), runs["ramstream"][0].parameters()
    num = den = 0.0
    for a, b in zip(pa, pb):
        num += float((a.detach().double() - b.detach().double()).pow(2).sum())
        den += float(a.detach().double().pow(2).sum())
    rel = (num / den) ** 0.5
    ok = rel < 1e-5
    print(
        f"  relative L2 difference of all weights after {steps} steps: {rel:.2e} "
        f"({'OK' if ok else 'MISMATCH'}; torch.optim.AdamW(fused=True) is the reference)"
    )
    return 0 if ok else 1
