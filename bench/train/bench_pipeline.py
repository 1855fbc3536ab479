"""ramstream.Pipeline benchmarks (issue 28), each implementation in its own process (the VRAM cap
is per process), the GPT of bench_offload_model.py cut into chunks [embedding, blocks..., head]
(its build_chunks), bf16 autocast, torch.optim.AdamW over the chunks' parameters.

Rows (--rows):
  P2     2 stages on cuda:0 twice, streamed chunks (--window/--pin), --microbatches: ramstream
         Pipeline with schedule gpipe (its streamed stages run chunk-major: each chunk loaded
         twice per step) and 1f1b, vs ramstream OffloadModel on the same chunks and window (the
         whole batch in one step) vs RamTorch 1.11's Pipeline with the same stages, its
         "staggered_1b1f" (the textbook 1F1B) and its "gpipe". Targets: <= 1.1x OffloadModel's
         step, >= 1.5x faster than RamTorch (its faster schedule).
  P4     4 stages (--p4-stages) on cuda:0, each of gpipe / 1f1b / interleaved (2 virtual
         chunks per stage): the measured step against simulate_schedule fed with the per-op
         times of a traced step in the same process (trace_path=; median F and B per chunk). A
         span leaves out the op's wait for its input (the simulator adds the dependencies) and,
         with --trace-sync (default), ends when the op's work on its stage's stream has. Target:
         within 15 %. The stages share one GPU here: the simulator is told so (devices=, the
         processor sharing of simulate/shared.py) and fed each op's time alone on the device,
         its traced span less what the ops running beside it took (exclusive_times); the
         prediction of the older model (a device per stage, fed the spans as they are) is
         reported beside it (own_devices_error).
         Run microbatch by microbatch (offload_chunk_major=False): the schedule the simulator
         models, op by op. GPipe recomputes each chunk's forward in its backward
         (offload_keep_activations="checkpoint"): holding every microbatch's activations of four
         stages does not fit the 24 GiB cap (a PipelineOutOfMemoryError); the traced backward
         times include the recompute.
  P2GPU  2 stages on cuda:0 and cuda:1 (skipped when torch.cuda.device_count() < 2) vs the
         1-GPU run of the same model (P2's ramstream row, or its own) and RamTorch on the same
         two GPUs. Targets: >= 1.8x throughput, >= RamTorch.

Each row reports step_s (the median of the settled steps, optimizer included; pipeline_s and
optimizer_s: its two parts, P4's prediction compared with pipeline_s), peak VRAM per
device, tokens/s and the ratios against its baselines.

    python bench/train/bench_pipeline.py --model 1.8b --batch 8 --seq 512 --microbatches 8 \
        --cap-gib 24 --window 2 --pin 0 --out pipeline.json
    python bench/train/bench_pipeline.py --device cpu --tiny   # every row on the CPU, seconds

RamTorch is imported as `ramtorch` (its wheel installed with pip --target, on PYTHONPATH); when it
does not import, its entry says so and its ratios are absent. On the CPU (--device cpu) every
"cuda:i" is "cpu" and streamed stages run on the CPU engine.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from bench_offload_model import _loss, _rss_gib, build_chunks  # noqa: E402
from pipeline_measure import _median, _predict, _profile, host_timers  # noqa: E402

ROWS = ("P2", "P4", "P2GPU")
IMPLS = ("ramstream", "offload", "ramtorch", "eager")
SCHEDULES = ("gpipe", "1f1b", "interleaved")
RAMTORCH_NAME = {"1f1b": "staggered_1b1f", "gpipe": "gpipe", "interleaved": "interleaved"}


def stage_lists(chunks, stages: int) -> list[list]:
    """The chunks cut into `stages` consecutive lists (earlier stages take the remainder)."""
    q, r = divmod(len(chunks), stages)
    out, i = [], 0
    for s in range(stages):
        k = q + (s < r)
        out.append(list(chunks[i : i + k]))
        i += k
    return out


def child(args) -> dict:
    """One implementation's run in this process: args.impl on args.devices."""
    import torch

    devs = [torch.device(d) for d in args.devices.split(",")]
    cuda = [d for d in dict.fromkeys(devs) if d.type == "cuda"]
    from vram_cap import cap_vram

    for d in cuda if args.impl != "eager" else ():
        cap_vram(d, args.cap_gib)
    if args.unfused:
        from ramstream.pipeline import chunk_major

        chunk_major.fuse_cast_grads = lambda *_: []
    t0 = time.perf_counter()
    chunks, vocab = build_chunks(args.model, args.seq)
    params = [p for c in chunks for p in c.parameters()]
    v = 2 if args.schedule == "interleaved" else 1
    off = dict(offload=True, offload_window=args.window, offload_pin=args.pin)
    if args.keep != "true":
        off["offload_keep_activations"] = args.keep
    if args.impl == "eager":  # stock PyTorch, the unsplit model resident (no cap): a floor
        import torch as lib

        model = torch.nn.Sequential(*chunks).to(devs[0])
        params = list(model.parameters())
    elif args.impl == "offload":
        import ramstream as lib

        model = lib.OffloadModel(chunks, device=str(devs[0]), window=args.window, pin=args.pin)
        params = list(model.parameters())
    elif args.impl == "ramstream":
        import ramstream as lib

        # interleaved: stages*2 virtual chunks, each a streamed list, chunk c on stage c % stages
        lists = stage_lists(chunks, len(devs) * v)
        model = lib.Pipeline(
            stage_modules=lists,
            chunks_per_stage=v if v > 1 else None,
            devices=[str(d) for d in devs],
            autocast=torch.bfloat16,
            offload_chunk_major=not args.predict,  # P4: the per-microbatch ops the simulator models
            **off,
        )
    else:
        import ramtorch as lib

        if v > 1:  # RamTorch's stage_modules take one module (or chunk list) per stage
            raise SystemExit("ramtorch: interleaved is not run here")
        model = lib.Pipeline(
            stage_modules=stage_lists(chunks, len(devs)),
            devices=[str(d) for d in devs],
            autocast=torch.bfloat16,
            **off,
        )
    if args.host_opt and args.impl in ("ramstream", "offload"):  # ramstream's host AdamW, in the backward
        opt = model.optimizer(lr=1e-4, threads=args.host_opt_threads, eager_updates=not args.host_opt_at_step)
    else:
        opt = torch.optim.AdamW(params, lr=1e-4, fused=True)  # streamed stages: home copies on the host
    build_s = time.perf_counter() - t0
    g = torch.Generator().manual_seed(0)
    idx = torch.randint(0, vocab, (args.batch, args.seq), generator=g).to(devs[0])
    tgt = torch.randint(0, vocab, (args.batch, args.seq), generator=g).to(devs[-1])

    def sync():
        for d in cuda:
            torch.cuda.synchronize(d)

    def one(trace_path=None) -> tuple[float, float]:
        sync()
        a = time.perf_counter()
        if args.impl == "eager":  # microbatch by microbatch, gradients accumulated, as the pipeline
            n, total = args.microbatches, 0.0
            for xm, ym in zip(idx.tensor_split(n), tgt.tensor_split(n)):
                with torch.autocast(devs[0].type, dtype=torch.bfloat16):
                    loss = _loss(model(xm), ym)
                (loss / n).backward()
                total += loss.detach() / n
            res = type("R", (), {"loss": total})
        elif args.impl == "offload":
            with torch.autocast(devs[0].type, dtype=torch.bfloat16):
                res = model.step(idx, targets=tgt, loss_fn=_loss)
            model.flush_grads()
        else:
            kw = {} if trace_path is None else {"trace_path": trace_path}
            sched = RAMTORCH_NAME[args.schedule] if args.impl == "ramtorch" else args.schedule
            res = model.step(
                idx, targets=tgt, loss_fn=_loss, n_microbatches=args.microbatches, schedule=sched, **kw
            )
            if args.impl == "ramtorch":
                res.flush_grads()  # RamTorch: accumulated grads into .grad, mean over microbatches
        sync()
        b = time.perf_counter()
        opt.step()
        opt.zero_grad(set_to_none=True)
        sync()
        t = time.perf_counter()
        one.split.append((b - a, t - b))
        return t - a, float(res.loss)

    one.split = []

    for d in cuda:
        torch.cuda.reset_peak_memory_stats(d)
    runs = [one() for _ in range(args.warmup)]
    timers = host_timers() if args.host_timers and args.impl == "ramstream" else None
    runs = [one() for _ in range(args.steps)]
    if timers is not None:
        timers[1]()
    step_s = _median([r[0] for r in runs])
    split = one.split[args.warmup :]
    out = {
        "impl": args.impl,
        "version": getattr(lib, "__version__", "?"),
        "devices": args.devices,
        "schedule": None if args.impl in ("offload", "eager") else args.schedule,
        "microbatches": args.microbatches,
        "build_s": round(build_s, 2),
        "step_s": step_s,
        "steps_s": [r[0] for r in runs],
        "tokens_per_s": args.batch * args.seq / step_s,
        "pipeline_s": _median([x[0] for x in split]),  # the step without the optimizer's
        "optimizer_s": _median([x[1] for x in split]),
        "losses": [r[1] for r in runs],
        "peak_vram_gib": {str(d): torch.cuda.max_memory_allocated(d) / 2**30 for d in cuda} or None,
        # the caching allocator at the cap: a retry frees the cache after synchronizing the device
        "peak_reserved_gib": {str(d): torch.cuda.max_memory_reserved(d) / 2**30 for d in cuda} or None,
        "alloc_retries": {str(d): torch.cuda.memory_stats(d).get("num_alloc_retries", 0) for d in cuda}
        or None,
    }
    if timers is not None:  # seconds and calls per step
        out["host_timers"] = {k: [v[0] / args.steps, v[1] / args.steps] for k, v in timers[0].items()}
    out["rss_gib"], out["peak_rss_gib"] = _rss_gib()
    if args.predict and args.impl == "ramstream":
        out.update(_predict(one, args, len(devs), v))
    if args.profile:
        out["profile"] = _profile(one, args.profile)
    if args.trace and args.impl == "ramstream":
        out["traced_s"], _ = one(trace_path=args.trace)
    if hasattr(model, "close"):
        model.close()
    return out


