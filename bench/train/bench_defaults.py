"""Issue 24's matrix: do wrap()'s defaults train on 8-24 GiB GPUs, and how close to hand-picked options?

Rows x VRAM caps (GiB), each (row, cap, variant) in a process of its own (the cap is per process):
  R1  1.8B GPT full FT, fp32 weights, bf16 autocast, 8x512, dense loss
  R2  6.85B GPT full FT, bf16 weights, 8x512, dense loss
  R3  LoRA r16 on a Qwen2.5-7B shape (bf16 base, peft), 4x512, the HF model's own loss
  R4  LoRA r16 on a Qwen2.5-14B shape, 4x512, the HF model's own loss
  R5  6.85B GPT bf16 full FT, 16x2048, ramstream.chunked_cross_entropy
  R6  6.85B GPT fp32 weights, bf16 autocast, 8x512, dense, no cap: defaults vs stock AdamW(fused=True)
Variants: defaults = wrap(model, AdamW(lr=1e-5), device=...) and no other option; hand = HAND[row];
hand32 = HAND[row] with moment_dtype="float32" (the defaults' precision where RAM holds it); stock = plain torch, only where it fits (STOCK_CAPS). Cells run most informative first (FIRST);
--deadline stops launching cells (and cuts the running one) so one device call returns partial
results. One JSON line per run as it ends (also appended to --out), then a markdown table.

    python bench/train/bench_defaults.py --rows R1,R3 --caps 8,24 --steps 12 --deadline 500 --out d.jsonl
    python bench/train/bench_defaults.py --tiny --device cpu --rows R1,R6   # smoke run, seconds
    python bench/train/bench_defaults.py --summarize d.jsonl                 # the table again
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from defaults_report import compact_plan, jsonable, table  # noqa: E402
from stream_models import GPT_MODELS, TINY, build_qwen, fast_init_  # noqa: E402

ROWS = {
    "R1": dict(model="gpt1.8b", dtype="fp32", autocast=True, batch=8, seq=512, loss="dense"),
    "R2": dict(model="gpt6.85b", dtype="bf16", autocast=True, batch=8, seq=512, loss="dense"),
    "R3": dict(model="qwen7b", dtype="bf16", autocast=True, batch=4, seq=512, loss="hf"),
    "R4": dict(model="qwen14b", dtype="bf16", autocast=True, batch=4, seq=512, loss="hf"),
    "R5": dict(model="gpt6.85b", dtype="bf16", autocast=True, batch=16, seq=2048, loss="chunked"),
    # fp32 weights under bf16 autocast, as the stock 0.381 s/step (pure fp32 matmuls: ~3.3 s)
    "R6": dict(model="gpt6.85b", dtype="fp32", autocast=True, batch=8, seq=512, loss="dense"),
}
FULL_FT = {"R1", "R2", "R5", "R6"}
_BEST = {"param_offload": True, "activation_checkpointing": True, "activation_offload": True}
# the best hand-picked wrap() options known, per row (None: no hand variant)
HAND = {
    "R1": dict(_BEST),
    "R2": dict(_BEST),
    "R3": dict(_BEST),
    "R4": dict(_BEST),
    "R5": dict(_BEST),
    "R6": None,
}
# (row -> caps) where plain torch fits (stock LoRA rows use HF gradient checkpointing)
STOCK_CAPS = {"R3": (24,), "R6": (0,)}
UNCAPPED = {"R6"}  # rows run once, without a cap, whatever --caps says
FIRST = [("R1", 8), ("R3", 8), ("R3", 12), ("R5", 24), ("R1", 24), ("R4", 24), ("R6", 0)]
LR = 1e-5


def order(rows: list[str], caps: list[float]) -> list[tuple[str, float]]:
    """The (row, cap) cells: FIRST's that are selected, then the rest in row, then cap order."""
    cells = [(r, 0) if r in UNCAPPED else (r, c) for r in rows for c in caps]
    cells = list(dict.fromkeys(cells))
    first = sorted((c for c in cells if c in FIRST), key=FIRST.index)
    return first + [c for c in cells if c not in first]


