"""ramstream.OffloadModel against RamTorch 1.11's OffloadModel on the same chunks, side by side
(issue 13): the GPT cut one chunk per block (embedding, 32 blocks, head), bf16 autocast,
window/pin/keep_activations the same for all, torch.optim.AdamW(model.parameters(), fused=True)
for "ramstream" and "ramtorch"; "ramstream_hostopt" is ramstream's OffloadModel with its host
optimizer (model.optimizer(): each chunk's host AdamW overlaps the rest of the backward; fp32
moments, bit-identical to torch's AdamW), "ramstream_hostopt_bf16" the same with bf16 moments
(stochastic rounding: 20 instead of 28 bytes of host traffic per parameter; not in the default
--impls). Each implementation runs in its
own process (the VRAM cap is per process). Reports s/step (forward+backward, and with the
optimizer step), peak VRAM, host RSS, the ratios, and the simulator's prediction (per-chunk times
from a traced ramstream step) against the measured step.

For ramstream_hostopt, opt.step() returns at once (the updates ran during the backward) and the
part of the host AdamW the backward did not hide shows as the next forward's wait for the first
chunk's update: its fwd_bwd_s includes that wait, so compare step_s (the whole cycle).

    python bench/train/bench_offload_model.py --model 1.8b --batch 8 --seq 512 --cap-gib 24 \
        --window 2 --pin 0 --out offload_model.json
    python bench/train/bench_offload_model.py --tiny      # the CPU, seconds: a smoke test

RamTorch is imported as `ramtorch` (install its wheel with pip --target and put it on
PYTHONPATH); when it does not import, its row says so and the ratio is absent. Both get the same
--window and --pin, with the same meanings: window = device slots for streamed chunks, the
running one included (window=2: one chunk loaded ahead), pin = that many evenly spaced resident
chunks (chunk i * n // pin). The ramstream row reports its streamed weights' peak on the
device (`peak_loaded_gib`) and the window's bound (`window_bound_gib`: the `window` largest
streamed chunks) next to the peak VRAM of both.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
IMPLS = ("ramstream", "ramstream_hostopt", "ramstream_hostopt_bf16", "ramtorch")


def _rss_gib() -> tuple[float, float]:
    """(current, peak) host RSS of this process in GiB."""
    with open("/proc/self/statm") as f:
        cur = int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    return cur / 2**30, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


def build_chunks(model_key: str, seq: int):
    """The GPT of gpt.py (fast random init on the CPU) cut into [embedding, block..., head]."""
    import torch
    import torch.nn as nn

    sys.path.insert(0, HERE)
    from stream_models import build_gpt

    gpt, vocab = build_gpt(
        {"1.8b": "gpt1.8b", "6.85b": "gpt6.85b", "tiny": "gpt_tiny"}[model_key], seq, "cpu"
    )

    class Embed(nn.Module):
        def __init__(self, wte, wpe):
            super().__init__()
            self.wte, self.wpe = wte, wpe

        def forward(self, idx):
            return self.wte(idx) + self.wpe(torch.arange(idx.shape[1], device=idx.device))

    class Head(nn.Module):
        def __init__(self, ln_f, head):
            super().__init__()
            self.ln_f, self.head = ln_f, head

        def forward(self, x):
            return self.head(self.ln_f(x))

    chunks = [Embed(gpt.wte, gpt.wpe), *gpt.layers, Head(gpt.ln_f, gpt.head)]
    return chunks, vocab


def _loss(logits, targets):
    import torch.nn.functional as F

    return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())


def child(args) -> dict:
    """One implementation's run, in this process."""
    import torch
    from vram_cap import cap_vram

    dev = torch.device(args.device)
    cap_vram(dev, args.cap_gib)
    t0 = time.perf_counter()
    chunks, vocab = build_chunks(args.model, args.seq)
    kw = dict(device=str(dev), window=args.window, pin=args.pin, keep_activations=args.keep)
    if args.impl.startswith("ramstream"):
        import ramstream

        model = ramstream.OffloadModel(chunks, **kw)
        version = ramstream.__version__
    else:
        import ramtorch

        model = ramtorch.OffloadModel(chunks, **kw)
        version = ramtorch.__version__
    moments = "bfloat16" if args.impl == "ramstream_hostopt_bf16" else "float32"
    if args.impl.startswith("ramstream_hostopt"):
        opt = model.optimizer(lr=1e-4, moment_dtype=moments, threads=args.host_threads)
    else:
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    build_s = time.perf_counter() - t0
    g = torch.Generator().manual_seed(0)
    idx = torch.randint(0, vocab, (args.batch, args.seq), generator=g).to(dev)
    tgt = torch.randint(0, vocab, (args.batch, args.seq), generator=g).to(dev)

    def sync():
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)

    def one(profile_path=None):
        """(forward+backward s, optimizer s, loss)"""
        sync()
        a = time.perf_counter()
        with torch.autocast(dev.type, dtype=torch.bfloat16):
            extra = {} if profile_path is None else {"profile_path": profile_path}
            res = model.step(idx, targets=tgt, loss_fn=_loss, **extra)
        model.flush_grads()
        sync()
        b = time.perf_counter()
        opt.step()
        opt.zero_grad(set_to_none=True)
        sync()
        return b - a, time.perf_counter() - b, float(res.loss)

    if dev.type == "cuda":
        torch.cuda.reset_peak_memory_stats(dev)
    rows = [one() for _ in range(args.warmup + args.steps)][args.warmup :]
    fb = sorted(r[0] for r in rows)[len(rows) // 2]
    op = sorted(r[1] for r in rows)[len(rows) // 2]
    out = {
        "impl": args.impl,
        "version": version,
        "build_s": round(build_s, 2),
        "fwd_bwd_s": fb,
        "optimizer_s": op,
        "step_s": fb + op,
        "losses": [r[2] for r in rows],
        "peak_vram_gib": torch.cuda.max_memory_allocated(dev) / 2**30 if dev.type == "cuda" else None,
    }
    if args.impl.startswith("ramstream"):
        # the streamed weights on the device at once, against the window's bound: its `window`
        # largest streamed chunks
        sizes = sorted((b.nbytes for b in model.streamer.blocks), reverse=True)
        out["pinned"] = model.pinned
        out["peak_loaded_gib"] = model.stats["peak_loaded_bytes"] / 2**30
        out["window_bound_gib"] = sum(sizes[: args.window]) / 2**30
    if args.impl.startswith("ramstream_hostopt"):
        st = opt.stats()
        steps = max(1, st["steps"])
        out["moment_dtype"], out["host_threads"] = moments, args.host_threads
        out["host_update_s_per_step"] = st["host_update_s"] / steps  # engine thread, all chunks
        out["load_wait_s_per_step"] = model.stats["stream_wait_s"] / steps  # loads waiting for updates
    out["rss_gib"], out["peak_rss_gib"] = _rss_gib()
    if args.impl == "ramstream":
        out.update(_predict(model, one, args))
    return out


def _predict(model, one, args) -> dict:
    """The simulator's makespan from a traced step's per-chunk times vs the measured step."""
    from ramstream.simulate import simulate_offload, times_from_trace

    fd, path = tempfile.mkstemp(suffix=".json", prefix="offload-model-step-")
    os.close(fd)
    try:
        traced_s, _, _ = one(profile_path=path)
        t = times_from_trace(path, keep_activations=args.keep)
    finally:
        os.unlink(path)
    pred = simulate_offload(
        t["tf"],
        t["tb"],
        t["th2d"],
        td2h=t["td2h"],
        window=args.window,
        pin=args.pin,
        keep_activations=args.keep,
        serial=args.device == "cpu",
    )
    return {
        "traced_fwd_bwd_s": traced_s,
        "predicted_s": pred.makespan,
        "predicted_utilisation": pred.utilisation,
        "predicted_peak_chunks": pred.peak_chunks,
        "chunk_times": {k: [round(v, 6) for v in t[k]] for k in ("tf", "tb", "th2d", "td2h")},
    }


def _keep(v: str):
    return {"true": True, "false": False, "checkpoint": "checkpoint"}[v.lower()]


def _parser():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="1.8b", choices=["1.8b", "6.85b", "tiny"])
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--cap-gib", type=float, default=24.0)
    ap.add_argument("--window", type=int, default=2)
    ap.add_argument("--pin", type=int, default=0)
    ap.add_argument(
        "--keep", type=_keep, default=True, help="keep_activations: true (default), false, checkpoint"
    )
    ap.add_argument("--steps", type=int, default=5, help="timed steps (the median is reported)")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--impls", default="ramstream,ramstream_hostopt,ramtorch")
    ap.add_argument("--device", default="cuda")
    ap.add_argument(
        "--host-threads",
        type=int,
        default=None,
        help="ramstream_hostopt: host AdamW threads (default: all cores; fewer leaves one to the GPU driver thread)",
    )
    ap.add_argument("--deadline", type=float, default=900.0, help="seconds for the whole run")
    ap.add_argument("--tiny", action="store_true", help="the tiny GPT on the CPU, 2x64, 2 steps")
    ap.add_argument("--out", help="write the JSON rows here")
    ap.add_argument("--child", choices=IMPLS, help=argparse.SUPPRESS)
    return ap


def _child_argv(args, impl: str) -> list[str]:
    keep = {True: "true", False: "false", "checkpoint": "checkpoint"}[args.keep]
    return [
        sys.executable, os.path.abspath(__file__), "--child", impl, "--model", args.model,
        "--batch", str(args.batch), "--seq", str(args.seq), "--cap-gib", str(args.cap_gib),
        "--window", str(args.window), "--pin", str(args.pin), "--keep", keep,
        "--steps", str(args.steps), "--warmup", str(args.warmup), "--device", args.device,
    ] + ([] if args.host_threads is None else ["--host-threads", str(args.host_threads)])  # fmt: skip


def run(args) -> list[dict]:
    impls = [i for i in args.impls.split(",") if i]
    bad = [i for i in impls if i not in IMPLS]
    if bad:
        raise SystemExit(f"--impls: unknown {bad}; accepted: {', '.join(IMPLS)}")
    end = time.monotonic() + args.deadline
    rows = []
    for impl in impls:
        left = end - time.monotonic()
        if left < 5:
            rows.append({"impl": impl, "error": "deadline reached before it started"})
            continue
        if impl == "ramtorch":
            probe = subprocess.run([sys.executable, "-c", "import ramtorch"], capture_output=True, text=True)
            if probe.returncode != 0:
                rows.append({"impl": impl, "error": "ramtorch does not import (install its wheel)"})
                continue
        try:
            p = subprocess.run(_child_argv(args, impl), capture_output=True, text=True, timeout=left)
        except subprocess.TimeoutExpired:
            rows.append({"impl": impl, "error": f"timed out (deadline {args.deadline:.0f} s)"})
            continue
        lines = [ln for ln in p.stdout.splitlines() if ln.startswith("RESULT ")]
        if p.returncode != 0 or not lines:
            tail = (p.stderr or p.stdout).strip().splitlines()[-3:]
            rows.append({"impl": impl, "error": f"rc={p.returncode}: " + " | ".join(tail)})
            continue
        rows.append(json.loads(lines[-1][len("RESULT ") :]))
    by = {r["impl"]: r for r in rows if "error" not in r}
    for name, s in by.items():
        if name.startswith("ramstream") and "ramtorch" in by:
            t = by["ramtorch"]
            s["speedup_vs_ramtorch"] = {k: t[k] / s[k] for k in ("fwd_bwd_s", "step_s")}
            if s["peak_vram_gib"] is not None:
                s["vram_vs_ramtorch"] = s["peak_vram_gib"] / t["peak_vram_gib"]
        if name.startswith("ramstream_hostopt") and "ramstream" in by:  # against torch's AdamW
            s["step_speedup_vs_ramstream"] = by["ramstream"]["step_s"] / s["step_s"]
    return rows


def report(rows, args) -> None:
    cfg = f"{args.model} {args.batch}x{args.seq} window={args.window} pin={args.pin} keep_activations={args.keep}"
    print(f"config {cfg} device={args.device} cap={args.cap_gib} GiB")
    print(
        f"{'impl':<18} {'fwd+bwd s':>9} {'step s':>8} {'VRAM GiB':>8} {'RSS GiB':>8} "
        f"{'fwd+bwd x':>9} {'step x':>7}  (x: speedup vs ramtorch)"
    )
    for r in rows:
        if "error" in r:
            print(f"{r['impl']:<18} {r['error']}")
            continue
        vram = "-" if r["peak_vram_gib"] is None else f"{r['peak_vram_gib']:.2f}"
        sp = r.get("speedup_vs_ramtorch", {})
        line = (
            f"{r['impl']:<18} {r['fwd_bwd_s']:>9.3f} {r['step_s']:>8.3f} {vram:>8} {r['peak_rss_gib']:>8.2f}"
        )
        if sp:
            line += f" {sp['fwd_bwd_s']:>8.2f}x {sp['step_s']:>6.2f}x"
        print(line)
        if "step_speedup_vs_ramstream" in r:
            print(
                f"{'':<18} host optimizer ({r['moment_dtype']} moments): step "
                f"{r['step_speedup_vs_ramstream']:.2f}x ramstream with torch's AdamW; host AdamW "
                f"{r['host_update_s_per_step']:.3f} s/step, loads waited {r['load_wait_s_per_step']:.3f} s/step"
            )
        if "predicted_s" in r:
            err = r["predicted_s"] / r["fwd_bwd_s"] - 1
            print(
                f"{'':<18} simulator: {r['predicted_s']:.3f} s predicted vs {r['fwd_bwd_s']:.3f} s ({err:+.1%})"
            )


def main(argv=None) -> int:
    args = _parser().parse_args(argv)
    if args.tiny:
        args.model, args.batch, args.seq, args.device = "tiny", 2, 64, "cpu"
        args.steps, args.warmup = 2, 1
    if args.child:
        args.impl = args.child
        print("RESULT " + json.dumps(child(args)), flush=True)
        return 0
    rows = run(args)
    report(rows, args)
    if args.out:
        tmp = args.out + ".tmp"
        with open(tmp, "w") as f:
            json.dump({"config": vars(args) | {"keep": str(args.keep)}, "rows": rows}, f, indent=1)
        os.replace(tmp, args.out)
    return 0 if any("error" not in r for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
