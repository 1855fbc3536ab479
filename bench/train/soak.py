"""Soak run: pinned host bytes, VRAM and RSS stay flat over many steps of a wrapped GPT.

    python bench/train/soak.py                      # GPU: 1.8B GPT, 24 GiB cap, 200 steps
    python bench/train/soak.py --model tiny --device cpu --steps 20     # CI smoke test

Trains with optimizer_mode="auto", activation paging, clipping and bf16 autocast (on CUDA),
prints one JSON line per checkpoint (steps 10, 50, 100, 200 and the last): ramstream's pinned
bytes in use and held, memory_allocated / memory_reserved, the process RSS; then a summary
line saying whether each stayed flat after the first checkpoint (growth at most 2 % + 64 MiB).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
CHECKPOINTS = (10, 50, 100, 200)
KEYS = ("pinned_in_use", "pinned_held", "vram_allocated", "vram_reserved", "rss")


def rss_bytes() -> int:
    """The process's resident set now (not its peak)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:  # pragma: no cover - not Linux
        import resource

        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def sample(dev) -> dict:
    import torch

    import ramstream

    ms = ramstream.memory_stats()
    out = {
        "pinned_in_use": ms["bytes_in_use"],
        "pinned_held": ms["bytes_pinned"],
        "vram_allocated": 0,
        "vram_reserved": 0,
        "rss": rss_bytes(),
    }
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
        out["vram_allocated"] = torch.cuda.memory_allocated(dev)
        out["vram_reserved"] = torch.cuda.memory_reserved(dev)
    return out


def flat(first: dict, later: list[dict], slack_bytes: int = 64 << 20, slack: float = 0.02) -> dict:
    """Per key: True when no later sample exceeds the first by more than slack + slack_bytes."""
    return {k: all(s[k] <= first[k] * (1 + slack) + slack_bytes for s in later) for k in KEYS}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--model", default="1.8b", help="a bench/train/gpt.py config: 1.8b, 350m, tiny")
    ap.add_argument("--device", default="cuda", help="cuda[:N] or cpu")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument(
        "--cap-gib", type=float, default=24.0, help="torch.cuda.set_per_process_memory_fraction cap (0: none)"
    )
    ap.add_argument(
        "--activation-offload", type=float, default=0.125, help="share of blocks whose activations are paged"
    )
    ap.add_argument("--max-grad-norm", type=float, default=1.0)
    ap.add_argument("--out", help="also write the samples and the verdict as JSON here")
    args = ap.parse_args(argv)
    if args.steps < 1:
        ap.error("--steps must be >= 1")

    import torch

    import ramstream

    sys.path.insert(0, HERE)
    from gpt import CONFIGS, GPT

    if args.model not in CONFIGS:
        ap.error(f"--model {args.model!r}: accepted {sorted(CONFIGS)}")
    dev = torch.device(args.device)
    cuda = dev.type == "cuda"
    if cuda:
        from vram_cap import cap_vram

        dev = cap_vram(torch.device("cuda", dev.index if dev.index is not None else 0), args.cap_gib)
    torch.manual_seed(0)
    cfg = dict(CONFIGS[args.model], ctx=max(1024, args.seq))
    model = GPT(**cfg).to(dev)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.1)
    model, opt = ramstream.wrap(
        model,
        opt,
        device=str(dev),
        optimizer_mode="auto",
        offload=True,
        activation_offload=args.activation_offload,
        max_grad_norm=args.max_grad_norm,
    )
    g = torch.Generator().manual_seed(1)
    marks = sorted({c for c in CHECKPOINTS if c <= args.steps} | {args.steps})
    samples, t0 = [], time.perf_counter()
    for step in range(1, args.steps + 1):
        x = torch.randint(0, cfg["vocab"], (args.batch, args.seq), generator=g).to(dev)
        y = torch.randint(0, cfg["vocab"], (args.batch, args.seq), generator=g).to(dev)
        with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=cuda):
            loss = model(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if step in marks:
            opt.synchronize()
            s = dict(
                step=step, loss=round(loss.item(), 4), s=round(time.perf_counter() - t0, 1), **sample(dev)
            )
            samples.append(s)
            print(json.dumps(s), flush=True)
    verdict = flat(samples[0], samples[1:])
    summary = {
        "model": args.model,
        "device": str(dev),
        "steps": args.steps,
        "params": sum(p.numel() for p in model.parameters()),
        "flat_after_step": samples[0]["step"],
        "flat": verdict,
        "all_flat": all(verdict.values()),
        "resident": opt.resident,
    }
    print(json.dumps(summary), flush=True)
    if args.out:
        tmp = args.out + ".tmp"
        with open(tmp, "w") as f:
            json.dump({"samples": samples, **summary}, f, indent=1)
        os.replace(tmp, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
