"""End-to-end step time of a GPT under a VRAM cap: stock torch, uncapped fused AdamW, ramstream.

Each variant runs in its own process (the memory cap is per process). Prints one JSON line per
variant and a table; --out writes the JSON list.

    python bench/train/bench_offload.py --model 1.8b --batch 8 --seq 512 --cap-gib 24
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
# name -> (under the VRAM cap?, wrap() options or None for plain torch)
VARIANTS = {
    "stock_capped": (True, None),
    "fused_uncapped": (False, None),
    "ramstream_cpu": (True, {"optimizer_mode": "cpu", "offload": True}),
    "ramstream_auto": (True, {"optimizer_mode": "auto", "offload": True}),
    "ramstream_gpu": (True, {"optimizer_mode": "gpu", "offload": True}),
    "ramstream_auto_act": (True, {"optimizer_mode": "auto", "offload": True,
                                  "activation_offload": 0.25}),
    "ramstream_resident_uncapped": (False, {}),
}


def _rss_gib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


def run_variant(args) -> dict:
    import torch

    sys.path.insert(0, HERE)
    from gpt import CONFIGS, GPT

    dev = torch.device("cuda", torch.cuda.current_device())
    if args.cap_gib:
        total = torch.cuda.get_device_properties(dev).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, args.cap_gib * 2**30 / total), dev)
    torch.manual_seed(0)
    cfg = dict(CONFIGS[args.model], ctx=max(1024, args.seq))
    out = {"variant": args.variant, "model": args.model, "batch": args.batch, "seq": args.seq,
           "cap_gib": args.cap_gib}
    try:
        model = GPT(**cfg).to(dev)
        out["params"] = sum(p.numel() for p in model.parameters())
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.1,
                                fused=args.variant != "ramstream")
        if args.variant == "ramstream":
            import ramstream

            t0 = time.perf_counter()
            model, opt = ramstream.wrap(model, opt, **json.loads(args.options))
            out["wrap_s"] = time.perf_counter() - t0
        x = torch.randint(0, cfg["vocab"], (args.batch, args.seq), device=dev)
        y = torch.randint(0, cfg["vocab"], (args.batch, args.seq), device=dev)
        times = []
        torch.cuda.reset_peak_memory_stats(dev)
        for i in range(args.warmup + args.steps):
            torch.cuda.synchronize(dev)
            t0 = time.perf_counter()
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = model(x, y)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            loss_v = loss.item()
            torch.cuda.synchronize(dev)
            if i >= args.warmup:
                times.append(time.perf_counter() - t0)
        if args.variant == "ramstream":
            opt.synchronize()
            out["stats"] = opt.stats()
            out["resident"] = opt.resident
            out["split"] = opt.split_info
            out["report_events"] = ramstream.memory_report(model)["events"][-5:]
        times.sort()
        out.update(ok=True, s_per_step=times[len(times) // 2], min_s=times[0], loss=loss_v,
                   peak_vram_gib=torch.cuda.max_memory_allocated(dev) / 2**30,
                   host_rss_gib=_rss_gib())
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
    ap.add_argument("--options", default="{}", help="wrap() options as JSON (with --variant)")
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
        capped, options = VARIANTS[v]
        cap = args.cap_gib if capped else 0.0
        variant = "torch" if options is None else "ramstream"
        cmd = [sys.executable, __file__, "--variant", variant, "--model", args.model,
               "--batch", str(args.batch), "--seq", str(args.seq), "--cap-gib", str(cap),
               "--steps", str(args.steps), "--warmup", str(args.warmup),
               "--options", json.dumps(options or {})]
        p = subprocess.run(cmd, capture_output=True, text=True)
        line = [x for x in p.stdout.splitlines() if x.startswith("RESULT ")]
        r = json.loads(line[-1][7:]) if line else {"ok": False, "error": p.stderr[-2000:]}
        r["name"] = v
        results.append(r)
        print(json.dumps(r), flush=True)
    print(f"\n{'variant':18s} {'s/step':>8s} {'peak VRAM GiB':>14s} {'host RSS GiB':>13s}")
    for r in results:
        if r.get("ok"):
            print(f"{r['name']:18s} {r['s_per_step']:8.3f} {r['peak_vram_gib']:14.2f} "
                  f"{r['host_rss_gib']:13.2f}")
        else:
            print(f"{r['name']:18s} {'-':>8s}  {r.get('error', '')[:90]}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