def _options(row: str, variant: str) -> dict:
    """wrap()'s options of a variant: hand = HAND[row]; hand32 = the same with fp32 moments (the
    precision the defaults keep when RAM holds it: the like-for-like reference); else none."""
    if variant == "hand":
        return dict(HAND[row])
    if variant == "hand32":
        return dict(HAND[row], moment_dtype="float32")
    return {}


def variants_of(row: str, cap: float, wanted: list[str]) -> list[str]:
    ok = {
        "defaults": True,
        "sized": True,
        "hand": HAND.get(row) is not None,
        "hand32": HAND.get(row) is not None,
        "stock": cap in STOCK_CAPS.get(row, ()),
    }
    return [v for v in wanted if ok.get(v)]


# ---- one run, in its own process ---------------------------------------------------------------
def run_one(args, row: str, cap: float, variant: str) -> dict:
    import torch

    spec = ROWS[row]
    dev = torch.device(args.device)
    cuda = dev.type == "cuda"
    out = dict(row=row, cap_gib=cap, variant=variant, model=spec["model"], dtype=spec["dtype"],
               batch=spec["batch"], seq=spec["seq"], loss=spec["loss"], device=dev.type, pid=os.getpid(),
               options=_options(row, variant), phase="start", step=None)  # fmt: skip
    batch, seq = (min(spec["batch"], 2), min(spec["seq"], 64)) if args.tiny else (spec["batch"], spec["seq"])
    out.update(batch=batch, seq=seq, tiny=args.tiny)
    t_proc = time.perf_counter()
    try:
        if cuda:
            from vram_cap import cap_vram

            dev = cap_vram("cuda", cap)
        _train(args, spec, row, variant, dev, batch, seq, out)
        out["status"] = "ok"
    except torch.OutOfMemoryError as e:
        out.update(status="oom", error="torch.OutOfMemoryError: " + str(e).split("\n")[0][:400])
    except MemoryError as e:  # wrap() refusing: the weights or the host state do not fit
        out.update(status="refused", error=str(e)[:600])
    except ImportError as e:
        out.update(status="skip", error=f"ImportError: {e}"[:400])
    except Exception as e:  # noqa: BLE001 - reported; the driver goes on with the next run
        import traceback

        out.update(
            status="error",
            error=f"{type(e).__name__}: {str(e)[:300]}",
            traceback=traceback.format_exc()[-1500:],
        )
    out["process_s"] = time.perf_counter() - t_proc
    if cuda:
        out["peak_all_gib"] = max(
            out.get("peak_all_gib") or 0.0, torch.cuda.max_memory_allocated(dev) / 2**30
        )
    import resource

    out["host_rss_gib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    return out


def _phase(out: dict, phase: str, step: int | None = None) -> None:
    """Where the run is, in the result and on stdout (a run killed on timeout still says it)."""
    out.update(phase=phase, step=step)
    rss = _rss_gib()
    import resource

    peak = round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, 2)  # so far (KiB on Linux)
    print("PHASE " + json.dumps({"phase": phase, "step": step, "t": round(time.perf_counter(), 2),
                                 "rss_gib": rss, "peak_rss_gib": peak}), flush=True)  # fmt: skip


def _rss_gib() -> float | None:
    """This process's resident host memory now (Linux; None elsewhere): a run the kernel kills for
    memory (rc -9) still shows how its RSS grew step by step."""
    try:
        with open("/proc/self/statm") as f:
            return round(int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**30, 2)
    except (OSError, ValueError, IndexError):
        return None


def _new_events(model, seen: int) -> int:
    """Print the decision-log lines added since `seen` as EVENT lines (a killed run keeps them)."""
    import ramstream as rs

    try:
        ev = rs.memory_report(model).get("events", [])
    except Exception:  # noqa: BLE001 - a report failing never stops the run
        return seen
    for line in ev[seen:]:
        print("EVENT " + line[:400], flush=True)
    return len(ev)


