"""End-to-end step time of a GPT under a VRAM cap: stock torch, uncapped fused AdamW, ramstream.

Each variant runs in its own process (the memory cap is per process). Prints one JSON line per
variant and a table; --out writes the JSON list.

    python bench/train/bench_offload.py --model 1.8b --batch 8 --seq 512 --cap-gib 24

A variant names where it runs (under the cap or not), the wrap() options (None: plain torch) and
the loss: "dense" builds the [tokens, vocab] logits (GPT.forward), "chunked" uses
ramstream.chunked_cross_entropy, which never does. `--device cpu` runs every variant on the CPU
(no cap, no VRAM figures): a smoke test of this script, not a measurement.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
# name -> (under the VRAM cap?, wrap() options or None for plain torch, loss)
VARIANTS = {
    "stock_capped": (True, None, "dense"),
    "fused_uncapped": (False, None, "dense"),
    "ramstream_cpu": (True, {"optimizer_mode": "cpu", "offload": True}, "dense"),
    "ramstream_auto": (True, {"optimizer_mode": "auto", "offload": True}, "dense"),
    "ramstream_gpu": (True, {"optimizer_mode": "gpu", "offload": True}, "dense"),
    "ramstream_auto_act": (
        True,
        {"optimizer_mode": "auto", "offload": True, "activation_offload": 0.25},
        "dense",
    ),
    # the levers for the 21 GiB target: fewer paged blocks (2 or 4 of 32), no full logits
    "ramstream_auto_act2": (
        True,
        {"optimizer_mode": "auto", "offload": True, "activation_offload": 0.0625},
        "dense",
    ),
    "ramstream_auto_act4": (
        True,
        {"optimizer_mode": "auto", "offload": True, "activation_offload": 0.125},
        "dense",
    ),
    "ramstream_auto_chunked": (True, {"optimizer_mode": "auto", "offload": True}, "chunked"),
    "ramstream_resident_uncapped": (False, {}, "dense"),
}


def _rss_gib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


def time_split(before: dict, after: dict, steps: int) -> dict:
    """Per timed step, from OffloadAdamW.stats(): host AdamW and landing time (engine thread),
    forward waits for weights, backward throttling, bytes each way over PCIe."""

    def d(k):
        return (after[k] - before.get(k, 0)) / steps

    return {
        "host_adamw_s": d("host_update_s"),
        "host_land_s": d("host_land_s"),
        "forward_wait_s": d("wait_s"),
        "backward_throttle_s": d("throttle_s"),
        "d2h_gb": d("bytes_d2h") / 1e9,
        "h2d_gb": d("bytes_h2d") / 1e9,
    }


def _sync(dev) -> None:
    import torch

    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def run_variant(args) -> dict:
    import torch

    sys.path.insert(0, HERE)
    from gpt import CONFIGS, GPT

    dev = torch.device(args.device)
    cuda = dev.type == "cuda"
    if cuda:
        from vram_cap import cap_vram

        dev = cap_vram(dev, args.cap_gib)
    torch.manual_seed(0)
    cfg = dict(CONFIGS[args.model], ctx=max(1024, args.seq))
    out = {
        "variant": args.variant,
        "model": args.model,
        "batch": args.batch,
        "seq": args.seq,
        "cap_gib": args.cap_gib if cuda else 0.0,
        "loss_fn": args.loss,
        "device": dev.type,
    }
    try:
        model = GPT(**cfg).to(dev)
        out["params"] = sum(p.numel() for p in model.parameters())
        opt = torch.optim.AdamW(
            model.parameters(), lr=1e-4, weight_decay=0.1, fused=cuda and args.variant != "ramstream"
        )
        if args.variant == "ramstream":
            import ramstream

            t0 = time.perf_counter()
            options = dict(json.loads(args.options), device=str(dev))
            model, opt = ramstream.wrap(model, opt, **options)
            out["wrap_s"] = time.perf_counter() - t0

        def loss_fn(x, y):
            if args.loss == "chunked":
                from ramstream import chunked_cross_entropy

                return chunked_cross_entropy(model.hidden(x), model.head.weight, y)
            return model(x, y)

        x = torch.randint(0, cfg["vocab"], (args.batch, args.seq), device=dev)
        y = torch.randint(0, cfg["vocab"], (args.batch, args.seq), device=dev)
        times, st0 = [], {}
        if cuda:
            torch.cuda.reset_peak_memory_stats(dev)
        for i in range(args.warmup + args.steps):
            _sync(dev)
            t0 = time.perf_counter()
            with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=cuda):
                loss = loss_fn(x, y)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            loss_v = loss.item()
            _sync(dev)
            if i >= args.warmup:
                times.append(time.perf_counter() - t0)
            elif i == args.warmup - 1 and args.variant == "ramstream":
                opt.synchronize()
                st0 = opt.stats()
        if args.variant == "ramstream":
            opt.synchronize()
            out["stats"] = opt.stats()
            out["time_split"] = time_split(st0, out["stats"], args.steps)
            out["resident"] = opt.resident
            out["split"] = opt.split_info
            out["report_events"] = ramstream.memory_report(model)["events"][-5:]
        times.sort()
        out.update(
            ok=True,
            s_per_step=times[len(times) // 2],
            min_s=times[0],
            loss=loss_v,
            peak_vram_gib=torch.cuda.max_memory_allocated(dev) / 2**30 if cuda else None,
            host_rss_gib=_rss_gib(),
        )
    except torch.OutOfMemoryError as e:
        out.update(ok=False, error="OOM: " + str(e).split("\n")[0][:200])
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--model", default="1.8b")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--cap-gib", type=float, default=24.0)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    ap.add_argument("--timeout", type=int, default=600, help="seconds per variant process")
    ap.add_argument("--options", default="{}", help=argparse.SUPPRESS)
    ap.add_argument("--loss", choices=("dense", "chunked"), default="dense", help=argparse.SUPPRESS)
    ap.add_argument("--variant", help=argparse.SUPPRESS)
    ap.add_argument("--out")
    args = ap.parse_args()
    if args.variant:
        print("RESULT " + json.dumps(run_variant(args)), flush=True)
        return 0
    results = []
    for v in args.variants.split(","):
        if v not in VARIANTS:
            ap.error(f"unknown variant {v!r}; known: {', '.join(VARIANTS)}")
        capped, options, loss = VARIANTS[v]
        cap = args.cap_gib if capped else 0.0
        variant = "torch" if options is None else "ramstream"
        cmd = [
            sys.executable,
            __file__,
            "--variant",
            variant,
            "--model",
            args.model,
            "--batch",
            str(args.batch),
            "--seq",
            str(args.seq),
            "--cap-gib",
            str(cap),
            "--steps",
            str(args.steps),
            "--warmup",
            str(args.warmup),
            "--device",
            args.device,
            "--loss",
            loss,
            "--options",
            json.dumps(options or {}),
        ]
        try:
            p = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout)
            line = [x for x in p.stdout.splitlines() if x.startswith("RESULT ")]
            r = json.loads(line[-1][7:]) if line else {"ok": False, "error": p.stderr[-2000:]}
        except subprocess.TimeoutExpired:
            r = {"ok": False, "error": f"timed out after {args.timeout} s"}
        r["name"] = v
        results.append(r)
        print(json.dumps(r), flush=True)
    print(
        f"\n{'variant':28s} {'s/step':>8s} {'peak VRAM GiB':>14s} {'host RSS GiB':>13s} "
        f"{'host AdamW':>10s} {'waits':>7s} {'D2H GB':>7s} {'H2D GB':>7s}"
    )
    for r in results:
        if r.get("ok"):
            vram = r["peak_vram_gib"]
            vram = f"{vram:14.2f}" if vram is not None else f"{'-':>14s}"
            line = f"{r['name']:28s} {r['s_per_step']:8.3f} {vram} {r['host_rss_gib']:13.2f}"
            t = r.get("time_split")
            if t:
                waits = t["forward_wait_s"] + t["backward_throttle_s"]
                line += f" {t['host_adamw_s']:10.3f} {waits:7.3f} {t['d2h_gb']:7.2f} {t['h2d_gb']:7.2f}"
            print(line)
        else:
            print(f"{r['name']:28s} {'-':>8s}  {r.get('error', '')[:90]}")
    print(
        "host AdamW, waits (forward waits + backward throttling): seconds per timed step; "
        "GB crossing PCIe per timed step. GPU compute: the fused_uncapped step."
    )
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
