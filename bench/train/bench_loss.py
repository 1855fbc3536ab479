"""The chunked causal-LM loss against Hugging Face's dense loss, forward + backward, same process.

Hugging Face's way: logits = lm_head(hidden) under autocast, .float(), cross_entropy(sum) / n.
ramstream's: causal_lm_loss(hidden, weight, labels, chunk_size=C) (the logits never exist).
Default shape: the Qwen2-1.5B Trainer row of issue 12 (4x1024 tokens, hidden 1536, vocab 151936,
fp32 weights under bf16 autocast). Prints median ms per forward+backward, peak memory and the
ratio to the dense loss; --profile adds the top device ops of each chunked configuration.

    python bench/train/bench_loss.py [--tokens 4096 --hidden 1536 --vocab 151936 --chunks 1024,2048]
    python bench/train/bench_loss.py --tiny   # CPU, seconds (CI)
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
import torch.nn.functional as F

from ramstream.loss import causal_lm_loss


def _dense(h, w, labels):
    logits = F.linear(h, w).float()
    shifted = F.pad(labels[:, 1:], (0, 1), value=-100)
    n = (shifted != -100).sum()
    return F.cross_entropy(logits.flatten(0, 1), shifted.flatten(), reduction="sum") / n


def _chunked(chunk):
    return lambda h, w, labels: causal_lm_loss(h, w, labels, chunk_size=chunk)


def _time(fn, h, w, labels, dev, iters, autocast):
    times, grads = [], None
    for i in range(iters + 2):
        h.grad = w.grad = None
        if dev.type == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated() if dev.type == "cuda" else 0
        t0 = time.perf_counter()
        with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=autocast):
            loss = fn(h, w, labels)
        loss.backward()
        if dev.type == "cuda":
            torch.cuda.synchronize()
        if i >= 2:
            times.append(time.perf_counter() - t0)
        peak = (torch.cuda.max_memory_allocated() - base) if dev.type == "cuda" else 0
        grads = (loss.detach(), h.grad.clone(), w.grad.clone())
    return statistics.median(times), peak, grads


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tokens", type=int, default=4096, help="batch x sequence (4 x 1024)")
    p.add_argument("--hidden", type=int, default=1536)
    p.add_argument("--vocab", type=int, default=151936)
    p.add_argument("--chunks", default="1024,2048,4096", help="comma-separated chunk sizes")
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--profile", action="store_true", help="top device ops of each chunked run")
    p.add_argument("--tiny", action="store_true", help="a CPU-sized run (CI)")
    p.add_argument("--out", default=None, help="JSON results")
    a = p.parse_args(argv)
    dev = torch.device("cuda" if torch.cuda.is_available() and not a.tiny else "cpu")
    if a.tiny:
        a.tokens, a.hidden, a.vocab, a.chunks, a.iters = 64, 32, 500, "16,64", 2
    g = torch.Generator().manual_seed(0)
    seq = min(1024, a.tokens)
    h = (torch.randn(a.tokens // seq, seq, a.hidden, generator=g)).to(dev).requires_grad_()
    w = (torch.randn(a.vocab, a.hidden, generator=g) * 0.02).to(dev).requires_grad_()
    labels = torch.randint(0, a.vocab, (a.tokens // seq, seq), generator=g).to(dev)
    autocast = dev.type == "cuda"
    rows = []
    t_dense, peak_dense, ref = _time(_dense, h, w, labels, dev, a.iters, autocast)
    rows.append({"config": "hf_dense", "ms": t_dense * 1e3, "peak_gib": peak_dense / 2**30, "ratio": 1.0})
    for c in [int(x) for x in a.chunks.split(",")]:
        t, peak, got = _time(_chunked(c), h, w, labels, dev, a.iters, autocast)
        diff = {
            k: (x.float() - y.float()).abs().max().item() for k, x, y in zip(("loss", "dh", "dw"), got, ref)
        }
        row = {
            "config": f"chunked_{c}",
            "ms": t * 1e3,
            "peak_gib": peak / 2**30,
            "ratio": t / t_dense,
            **diff,
        }
        if a.profile and dev.type == "cuda":
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
                with torch.autocast("cuda", dtype=torch.bfloat16):
                    causal_lm_loss(h, w, labels, chunk_size=c).backward()
                torch.cuda.synchronize()
            row["profile"] = prof.key_averages().table(sort_by="self_device_time_total", row_limit=12)
        rows.append(row)
    print(f"device {dev}; tokens {a.tokens}, hidden {a.hidden}, vocab {a.vocab}, bf16 autocast {autocast}")
    print(
        f"{'config':<16}{'ms fwd+bwd':>12}{'peak GiB':>10}{'vs dense':>10}{'max|dloss|':>12}{'max|dh|':>10}{'max|dw|':>10}"
    )
    for r in rows:
        print(
            f"{r['config']:<16}{r['ms']:>12.2f}{r['peak_gib']:>10.2f}{r['ratio']:>10.3f}"
            f"{r.get('loss', 0):>12.2e}{r.get('dh', 0):>10.2e}{r.get('dw', 0):>10.2e}"
        )
    for r in rows:
        if "profile" in r:
            print(f"--- {r['config']}\n{r['profile']}")
    if a.out:
        with open(a.out + ".tmp", "w") as f:
            json.dump(rows, f, indent=1)
        import os

        os.replace(a.out + ".tmp", a.out)
    return rows


if __name__ == "__main__":
    main()