def _build(spec, key: str, dev_cpu, hf_ckpt: bool):
    """(model, vocab, hf?) on the CPU, weights filled by fast_init_ (the GPT built in its dtype)."""
    import torch

    if key.startswith("gpt"):
        from gpt import CONFIGS, GPT

        cfg = dict(CONFIGS[GPT_MODELS[key]], ctx=max(1024, spec["seq"]))
        with torch.device("meta"):
            model = GPT(**cfg)
        if spec["dtype"] == "bf16":
            model = model.bfloat16()  # on meta: free; no fp32 copy of the 6.85B is ever made
        model = model.to_empty(device=dev_cpu)
        fast_init_(model)
        return model, cfg["vocab"], False
    model, vocab = build_qwen(key, dev_cpu, None, hf_ckpt)
    return model, vocab, True


def _train(args, spec, row, variant, dev, batch, seq, out) -> None:
    import torch

    cuda = dev.type == "cuda"
    sync = (lambda: torch.cuda.synchronize(dev)) if cuda else (lambda: None)
    key = TINY[spec["model"]] if args.tiny else spec["model"]
    torch.manual_seed(0)
    _phase(out, "build")
    t0 = time.perf_counter()
    model, vocab, hf = _build(spec, key, torch.device("cpu"), hf_ckpt=variant == "stock")
    out["build_s"] = time.perf_counter() - t0
    out["params"] = sum(p.numel() for p in model.parameters())
    out["trained_params"] = sum(p.numel() for p in model.parameters() if p.requires_grad)
    _phase(out, "wrap")
    rs = None
    t_wrap = time.perf_counter()
    if variant == "stock":
        model.to(dev)
        trained = [p for p in model.parameters() if p.requires_grad]
        opt = torch.optim.AdamW(trained, lr=LR, fused=cuda)
    else:
        import ramstream as rs

        opt = torch.optim.AdamW(model.parameters(), lr=LR)
        options = _options(row, variant)
        if variant == "sized":  # the defaults, told the step's size and loss (wrap's batch=, seq=, loss=)
            b, s = (
                (min(spec["batch"], 2), min(spec["seq"], 64)) if args.tiny else (spec["batch"], spec["seq"])
            )
            options = {"batch": b, "seq": s, "loss": "chunked" if spec["loss"] == "chunked" else "dense"}
        # device: the model is built in host RAM; without it wrap() would train on the CPU
        model, opt = rs.wrap(model, opt, device=str(dev), **options)
    sync()
    out["setup_s"] = time.perf_counter() - t_wrap

    def loss_fn(x):
        if hf:
            return model(input_ids=x, labels=x).loss
        if spec["loss"] == "chunked":
            from ramstream import chunked_cross_entropy

            return chunked_cross_entropy(model.hidden(x[:, :-1]), model.head.weight, x[:, 1:])
        return model(x[:, :-1], x[:, 1:])

    x = torch.randint(0, vocab, (batch, seq + (0 if hf else 1)), device=dev)
    try:
        _steps(args, spec, row, dev, batch, seq, out, loss_fn, opt, x, t_wrap, model if rs else None)
        if rs is not None:
            opt.synchronize()
    finally:  # also after an OOM or an error: what wrap() had decided
        if rs is not None:
            _record(rs, model, out)
    if rs is None:
        st = next((s for s in opt.state.values() if "exp_avg" in s), None)
        out["moment_dtype"] = str(st["exp_avg"].dtype).replace("torch.", "") if st else None


