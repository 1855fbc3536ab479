"""Example: a full training run of a 1.8B-parameter GPT inside a 4 GiB VRAM cap with ramstream.wrap().

    python examples/train_bigger_than_vram.py                  # 1.8B GPT, bf16, 4 GiB cap, 5 steps
    python examples/train_bigger_than_vram.py --cap-gib 8 --batch 4 --seq 1024
    python examples/train_bigger_than_vram.py --tiny           # a tiny GPT on the CPU, checked against torch

The cap is torch.cuda.set_per_process_memory_fraction(cap / total, 0): above it torch raises out
of memory as a smaller GPU would. The 1.8B GPT in bf16 with torch's AdamW needs about 1.8e9 x
(2 weights + 2 grads + 8 fp32 moments + 4 fp32 masters) = 29 GB; ramstream keeps the fp32
masters and moments in host RAM, streams the blocks' weights in and out of VRAM and pages saved
activations, as its plan decides (printed). --tiny trains a tiny GPT on the CPU engine beside
torch.optim.AdamW and prints the largest loss difference.
"""

from __future__ import annotations

import argparse
import copy
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

import ramstream

SIZES = {  # vocab, width, layers, heads
    "1.8b": (50304, 2048, 32, 16),
    "350m": (50304, 1024, 24, 16),
    "tiny": (256, 64, 6, 4),
}


class Block(nn.Module):
    """A pre-norm decoder block: causal self-attention (SDPA) and a 4x GELU MLP."""

    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.norm1, self.norm2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.up, self.down = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, d)
        x = x + self.proj(y)
        return x + self.down(F.gelu(self.up(self.norm2(x))))


class GPT(nn.Module):
    """Token + position embeddings, a stack of Blocks, a final norm and an untied LM head; forward
    returns the mean next-token loss (ramstream's chunked cross-entropy: no [tokens, vocab] logits)."""

    def __init__(self, vocab: int, d: int, layers: int, heads: int, ctx: int) -> None:
        super().__init__()
        self.tok, self.pos = nn.Embedding(vocab, d), nn.Embedding(ctx, d)
        self.layers = nn.ModuleList(Block(d, heads) for _ in range(layers))
        self.norm = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1], device=idx.device))
        for block in self.layers:
            x = block(x)
        return ramstream.chunked_cross_entropy(
            self.norm(x).flatten(0, 1), self.head.weight, targets.flatten()
        )


def parse(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n")[0], formatter_class=argparse.RawTextHelpFormatter
    )
    p.add_argument("--size", choices=list(SIZES), default="1.8b", help="the GPT (default 1.8b)")
    p.add_argument("--cap-gib", type=float, default=4.0, help="VRAM cap in GiB (default 4)")
    p.add_argument("--batch", type=int, default=1, help="rows per step (default 1)")
    p.add_argument("--seq", type=int, default=512, help="tokens per row (default 512)")
    p.add_argument("--steps", type=int, default=5, help="optimizer steps (default 5)")
    p.add_argument("--lr", type=float, default=3e-4, help="learning rate (default 3e-4)")
    p.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16", help="weights' dtype")
    p.add_argument(
        "--tiny", action="store_true", help="a tiny GPT on the CPU, 4 steps, checked against torch"
    )
    a = p.parse_args(argv)
    if a.tiny:
        a.size, a.batch, a.seq, a.steps, a.lr, a.dtype = "tiny", 2, 32, 4, 3e-3, "float32"
    return a


def train(model, opt, data) -> tuple[list[float], float]:
    losses, t0 = [], time.perf_counter()
    for i, (idx, tgt) in enumerate(data):
        if i == 1:  # step 1 includes the plan's first measurements and the host buffers' first touch
            if idx.is_cuda:
                torch.cuda.synchronize()
            t0 = time.perf_counter()
        loss = model(idx, tgt)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
        print(f"  step {i + 1}: loss {losses[-1]:.5f}")
    if data[0][0].is_cuda:
        torch.cuda.synchronize()
    return losses, (time.perf_counter() - t0) / max(1, len(data) - 1)


def main(argv=None) -> int:
    a = parse(argv)
    gpu = torch.cuda.is_available() and not a.tiny
    vocab, d, layers, heads = SIZES[a.size]
    torch.manual_seed(0)
    model = GPT(vocab, d, layers, heads, ctx=max(a.seq, 1024)).to(getattr(torch, a.dtype))
    n = sum(p.numel() for p in model.parameters())
    print(f"GPT {a.size}: {n / 1e9:.2f}B parameters, {a.dtype}, batch {a.batch} x {a.seq} tokens")
    dev = torch.device("cuda", 0) if gpu else torch.device("cpu")
    g = torch.Generator().manual_seed(1)
    data = []
    for _ in range(a.steps):
        ids = torch.randint(0, vocab, (a.batch, a.seq + 1), generator=g)
        data.append((ids[:, :-1].to(dev), ids[:, 1:].to(dev)))
    ref = None
    if gpu:
        total = torch.cuda.get_device_properties(0).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, a.cap_gib * 2**30 / total), 0)
        print(f"VRAM capped at {a.cap_gib:g} GiB of {total / 2**30:.0f} GiB")
    else:
        print("no GPU (or --tiny): ramstream's CPU engine, beside torch.optim.AdamW on a copy")
        twin = copy.deepcopy(model)
        print("torch.optim.AdamW:")
        ref, _ = train(twin, torch.optim.AdamW(twin.parameters(), lr=a.lr), data)
    opt = torch.optim.AdamW(model.parameters(), lr=a.lr)
    # on the GPU the planner decides from the cap; the CPU engine is told to stream and page everything
    options = {"activation_offload": "auto", "device": "cuda"}  # the model was built in host RAM
    if not gpu:
        options = {"device": "cpu", "param_offload": True, "activation_offload": True, "min_offload_bytes": 0}
    try:
        model, opt = ramstream.wrap(model, opt, **options)
    except MemoryError as e:  # the plan's arithmetic: what would fit instead
        print(f"ramstream refused: {e}")
        return 1
    for line in ramstream.memory_report(model)["events"]:
        print("  plan:", line)
    print("ramstream.wrap():")
    losses, spent = train(model, opt, data)
    opt.synchronize()
    rep = ramstream.memory_report(model)
    peak = torch.cuda.max_memory_allocated(0) / 2**30 if gpu else 0.0
    print(
        f"ramstream: {spent:.3f} s/step, peak VRAM {peak:.2f} GiB (cap {a.cap_gib:g}), host optimizer "
        f"state {rep['optimizer']['host_state_bytes'] / 2**30:.2f} GiB, streamed blocks "
        f"{len(rep['params']['streamed_blocks'])} of {layers}, paged activations of "
        f"{len(rep['activations']['paged_blocks'])} blocks"
    )
    if ref is not None:
        print(f"max |loss difference| against torch = {max(abs(x - y) for x, y in zip(ref, losses)):.3g}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
