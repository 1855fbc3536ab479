"""Weight-streaming probe: one configuration of the GPT benchmark model per process, streamed
through a small memory cap, against the same model unstreamed (uncapped) in the same run.

    python bench/train/probe_stream.py                         # GPU: 1.8B GPT, every config
    python bench/train/probe_stream.py --model tiny --device cpu --steps 2   # CI smoke test

Prints one JSON line per configuration: s/step (median after warmup), peak VRAM, the bytes the
weight stream moved per step and their rate against a pinned H2D copy measured in the same
process (the stream's PCIe utilisation), block loads per step, and the host-side waits.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))

# name: (weights dtype, autocast, cap GiB or None, wrap options)
CONFIGS = {
    "bf16_unstreamed_nocap": ("bf16", False, None, {"param_offload": False}),
    "bf16_streamed_4g": ("bf16", False, 4, {"param_offload": True, "activation_offload": True}),
    "bf16_streamed_4g_w2": (
        "bf16",
        False,
        4,
        {"param_offload": True, "activation_offload": True, "weight_window": 2},
    ),
    "fp32_autocast_streamed_8g": ("fp32", True, 8, {"param_offload": True, "activation_offload": True}),
}


def one(args) -> dict:
    import torch

    sys.path.insert(0, HERE)
    from gpt import CONFIGS as SIZES
    from gpt import GPT

    import ramstream

    dtype_name, autocast, cap, options = CONFIGS[args.config]
    from vram_cap import cap_vram

    dev = cap_vram(args.device, cap)
    cuda = dev.type == "cuda"
    torch.manual_seed(0)
    model = GPT(**SIZES[args.model])  # built on the CPU: the streamed blocks never all visit the GPU
    if dtype_name == "bf16":
        model = model.bfloat16()
    model, opt = ramstream.wrap(model, device=dev, optimizer_mode="auto", **options)
    cfg = SIZES[args.model]
    g = torch.Generator().manual_seed(1)
    x = torch.randint(0, cfg["vocab"], (args.batch, args.seq), generator=g).to(dev)
    times = []
    st = model._ramstream.streamer
    for i in range(args.warmup + args.steps):
        if i == args.warmup:
            b0 = dict(st.stats) if st is not None else {}
            s0 = dict(opt.stats())
            if cuda:
                torch.cuda.reset_peak_memory_stats(dev)
        t0 = time.perf_counter()
        with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=autocast and cuda):
            loss = ramstream.chunked_cross_entropy(model.hidden(x), model.head.weight, x)
        loss.backward()
        opt.step()
        opt.zero_grad()
        if cuda:
            torch.cuda.synchronize(dev)
        times.append(time.perf_counter() - t0)
    step_s = statistics.median(times[args.warmup :])
    out = {
        "config": args.config,
        "model": args.model,
        "batch": args.batch,
        "seq": args.seq,
        "cap_gib": cap,
        "s_per_step": step_s,
        "loss": loss.item(),
        "peak_gib": torch.cuda.max_memory_allocated(dev) / 2**30 if cuda else None,
    }
    if st is not None:
        n = args.steps
        moved = (st.stats["bytes_h2d"] - b0["bytes_h2d"]) / n
        out.update(
            stream_gb_per_step=moved / 1e9,
            loads_per_step=(st.stats["loads"] - b0["loads"]) / n,
            stream_wait_s=(st.stats["stream_wait_s"] - b0["stream_wait_s"]) / n,
            streamed_blocks=len(st.blocks),
        )
        if cuda:
            from stream_models import h2d_gbps

            bw = h2d_gbps(dev)
            out.update(
                h2d_gbps=bw, stream_gbps=moved / step_s / 1e9, stream_share_of_step=moved / step_s / 1e9 / bw
            )
    s1 = opt.stats()
    for k in ("host_update_s", "wait_s", "throttle_s"):
        if k in s1:
            out[k] = (s1[k] - s0.get(k, 0)) / args.steps
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--model", default="1.8b")
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--configs", default=",".join(CONFIGS))
    ap.add_argument("--config", help=argparse.SUPPRESS)
    ap.add_argument("--timeout", type=int, default=240)
    ap.add_argument("--out")
    args = ap.parse_args()
    if args.config:
        print(json.dumps(one(args)), flush=True)
        return 0
    results = []
    for name in args.configs.split(","):
        cmd = [sys.executable, __file__, "--config", name, "--model", args.model, "--device", args.device]
        for k in ("batch", "seq", "steps", "warmup"):
            cmd += [f"--{k}", str(getattr(args, k))]
        try:
            p = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout)
            line = (p.stdout.strip().splitlines() or [""])[-1]
            r = json.loads(line) if p.returncode == 0 else {"config": name, "error": p.stderr[-1500:]}
        except subprocess.TimeoutExpired:
            r = {"config": name, "error": f"timeout after {args.timeout} s"}
        results.append(r)
        print(json.dumps(r), flush=True)
    if args.out:
        with open(args.out + ".tmp", "w") as f:
            json.dump(results, f, indent=1)
        os.replace(args.out + ".tmp", args.out)
    return 0 if all("error" not in r for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