def _steps(args, spec, row, dev, batch, seq, out, loss_fn, opt, x, t_wrap, wrapped=None) -> None:
    import torch

    cuda = dev.type == "cuda"
    sync = (lambda: torch.cuda.synchronize(dev)) if cuda else (lambda: None)
    steps = args.steps or (8 if row in ("R5", "R6") else 12)
    warm = steps // 2  # the settled time: the median of the last steps - warm steps
    times, ends, losses = [], [], []  # in out as they come: an OOM at step i keeps steps 0..i-1
    out.update(step_times=times, losses=losses)
    seen = _new_events(wrapped, 0) if wrapped is not None else 0
    for i in range(steps):
        _phase(out, "step", i)
        if i == warm and cuda:
            out["peak_all_gib"] = torch.cuda.max_memory_allocated(dev) / 2**30
            torch.cuda.reset_peak_memory_stats(dev)
        sync()
        t0 = time.perf_counter()
        loss = _forward(loss_fn, x, dev, cuda and spec["autocast"], out)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
        del loss
        sync()
        t1 = time.perf_counter()
        times.append(t1 - t0)
        ends.append(t1 - t_wrap)
        if wrapped is not None:
            seen = _new_events(wrapped, seen)
    settled = statistics.median(times[warm:])
    first = next((i for i, t in enumerate(times) if abs(t - settled) <= 0.1 * settled), None)
    out.update(phase="done", steps=steps, s_per_step=settled, to_settled_s=None if first is None else ends[first],
               settled_step=None if first is None else first + 1,
               peak_gib=torch.cuda.max_memory_allocated(dev) / 2**30 if cuda else None)  # fmt: skip
    if row in FULL_FT:
        out["model_tflops"] = 6 * out["params"] * batch * seq / settled / 1e12


def _forward(loss_fn, x, dev, autocast: bool, out: dict):
    """The step's loss; a step the plan was revised for (PlanOutOfMemoryError, replanned=True) is
    run again as docs/planning.md tells a user to (counted in out["replanned"])."""
    import torch

    import ramstream

    for attempt in (0, 1):
        try:
            with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=autocast):
                return loss_fn(x)
        except ramstream.PlanOutOfMemoryError as e:
            if not e.replanned or attempt:
                raise
            out.setdefault("replanned", []).append(str(e).splitlines()[0][:300])
    raise AssertionError("unreachable")


def _record(rs, model, out: dict) -> None:
    """memory_report(model)'s moment dtype, optimizer placement, plan and log into out."""
    try:
        rep = rs.memory_report(model)
    except Exception as e:  # noqa: BLE001 - never hides the run's own outcome
        out["report_error"] = repr(e)[:300]
        return
    o = rep.get("optimizer", {})
    out["moment_dtype"] = o.get("moment_dtype")
    out["optimizer"] = {k: o.get(k) for k in ("mode", "resident", "gpu_updated_numel", "host_state_bytes")}
    out["streamed_blocks"] = jsonable(rep.get("params", {}).get("streamed_blocks"))
    out["plan"] = compact_plan(rep.get("plan"))
    out["wrap_phases_s"] = (rep.get("plan") or {}).get("setup_s")  # where wrap()'s time went
    # "measured": this run paid wrap()'s one-time hardware profile (setup_s includes it); "cache": not
    out["profile_source"] = ((rep.get("plan") or {}).get("profile") or {}).get("source")
    ev = list(rep.get("events", []))  # the decisions wrap() logged (first) and what came later
    out["events"] = [e[:300] for e in (ev if len(ev) <= 16 else ev[:10] + ["..."] + ev[-6:])]


# ---- the driver (never touches the device) -----------------------------------------------------
_child: list = []


def _on_term(signum, frame):  # the shell's timeout: stop the running child, print what we have
    for p in _child:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
    raise KeyboardInterrupt


def _last_phase(stdout: str) -> dict:
    got = [json.loads(x[6:]) for x in (stdout or "").splitlines() if x.startswith("PHASE ")]
    return {"phase": got[-1]["phase"], "step": got[-1]["step"]} if got else {}


