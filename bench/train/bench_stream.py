"""Issue 10's table: weight streaming (param_offload) and the planner against stock torch, torchao's
CPUOffloadOptimizer and ramstream's other modes, each configuration in a process of its own.

Rows (--rows, in the order given; each row's baseline configuration is added when not selected):
  F    1.8B GPT full FT, 4 GiB cap, param_offload=True; PCIe use of the weight stream (vs B_stock)
  E    LoRA r16 on a Qwen2.5-14B shape, bf16 base, 24 GiB cap: stock, defaults, param_offload=True
  D8   LoRA r16 on a Qwen2.5-7B shape, 8 GiB cap: param_offload=True, without and with HF
       gradient checkpointing (vs D24_stock_ckpt)
  A    1.8B GPT full FT, 8x512, 24 GiB cap: stock fused AdamW, torchao CPUOffloadOptimizer
       (baseline), wrap() defaults, chunked loss + optimizer_mode/activation_offload "auto"
  C    6.85B GPT fp32, no cap: stock fused AdamW vs wrap() defaults (target: within 5%)
  G    6.85B GPT bf16 weights, 8x512, chunked loss, 24 GiB cap: defaults, bf16 moments
  B    1.8B GPT, no cap: stock fused AdamW vs wrap() defaults (target: within 2%)
  D24  LoRA r16, Qwen2.5-7B shape, 24 GiB cap: stock + HF checkpointing (baseline), defaults, + HF's

Each configuration reports s/step (median of --steps after --warmup), peak GiB
(torch.cuda.max_memory_allocated over the whole process, and over the training steps only), host
RSS, and for ramstream the per-step split from optimizer.stats() (host_update_s, wait_s,
throttle_s, bytes_h2d, bytes_d2h, and bytes_h2d_weights / stream_wait_s when present) and
memory_report(model)["params"] (loads, streamed_blocks when present) and ["plan"]. A configuration
that runs out of memory (or that wrap() refuses with MemoryError) reports OOM; one whose option
wrap() does not know (param_offload before it exists) reports N/A; a missing package (torchao,
peft, transformers) SKIP; the next one runs in any case. --deadline bounds the whole run: a
configuration that would start with too little time left is skipped.

    python bench/train/bench_stream.py --rows F,E,D8,A,C,B,D24 --deadline 450 --out stream.json
    python bench/train/bench_stream.py --tiny --device cpu          # every code path, seconds

Models are built without their initialisation (meta device or transformers' no_init_weights) and
filled cheaply (bench/train/stream_models.py:fast_init_): on the GPU with normal_, on the CPU by
tiling a small random pool (normal_ runs at ~0.5-1.5 GB/s per core on the CPU, a copy at ~25).
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
sys.path.insert(0, HERE)
from stream_models import TINY, build_gpt, build_qwen, h2d_gbps, load_rate, split_utilisation  # noqa: E402
from stream_report import planner_prediction, summarize, write_results  # noqa: E402

BEST = {"optimizer_mode": "auto", "activation_offload": "auto"}


def _c(name, row, model, kind, cap, batch, **kw) -> dict:
    """One configuration. kind: stock | torchao | ramstream; options: wrap()'s (ramstream);
    build: where the model is built ("gpu": on the device under the cap, "cpu": in host RAM for
    wrap() to place); baseline: the configuration its ratio is against; target: the largest
    accepted ratio (None: reported only); expect: "oom" when running out of memory is the
    expected outcome."""
    c = dict(
        name=name,
        row=row,
        model=model,
        kind=kind,
        cap_gib=cap,
        batch=batch,
        seq=512,
        loss="dense",
        dtype="fp32",  # the model's weights ("bf16": built in fp32, then cast)
        options={},
        ckpt=False,
        build="gpu",
        baseline=None, target=None, expect=None, timeout=150, warmup=None, bandwidth=False,
    )  # fmt: skip
    c.update(kw)
    return c


STREAM = {"param_offload": True}
# fmt: off
CONFIGS = [
    # F: weights streamed through a 4 GiB cap; the same model uncapped is B_stock
    _c("F_stream4", "F", "gpt1.8b", "ramstream", 4, 8, loss="chunked", build="cpu",
       options={**STREAM, "activation_checkpointing": True}, baseline="B_stock", bandwidth=True,
       timeout=180),
    # E: a 14B bf16 base (29.5 GB) under 24 GiB
    _c("E_stock", "E", "qwen14b", "stock", 24, 4, expect="oom", timeout=90),
    _c("E_defaults", "E", "qwen14b", "ramstream", 24, 4, build="cpu", timeout=200),
    _c("E_stream", "E", "qwen14b", "ramstream", 24, 4, options=STREAM, build="cpu", timeout=240),
    # D at 8 GiB: the 7B base streamed
    _c("D8_stream", "D8", "qwen7b", "ramstream", 8, 4, options=STREAM, build="cpu",
       baseline="D24_stock_ckpt", timeout=180),
    _c("D8_stream_w2", "D8", "qwen7b", "ramstream", 8, 4, options={**STREAM, "weight_window": 2},
       build="cpu", baseline="D24_stock_ckpt", timeout=180),
    _c("E_defaults_w2", "E", "qwen14b", "ramstream", 24, 4, options={"weight_window": 2}, build="cpu",
       timeout=200),
    _c("D8_stream_ckpt", "D8", "qwen7b", "ramstream", 8, 4, options=STREAM, ckpt=True,
       build="cpu", baseline="D24_stock_ckpt", timeout=180),
    # A: 1.8B full FT at 24 GiB; the target (no slower than torchao) is this script's assumption
    _c("A_stock", "A", "gpt1.8b", "stock", 24, 8, expect="oom", timeout=90),
    _c("A_torchao", "A", "gpt1.8b", "torchao", 24, 8, timeout=150),
    # (warmup 3: the optimizer state's VRAM share is decided after step 2)
    _c("A_defaults", "A", "gpt1.8b", "ramstream", 24, 8, baseline="A_torchao", target=1.0, warmup=3),
    _c("A_ckpt", "A", "gpt1.8b", "ramstream", 24, 8, options={"activation_checkpointing": True},
       baseline="A_torchao", target=1.0, warmup=3),
    _c("A_chunked_best", "A", "gpt1.8b", "ramstream", 24, 8, loss="chunked", options=BEST,
       baseline="A_torchao", target=1.0, warmup=3),
    _c("A_chunked_ckpt", "A", "gpt1.8b", "ramstream", 24, 8, loss="chunked",
       options={"activation_checkpointing": True}, baseline="A_torchao", target=1.0, warmup=3),
    # C: 6.85B fp32 uncapped (stock ~110 GiB); the resident switch comes after 2 steps: warmup 3
    _c("C_stock", "C", "gpt6.85b", "stock", 0, 8, warmup=3, timeout=120),
    _c("C_defaults", "C", "gpt6.85b", "ramstream", 0, 8, baseline="C_stock", target=1.05,
       warmup=3, timeout=300),
    # G: 6.85B with bf16 weights (fp32 masters on the host) under 24 GiB, chunked loss
    _c("G_defaults", "G", "gpt6.85b", "ramstream", 24, 8, loss="chunked", dtype="bf16", build="cpu",
       warmup=3, timeout=300),
    _c("G_bf16_moments", "G", "gpt6.85b", "ramstream", 24, 8, loss="chunked", dtype="bf16",
       build="cpu", options={"moment_dtype": "bfloat16"}, warmup=3, timeout=300),
    # B: 1.8B uncapped
    _c("B_stock", "B", "gpt1.8b", "stock", 0, 8, warmup=3, timeout=90),
    _c("B_defaults", "B", "gpt1.8b", "ramstream", 0, 8, baseline="B_stock", target=1.02, warmup=3),
    # D at 24 GiB: the 7B base resident
    _c("D24_stock_ckpt", "D24", "qwen7b", "stock", 24, 4, ckpt=True, timeout=120),
    _c("D24_defaults", "D24", "qwen7b", "ramstream", 24, 4, baseline="D24_stock_ckpt"),
    _c("D24_ckpt", "D24", "qwen7b", "ramstream", 24, 4, ckpt=True, baseline="D24_stock_ckpt"),
]
# fmt: on
BY_NAME = {c["name"]: c for c in CONFIGS}
ROWS = list(dict.fromkeys(c["row"] for c in CONFIGS))
DEFAULT_ROWS = "F,E,D8,A,C,B,D24"


# ---- one configuration, in its own process ----------------------------------------------------
def _sync(dev) -> None:
    import torch

    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def _numeric(d: dict) -> dict:
    return {k: v for k, v in d.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}


def _delta(before: dict, after: dict, steps: int) -> dict:
    a, b = _numeric(after), _numeric(before)
    return {k: (v - b.get(k, 0)) / steps for k, v in a.items()}


def _jsonable(x, depth: int = 0):
    if isinstance(x, dict):
        return {str(k): _jsonable(v, depth + 1) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        x = list(x)
        return [_jsonable(v, depth + 1) for v in (x[-8:] if len(x) > 64 else x)]
    if isinstance(x, (int, float, str, bool)) or x is None:
        return x
    return str(x)


def run_config(args, cfg: dict) -> dict:
    import torch

    out = {k: cfg[k] for k in ("name", "row", "kind", "cap_gib", "batch", "seq", "loss", "ckpt", "options")}
    out.update(model=cfg["model"], device=args.device, pid=os.getpid())
    t_start = time.perf_counter()
    try:
        _train(args, cfg, out)
    except torch.OutOfMemoryError as e:
        out.update(status="OOM", error="torch.OutOfMemoryError: " + str(e).split("\n")[0][:200])
    except MemoryError as e:  # wrap() refusing (weights do not fit), host RAM, page-lock budget
        out.update(status="OOM", error="MemoryError: " + str(e).split("\n")[0][:300])
    except _Unavailable as e:
        out.update(status=e.status, error=str(e))
    except Exception as e:  # reported, not raised: the driver goes on with the next configuration
        import traceback

        out.update(status="ERROR", error=f"{type(e).__name__}: {str(e)[:300]}")
        out["traceback"] = traceback.format_exc()[-1500:]
    out["process_s"] = time.perf_counter() - t_start
    out["host_rss_gib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    if args.device == "cuda":  # the whole process: building, wrap() and the steps
        peak = torch.cuda.max_memory_allocated() / 2**30
        out["peak_gib"] = max(peak, out.get("peak_setup_gib") or 0.0)
    return out


class _Unavailable(Exception):
    def __init__(self, status: str, why: str) -> None:
        super().__init__(why)
        self.status = status


def _check_options(options: dict) -> None:
    """N/A before any model is built when wrap() does not know an option (param_offload)."""
    from ramstream.options import WrapOptions

    unknown = sorted(set(options) - set(WrapOptions.names()))
    if unknown:
        raise _Unavailable("N/A", f"not available: wrap() has no option {', '.join(unknown)}")
    try:
        WrapOptions.parse(**options)
    except ValueError as e:
        raise _Unavailable("N/A", f"not available: {e}") from None


def _train(args, cfg: dict, res: dict) -> None:
    """Builds, wraps and trains one configuration; writes the measurements into res."""
    import torch

    dev = torch.device(args.device)
    cuda = dev.type == "cuda"
    if cuda:
        from vram_cap import cap_vram

        dev = cap_vram("cuda", cfg["cap_gib"])
    model_key = TINY[cfg["model"]] if args.tiny else cfg["model"]
    kind = cfg["kind"]
    options = dict(cfg["options"])
    if kind == "ramstream":
        import ramstream

        _check_options(dict(options, device=str(dev)))
    if kind == "torchao":
        try:
            from torchao.optim import CPUOffloadOptimizer
        except ImportError as e:
            raise _Unavailable("SKIP", f"torchao not importable ({e}); gpu_run.sh installs .whl/") from None
        if not cuda:
            raise _Unavailable("SKIP", "torchao's CPUOffloadOptimizer needs CUDA")
    if cfg["bandwidth"]:
        res["h2d_gbps"] = h2d_gbps(dev)
    # the plan before the run takes host RAM (after it, the run's own state made the planner
    # refuse the 6.85B fp32-moments row as not fitting in RAM: fourth session, call 4)
    planned = planner_prediction(cfg, model_key, dev, args.qwen_layers) if kind == "ramstream" else None
    torch.manual_seed(0)
    build_dev = torch.device("cpu") if cfg["build"] == "cpu" else dev
    t0 = time.perf_counter()
    if model_key.startswith("gpt"):
        model, vocab = build_gpt(model_key, cfg["seq"], build_dev)
        hf = False
    else:
        try:
            model, vocab = build_qwen(model_key, build_dev, args.qwen_layers, cfg["ckpt"])
        except ImportError as e:
            raise _Unavailable("SKIP", f"transformers/peft not importable: {e}") from None
        hf = True
    if cfg["dtype"] == "bf16":
        model = model.to(torch.bfloat16)
    _sync(dev)
    res["build_s"] = time.perf_counter() - t0
    res["build_device"] = str(build_dev)
    params = list(model.parameters())
    trained = [p for p in params if p.requires_grad]
    res["params"] = sum(p.numel() for p in params)
    res["trained_params"] = sum(p.numel() for p in trained)
    lr = 1e-4
    t0 = time.perf_counter()
    if kind == "stock":
        opt = torch.optim.AdamW(trained, lr=lr, weight_decay=0.1, fused=cuda)
    elif kind == "torchao":
        opt = CPUOffloadOptimizer(trained, torch.optim.AdamW, offload_gradients=True, lr=lr, weight_decay=0.1)
    else:
        opt = torch.optim.AdamW(trained, lr=lr, weight_decay=0.1)
        try:
            model, opt = ramstream.wrap(model, opt, device=str(dev), **options)
        except ValueError as e:  # an option or value this ramstream does not accept yet
            if "unknown option" in str(e) or "not accepted" in str(e):
                raise _Unavailable("N/A", f"not available: {e}") from None
            raise
    _sync(dev)
    res["setup_s"] = time.perf_counter() - t0
    if next(model.parameters()).device != dev and kind != "ramstream":
        model.to(dev)

    def loss_fn(x):
        if hf:
            return model(input_ids=x, labels=x).loss
        if cfg["loss"] == "chunked":
            from ramstream import chunked_cross_entropy

            return chunked_cross_entropy(model.hidden(x[:, :-1]), model.head.weight, x[:, 1:])
        return model(x[:, :-1], x[:, 1:])

    # seq + 1 tokens for the GPT (inputs and shifted targets); HF shifts the labels itself
    x = torch.randint(0, vocab, (cfg["batch"], cfg["seq"] + (0 if hf else 1)), device=dev)
    warmup = cfg["warmup"] if cfg["warmup"] is not None else args.warmup
    if kind == "ramstream" and cfg["cap_gib"]:
        # optimizer_mode="auto" settles after step 2 + MAX_REFINEMENTS x MEASURE_STEPS
        # (runtime/refiner.py: the VRAM share, then up to two measured re-splits that move buckets)
        from ramstream.planner.rules import MAX_REFINEMENTS, MEASURE_STEPS

        warmup = max(warmup, 2 + MAX_REFINEMENTS * MEASURE_STEPS + 1)
    steps = args.steps
    if cuda:  # peak_train_gib: the steps only; peak_gib: the whole process
        res["peak_setup_gib"] = torch.cuda.max_memory_allocated(dev) / 2**30
        torch.cuda.reset_peak_memory_stats(dev)
    times, st0, loads0 = [], {}, 0
    # allocator retries (a cudaFree of the cache and a device sync each) under the cap: per step
    retries = (lambda: torch.cuda.memory_stats(dev).get("num_alloc_retries", 0)) if cuda else (lambda: 0)
    retries0 = retries()
    rs = kind == "ramstream"
    for i in range(warmup + steps):
        _sync(dev)
        t0 = time.perf_counter()
        with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=cuda):
            loss = loss_fn(x)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        loss_v = loss.item()
        del loss
        _sync(dev)
        if i >= warmup:
            times.append(time.perf_counter() - t0)
        elif i == warmup - 1 and rs:
            opt.synchronize()
            st0 = opt.stats()
            loads0 = ramstream.memory_report(model)["params"].get("loads", 0) or 0
        if i == warmup - 1:
            retries0 = retries()
    times.sort()
    res.update(
        status="OK",
        s_per_step=times[len(times) // 2],
        min_s=times[0],
        max_s=times[-1],
        steps=steps,
        warmup=warmup,
        loss_last=loss_v,
        peak_train_gib=torch.cuda.max_memory_allocated(dev) / 2**30 if cuda else None,
        alloc_retries_per_step=(retries() - retries0) / steps if cuda else None,
    )
    if rs:
        opt.synchronize()
        st = opt.stats()
        rep = ramstream.memory_report(model)
        p = rep.get("params", {})
        d = _delta(st0, st, steps)
        res["per_step"] = {
            k: d.get(k)
            for k in (
                "host_update_s",
                "host_land_s",
                "wait_s",
                "throttle_s",
                "bytes_h2d",
                "bytes_d2h",
                "bytes_h2d_weights",
                "stream_wait_s",
            )
            if k in d
        }
        res["per_step_all"] = d
        res["stats"] = _jsonable(st)
        res["mode"] = st.get("mode")
        res["loads_total"] = p.get("loads")
        if isinstance(p.get("loads"), (int, float)):
            res["loads_per_step"] = (p["loads"] - loads0) / steps
        res["streamed_blocks"] = _jsonable(p.get("streamed_blocks"))
        res["report_params"] = _jsonable({k: v for k, v in p.items() if k != "bucket_numel"})
        res["plan"] = _jsonable(rep.get("plan"))
        res["events_tail"] = list(rep.get("events", []))[-8:]
        res["planner"] = planned
        gbps = res.get("h2d_gbps")
        wb = d.get("bytes_h2d_weights")
        if gbps:
            s = res["s_per_step"]
            res["h2d_total_gbps_achieved"] = d.get("bytes_h2d", 0) / s / 1e9
            res["h2d_total_util"] = res["h2d_total_gbps_achieved"] / gbps
            if wb is not None:
                res["h2d_weights_gbps_achieved"] = wb / s / 1e9
                res["h2d_weights_util"] = res["h2d_weights_gbps_achieved"] / gbps
    if rs and cfg["bandwidth"]:  # one step more, traced (after the stats): the loads' own rate
        import tempfile

        path = os.path.join(tempfile.mkdtemp(prefix="rs-trace-"), "step.json")
        with ramstream.trace(path, device=dev):
            with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=cuda):
                loss = loss_fn(x)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            del loss
            _sync(dev)
        res["weight_loads"] = wl = load_rate(path)
        if res.get("h2d_gbps") and wl["gbps"]:
            wl["util"] = wl["gbps"] / res["h2d_gbps"]
        if cuda and wl.get("beside_d2h"):  # loads beside gradient copies: against the duplex rate
            split_utilisation(wl, res.get("h2d_gbps"), ramstream.profile_hardware(dev).duplex_gbps)


# ---- the driver (never touches the device) -----------------------------------------------------
def _spawn(args, cfg: dict, timeout: float) -> dict:
    cmd = [sys.executable, os.path.abspath(__file__), "--config", json.dumps(cfg)]
    cmd += ["--device", args.device, "--steps", str(args.steps), "--warmup", str(args.warmup)]
    if args.tiny:
        cmd.append("--tiny")
    if args.qwen_layers:
        cmd += ["--qwen-layers", str(args.qwen_layers)]
    base = {k: cfg[k] for k in ("name", "row", "kind", "cap_gib", "batch", "options")}
    t0 = time.perf_counter()
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, check=False)
    except subprocess.TimeoutExpired as e:
        err = e.stderr.decode(errors="replace") if isinstance(e.stderr, bytes) else (e.stderr or "")
        return dict(base, status="TIMEOUT", error=f"over {timeout:.0f} s: {err[-300:]}", wall_s=timeout)
    wall = time.perf_counter() - t0
    got = [json.loads(x[7:]) for x in p.stdout.splitlines() if x.startswith("RESULT ")]
    if got:
        r = got[-1]
        if r.get("status") not in ("OK", "OOM", "N/A", "SKIP"):
            r.setdefault("status", "ERROR")
    else:
        err = (p.stderr or p.stdout)[-600:]
        oom = "OutOfMemoryError" in err or "out of memory" in err
        r = dict(base, status="OOM" if oom else "CRASH", error=f"rc {p.returncode}: {err}")
    r["wall_s"] = wall
    return r


def plan_configs(rows: list[str]) -> list[dict]:
    """The selected rows' configurations in row order, then any baseline they name that is not
    among them."""
    chosen = [c for r in rows for c in CONFIGS if c["row"] == r]
    names = {c["name"] for c in chosen}
    for c in list(chosen):
        b = c["baseline"]
        if b and b not in names:
            chosen.append(BY_NAME[b])
            names.add(b)
    return chosen


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--rows", default=os.environ.get("STREAM_ROWS", DEFAULT_ROWS))
    ap.add_argument("--only", help="comma-separated configuration names (instead of --rows)")
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--warmup", type=int, default=2, help="rows B and C use 3 (the resident switch)")
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    ap.add_argument("--tiny", action="store_true", help="tiny shapes of every model (smoke run)")
    ap.add_argument("--qwen-layers", type=int, default=None, help="override the Qwen layer counts")
    ap.add_argument("--deadline", type=float, default=0, help="seconds for the whole run (0: none)")
    ap.add_argument("--timeout-scale", type=float, default=1.0, help="multiplies each timeout")
    ap.add_argument("--summarize", metavar="JSON", help="print the table of an earlier --out file")
    ap.add_argument("--config", help=argparse.SUPPRESS)
    ap.add_argument("--out")
    args = ap.parse_args()
    if args.summarize:
        with open(args.summarize) as f:
            print("\n".join(summarize(json.load(f), BY_NAME)))
        return 0
    if args.config:
        print("RESULT " + json.dumps(run_config(args, json.loads(args.config)), default=str), flush=True)
        return 0
    if args.only:
        bad = [n for n in args.only.split(",") if n not in BY_NAME]
        if bad:
            ap.error(f"--only: unknown {bad}; known: {', '.join(BY_NAME)}")
        todo = [BY_NAME[n] for n in args.only.split(",")]
    else:
        rows = [r.strip() for r in args.rows.split(",") if r.strip()]
        bad = [r for r in rows if r not in ROWS]
        if bad:
            ap.error(f"--rows: unknown {bad}; known: {', '.join(ROWS)}")
        todo = plan_configs(rows)
    t_run = time.perf_counter()
    results: list[dict] = []
    for cfg in todo:
        timeout = cfg["timeout"] * args.timeout_scale
        if args.deadline:
            left = args.deadline - (time.perf_counter() - t_run)
            if left < 30:
                r = {k: cfg[k] for k in ("name", "row", "kind", "cap_gib", "batch", "options")}
                r.update(status="SKIP", error=f"out of time ({left:.0f} s of --deadline left)")
                results.append(r)
                print(json.dumps(r), flush=True)
                continue
            timeout = min(timeout, left - 5)
        r = _spawn(args, cfg, timeout)
        results.append(r)
        brief = {k: r.get(k) for k in ("name", "status", "s_per_step", "peak_gib", "wall_s", "error")}
        print(json.dumps(brief, default=str), flush=True)
        if args.out:
            write_results(args.out, results)
    print()
    lines = summarize(results, BY_NAME)
    print("\n".join(lines))
    print(f"total {time.perf_counter() - t_run:.0f} s")
    if args.out:
        write_results(args.out, results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