def _parser():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="1.8b", choices=["1.8b", "6.85b", "tiny"])
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--microbatches", type=int, default=8)
    ap.add_argument("--cap-gib", type=float, default=24.0)
    ap.add_argument("--window", type=int, default=2)
    ap.add_argument("--pin", type=int, default=0)
    ap.add_argument("--steps", type=int, default=5, help="timed steps (the median is reported)")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--rows", default="P2,P4,P2GPU")
    ap.add_argument("--p4-stages", type=int, default=4, help="P4's stage count (--tiny: 2)")
    ap.add_argument("--device", default="cuda", help="cuda, or cpu (every stage on the CPU)")
    ap.add_argument(
        "--no-trace-sync", dest="trace_sync", action="store_false", help="P4: host spans as they are"
    )
    ap.add_argument("--deadline", type=float, default=1500.0, help="seconds for the whole run")
    ap.add_argument("--tiny", action="store_true", help="the tiny GPT on the CPU, 8x64, 2 steps")
    ap.add_argument("--out", help="write the JSON rows here")
    ap.add_argument(
        "--eager",
        action="store_true",
        help="P2: also stock PyTorch with the model resident and no cap, over the same microbatches "
        "and over the whole batch (floors: what microbatching costs eager PyTorch itself)",
    )
    ap.add_argument("--child", choices=IMPLS, help=argparse.SUPPRESS)
    ap.add_argument("--devices", help=argparse.SUPPRESS)
    ap.add_argument("--schedule", default="1f1b", help=argparse.SUPPRESS)
    ap.add_argument("--predict", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--keep", default="true", choices=["true", "checkpoint"], help=argparse.SUPPRESS)
    ap.add_argument(
        "--unfused", action="store_true", help="child: chunk-major without cast_grads.py (an A/B of it)"
    )
    ap.add_argument(
        "--host-opt",
        action="store_true",
        help="child (ramstream, offload): the model's host optimizer (.optimizer(): each chunk updated "
        "during the backward) instead of torch's fused AdamW on the home copies",
    )
    ap.add_argument(
        "--host-opt-at-step", action="store_true", help="child: --host-opt with eager_updates=False"
    )
    ap.add_argument("--host-opt-threads", type=int, help="child: --host-opt's threads (default: all cores)")
    ap.add_argument(
        "--host-timers",
        action="store_true",
        help="child (ramstream): the host time of the pipeline's pieces per step (pipeline_measure.host_timers)",
    )
    ap.add_argument("--profile", help="child: torch.profiler over one more step, its table written here")
    ap.add_argument("--trace", help="child (ramstream): one more step traced (Perfetto JSON) here")
    return ap


def _devices(args, n: int, gpus: int) -> str:
    """n stages on `gpus` GPUs round-robin ("cpu" for each on --device cpu)."""
    if args.device == "cpu":
        return ",".join(["cpu"] * n)
    return ",".join(f"cuda:{s % gpus}" for s in range(n))


class Runner:
    def __init__(self, args):
        self.args, self.end = args, time.monotonic() + args.deadline
        self.ramtorch = None

    def __call__(
        self,
        impl: str,
        devices: str,
        schedule: str = "1f1b",
        predict: bool = False,
        keep: str = "true",
        microbatches: int | None = None,
    ) -> dict:
        a = self.args
        tag = {"impl": impl, "devices": devices, "schedule": schedule}
        left = self.end - time.monotonic()
        if left < 5:
            return tag | {"error": "deadline reached before it started"}
        if impl == "ramtorch":
            if self.ramtorch is None:
                p = subprocess.run([sys.executable, "-c", "import ramtorch"], capture_output=True, text=True)
                self.ramtorch = p.returncode == 0
            if not self.ramtorch:
                return tag | {"error": "ramtorch does not import (install its wheel, put it on PYTHONPATH)"}
        argv = [
            sys.executable, os.path.abspath(__file__), "--child", impl, "--devices", devices,
            "--schedule", schedule, "--model", a.model, "--batch", str(a.batch), "--seq", str(a.seq),
            "--microbatches", str(microbatches or a.microbatches), "--cap-gib", str(a.cap_gib),
            "--window", str(a.window), "--pin", str(a.pin), "--steps", str(a.steps),
            "--warmup", str(a.warmup),
            "--keep", keep,
        ] + (["--predict"] if predict else []) + ([] if a.trace_sync else ["--no-trace-sync"])  # fmt: skip
        try:
            p = subprocess.run(argv, capture_output=True, text=True, timeout=left)
        except subprocess.TimeoutExpired:
            return tag | {"error": f"timed out (deadline {a.deadline:.0f} s)"}
        lines = [ln for ln in p.stdout.splitlines() if ln.startswith("RESULT ")]
        if p.returncode != 0 or not lines:
            tail = (p.stderr or p.stdout).strip().splitlines()[-3:]
            return tag | {"error": f"rc={p.returncode}: " + " | ".join(tail)}
        return json.loads(lines[-1][len("RESULT ") :])


def _ratio(num: dict, den: dict):
    """num's step_s / den's step_s, None when either failed."""
    if "error" in num or "error" in den:
        return None
    return num["step_s"] / den["step_s"]


def run(args) -> list[dict]:
    import torch

    rows_wanted = [r for r in args.rows.split(",") if r]
    bad = [r for r in rows_wanted if r not in ROWS]
    if bad:
        raise SystemExit(f"--rows: unknown {bad}; accepted: {', '.join(ROWS)}")
    go = Runner(args)
    rows: list[dict] = []
    one_gpu = None
    if "P2" in rows_wanted:
        d = _devices(args, 2, 1)
        r = {"row": "P2", "ramstream": go("ramstream", d, "gpipe"), "ramstream_1f1b": go("ramstream", d)}
        r["offload"] = go("offload", d.split(",")[0])
        r["ramtorch"], r["ramtorch_gpipe"] = go("ramtorch", d), go("ramtorch", d, "gpipe")
        if args.eager:  # floors: stock PyTorch, resident, the same microbatches / the whole batch
            d0 = d.split(",")[0]
            r["eager_mb"], r["eager_whole"] = go("eager", d0), go("eager", d0, microbatches=1)
        r["vs_offload"] = _ratio(r["ramstream"], r["offload"])  # target <= 1.1
        rt = [m for m in (r["ramtorch"], r["ramtorch_gpipe"]) if "error" not in m]
        best = min(rt, key=lambda m: m["step_s"]) if rt else r["ramtorch"]
        r["speedup_vs_ramtorch"] = _ratio(best, r["ramstream"])  # target >= 1.5, its faster schedule
        one_gpu = r["ramstream"]
        rows.append(r)
    if "P4" in rows_wanted:
        d = _devices(args, args.p4_stages, 1)
        for s in SCHEDULES:
            # GPipe holds every microbatch's activations of every stage: recomputed to fit the cap
            keep = "checkpoint" if s == "gpipe" else "true"
            m = go("ramstream", d, s, predict=True, keep=keep)
            r = {"row": "P4", "schedule": s, "keep_activations": keep, "ramstream": m}
            if "error" not in m:
                r["predicted_s"] = m["predicted_s"]
                # the simulator models the schedule: against the step without the optimizer's
                r["prediction_error"] = m["predicted_s"] / m["pipeline_s"] - 1  # target |.| <= 0.15
                # the model before the stages' sharing of one device was simulated (for comparison)
                r["own_devices_error"] = m["predicted_own_devices_s"] / m["pipeline_s"] - 1
            rows.append(r)
    if "P2GPU" in rows_wanted:
        gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if args.device != "cpu" and gpus < 2:
            rows.append({"row": "P2GPU", "skipped": f"needs 2 GPUs, torch.cuda.device_count() = {gpus}"})
        else:
            d = _devices(args, 2, 2)
            r = {"row": "P2GPU", "ramstream": go("ramstream", d)}
            r["one_gpu"] = one_gpu if one_gpu is not None else go("ramstream", _devices(args, 2, 1))
            r["ramtorch"] = go("ramtorch", d)
            r["throughput_vs_one_gpu"] = _ratio(r["one_gpu"], r["ramstream"])  # target >= 1.8
            r["speedup_vs_ramtorch"] = _ratio(r["ramtorch"], r["ramstream"])  # target >= 1.0
            rows.append(r)
    return rows


def _fmt(m: dict) -> str:
    if "error" in m:
        return f"{m['impl']:<10} [{m['devices']}] {m['error']}"
    vram = m["peak_vram_gib"]
    v = "-" if not vram else " ".join(f"{k}={g:.2f}" for k, g in vram.items())
    return (
        f"{m['impl']:<10} {m['schedule'] or '-':<6} [{m['devices']}] {m['step_s']:.3f} s/step  {m['tokens_per_s']:.0f} tok/s  "
        f"VRAM GiB {v}  RSS {m['peak_rss_gib']:.2f} GiB"
    )


def report(rows, args) -> None:
    print(
        f"config {args.model} {args.batch}x{args.seq} microbatches={args.microbatches} "
        f"window={args.window} pin={args.pin} device={args.device} cap={args.cap_gib} GiB"
    )

    def x(v, what):
        return "" if v is None else f"  {what} {v:.2f}x"

    for r in rows:
        if "skipped" in r:
            print(f"{r['row']}: skipped: {r['skipped']}")
            continue
        head = r["row"] + (f" {r['schedule']}" if "schedule" in r else "")
        print(f"{head}:")
        for k in (
            "ramstream",
            "ramstream_1f1b",
            "offload",
            "one_gpu",
            "ramtorch",
            "ramtorch_gpipe",
            "eager_mb",
            "eager_whole",
        ):
            if k in r:
                print(f"  {k:<9} " + _fmt(r[k]))
        line = x(r.get("vs_offload"), "step / OffloadModel's (<= 1.1)")
        line += x(r.get("speedup_vs_ramtorch"), "faster than RamTorch")
        line += x(r.get("throughput_vs_one_gpu"), "throughput vs 1 GPU (>= 1.8)")
        if "prediction_error" in r:
            line += (
                f"  pipeline {r['ramstream']['pipeline_s']:.3f} s + optimizer {r['ramstream']['optimizer_s']:.3f} s;"
                f"  simulator {r['predicted_s']:.3f} s predicted ({r['prediction_error']:+.1%}; target within 15 %: "
                f"{'met' if abs(r['prediction_error']) <= 0.15 else 'NOT met'}; "
                f"a device per stage: {r['own_devices_error']:+.1%})"
            )
        if line:
            print(" " + line)
        parts = [
            (k, r[k])
            for k in ("ramstream", "offload", "eager_mb", "eager_whole")
            if k in r and "error" not in r[k]
        ]
        if r["row"] == "P2" and len(parts) > 2:  # without the optimizers (the eager ones on the GPU)
            print("   forward+backward s: " + ", ".join(f"{k} {m['pipeline_s']:.3f}" for k, m in parts))


def main(argv=None) -> int:
    args = _parser().parse_args(argv)
    if args.tiny:
        args.model, args.batch, args.seq, args.device = "tiny", 8, 64, "cpu"
        args.microbatches, args.steps, args.warmup = 4, 2, 1
        args.p4_stages = 2  # its 4 chunks: interleaved needs 2 per stage
    if args.child:
        args.impl = args.child
        print("RESULT " + json.dumps(child(args)), flush=True)
        return 0
    rows = run(args)
    report(rows, args)
    if args.out:
        tmp = args.out + ".tmp"
        with open(tmp, "w") as f:
            json.dump({"config": vars(args), "rows": rows}, f, indent=1)
        os.replace(tmp, args.out)
    ok = [m for r in rows for k, m in r.items() if isinstance(m, dict) and "error" not in m]
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