def spawn(args, row: str, cap: float, variant: str, timeout: float) -> dict:
    cmd = [sys.executable, os.path.abspath(__file__), "--one", f"{row}:{cap}:{variant}", "--device", args.device,
           "--steps", str(args.steps or 0)] + (["--tiny"] if args.tiny else [])  # fmt: skip
    base = dict(row=row, cap_gib=cap, variant=variant)
    t0 = time.perf_counter()
    p = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True
    )
    _child[:] = [p]
    try:
        so, se = p.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)
        so, se = p.communicate()
        ph = _last_phase(so)
        return dict(base, **ph, status="timeout", error=f"over {timeout:.0f} s: {se[-300:]}",
                    wall_s=time.perf_counter() - t0)  # fmt: skip
    got = [json.loads(x[7:]) for x in so.splitlines() if x.startswith("RESULT ")]
    if got:
        r = got[-1]
    else:
        err = (se or so)[-4000:]
        oom = "OutOfMemoryError" in err or "out of memory" in err
        r = dict(base, **_last_phase(so), status="oom" if oom else "crash", error=f"rc {p.returncode}: {err}")
    r["wall_s"] = time.perf_counter() - t0
    return r


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--rows", default="R1,R3,R5,R4,R6")
    ap.add_argument("--caps", default="8,12,16,24", help="GiB; R6 runs uncapped whatever this says")
    ap.add_argument("--steps", type=int, default=0, help="steps per run (0: 12; 8 for R5 and R6)")
    ap.add_argument("--variants", default="defaults,hand,stock")
    ap.add_argument("--timeout", type=float, default=300, help="seconds per run")
    ap.add_argument("--deadline", type=float, default=0, help="seconds for the whole matrix (0: none)")
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    ap.add_argument("--tiny", action="store_true", help="tiny models of the same kinds (smoke run)")
    ap.add_argument("--out", help="JSON lines, written run by run (emptied first unless --append)")
    ap.add_argument("--append", action="store_true", help="add to --out instead of starting it anew")
    ap.add_argument("--summarize", metavar="JSONL", help="print the table of an earlier --out file")
    ap.add_argument("--one", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.summarize:
        with open(args.summarize) as f:
            print("\n".join(table([json.loads(x) for x in f if x.strip()])))
        return 0
    if args.one:
        row, cap, variant = args.one.split(":")
        res = run_one(args, row, float(cap), variant)
        print("RESULT " + json.dumps(res, default=str), flush=True)
        return 0
    rows = [r.strip() for r in args.rows.split(",") if r.strip()]
    caps = [float(c) for c in args.caps.split(",") if c.strip()]
    wanted = [v.strip() for v in args.variants.split(",") if v.strip()]
    bad = [r for r in rows if r not in ROWS] + [
        v for v in wanted if v not in ("defaults", "sized", "hand", "hand32", "stock")
    ]
    if bad:
        ap.error(
            f"unknown rows/variants {bad}; rows: {', '.join(ROWS)}; variants: defaults, sized, hand, hand32, stock"
        )
    signal.signal(signal.SIGTERM, _on_term)
    t_run, results = time.perf_counter(), []
    if args.out and not args.append:
        open(args.out, "w").close()
    try:
        for row, cap in order(rows, caps):
            for variant in variants_of(row, cap, wanted):
                timeout = args.timeout
                if args.deadline:
                    left = args.deadline - (time.perf_counter() - t_run)
                    if left < 20:
                        raise TimeoutError
                    timeout = min(timeout, left)
                r = spawn(args, row, cap, variant, timeout)
                results.append(r)
                print(json.dumps(r, default=str), flush=True)
                if args.out:
                    with open(args.out, "a") as f:
                        f.write(json.dumps(r, default=str) + "\n")
    except (TimeoutError, KeyboardInterrupt):
        for p in _child:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
        print(f"# stopped after {time.perf_counter() - t_run:.0f} s: --deadline or a signal", flush=True)
    print()
    print("\n".join(table(results)))
    print(f"total {time.perf_counter() - t_run:.0f} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
