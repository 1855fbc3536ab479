"""Activation paging on the 1.8B GPT under a VRAM cap: the largest batch (x seq) that stock torch,
ramstream without activation paging and ramstream with it can train, tokens/s, peak VRAM, and the
slowdown of paging against no paging at the batches where both fit.

Every configuration (variant, batch, paging mode) runs in a fresh process of its own and sends back
one JSON line, so none inherits anything from the ones before: not the model or the optimizer's
state, not an offloader's pinned pool, not the CUDA caching allocator's cache or fragmentation, not
references an out-of-memory traceback holds, not the per-process memory fraction (the cap). A
configuration that runs out of memory reports error "oom" and the next one still runs.
  stock       torch.optim.AdamW(fused=True), everything on the GPU; the walk up the batch list
              stops at the first batch that fails
  ramstream   wrap(); at each batch: unpaged (block bytes measured), all blocks paged, and the
              planner's choice (choose_paged_blocks with the measured unpaged step, copy bandwidth
              and the overlap seen with all blocks paged; max slowdown --max-slowdown), computed
              here from the first two and run in a third process; the walk stops at the first
              batch at which even all blocks paged fails

    python bench/train/bench_activations.py --model 1.8b --seq 1024 --batches 1,2,4,8,12,16
    python bench/train/bench_activations.py --model tiny --device cpu --batches 1,2   # smoke run

Prints one JSON line per configuration and a table; --out writes the JSON list.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))


def _sync(dev):
    import torch

    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def _measure_bandwidth(dev) -> tuple[float, float]:
    """(d2h, h2d) GB/s of a 256 MiB copy between a pinned arena buffer and the device."""
    import torch

    import ramstream

    if dev.type != "cuda":
        return 10.0, 10.0
    n = 256 << 20
    host = ramstream.pinned_empty(n, torch.uint8)
    gpu = torch.empty(n, dtype=torch.uint8, device=dev)
    out = []
    for src, dst in ((gpu, host), (host, gpu)):
        dst.copy_(src, non_blocking=True)
        _sync(dev)
        t0 = time.perf_counter()
        for _ in range(3):
            dst.copy_(src, non_blocking=True)
        _sync(dev)
        out.append(3 * n / (time.perf_counter() - t0) / 1e9)
    return out[0], out[1]


# ---- one configuration, in its own process -------------------------------------------------------
def run_config(args, cfg: dict) -> dict:
    """Builds the model (and wrap() and an offloader for ramstream), trains warmup + steps at
    cfg["batch"] with cfg["paged"] blocks paged ("all" or a list), returns the measurements."""
    import torch

    base = {
        "variant": cfg["variant"],
        "mode": cfg["mode"],
        "batch": cfg["batch"],
        "model": args.model,
        "seq": args.seq,
        "cap_gib": args.cap_gib,
        "loss_fn": args.loss,
        "pid": os.getpid(),
    }
    try:
        return dict(base, **_train(args, cfg, base))
    except torch.OutOfMemoryError as e:
        return dict(base, ok=False, error="oom", detail=str(e).split("\n")[0][:200])
    except MemoryError as e:  # host RAM or the page-lock budget
        return dict(base, ok=False, error="host oom", detail=str(e).split("\n")[0][:200])


def _train(args, cfg: dict, base: dict) -> dict:
    import torch

    sys.path.insert(0, HERE)
    from gpt import CONFIGS, GPT
    from vram_cap import cap_vram

    dev = cap_vram(args.device, args.cap_gib)
    torch.manual_seed(0)
    mcfg = dict(CONFIGS[args.model], ctx=max(1024, args.seq))
    model = GPT(**mcfg).to(dev)
    base["params"] = sum(p.numel() for p in model.parameters())
    off = None
    if cfg["variant"] == "stock":
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.1, fused=dev.type == "cuda")
    else:
        import ramstream
        from ramstream.activations import ActivationOffloader, find_blocks

        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.1)
        t0 = time.perf_counter()
        model, opt = ramstream.wrap(model, opt)
        base["wrap_s"] = time.perf_counter() - t0
        off = ActivationOffloader(
            find_blocks(model),
            dev,
            prefetch_depth=args.prefetch_depth,
            min_offload_bytes=args.min_offload_bytes,
        ).attach()
        d2h, h2d = _measure_bandwidth(dev)
        base.update(d2h_gbps=d2h, h2d_gbps=h2d)
        paged = cfg.get("paged") or []
        off.set_paged(range(len(off.blocks)) if paged == "all" else paged)
        off.set_measuring(cfg["mode"] == "unpaged")
    inject = f"{cfg['mode']}@{cfg['batch']}" in (args.inject_oom or "").split(",")

    def loss_fn(x, y):
        if args.loss == "chunked":
            import ramstream

            return ramstream.chunked_cross_entropy(model.hidden(x), model.head.weight, y)
        return model(x, y)

    batch = cfg["batch"]
    x = torch.randint(0, mcfg["vocab"], (batch, args.seq), device=dev)
    y = torch.randint(0, mcfg["vocab"], (batch, args.seq), device=dev)
    if dev.type == "cuda":
        torch.cuda.reset_peak_memory_stats(dev)
    times = []
    for i in range(args.warmup + args.steps):
        _sync(dev)
        t0 = time.perf_counter()
        if inject:  # test-only: --inject-oom MODE@BATCH
            raise torch.OutOfMemoryError("injected by --inject-oom")
        with torch.autocast(dev.type, dtype=torch.bfloat16):
            loss = loss_fn(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        loss_v = loss.item()
        del loss
        _sync(dev)
        if i >= args.warmup:
            times.append(time.perf_counter() - t0)
    times.sort()
    s = times[len(times) // 2]
    out = {
        "ok": True,
        "s_per_step": s,
        "tokens_per_s": batch * args.seq / s,
        "loss": loss_v,
        "peak_vram_gib": (torch.cuda.max_memory_allocated(dev) / 2**30 if dev.type == "cuda" else None),
    }
    if off is not None:
        st = off.stats()
        out.update(
            h2d_stall_s_per_step=st["h2d_stall_s"] / (args.warmup + args.steps),
            paged_blocks=len(st["paged_blocks"]),
            paged_gib=st["bytes_paged_last_pass"] / 2**30,
            host_act_gib=st["host_bytes_held"] / 2**30,
            block_bytes=st["block_bytes"],
        )
    return out


# ---- the walk, in the parent process (which never touches the device) ---------------------------
_PASS = (
    "model",
    "seq",
    "cap_gib",
    "steps",
    "warmup",
    "device",
    "loss",
    "prefetch_depth",
    "min_offload_bytes",
    "inject_oom",
)


def _spawn(args, cfg: dict) -> dict:
    """Runs one configuration in a fresh process; its result, or why there is none."""
    cmd = [sys.executable, os.path.abspath(__file__), "--config", json.dumps(cfg)]
    for k in _PASS:
        v = getattr(args, k)
        if v is not None:
            cmd += ["--" + k.replace("_", "-"), str(v)]
    base = {
        "variant": cfg["variant"],
        "mode": cfg["mode"],
        "batch": cfg["batch"],
        "model": args.model,
        "seq": args.seq,
        "ok": False,
    }
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout, check=False)
    except subprocess.TimeoutExpired as e:
        err = e.stderr.decode(errors="replace") if isinstance(e.stderr, bytes) else (e.stderr or "")
        return dict(base, error="timeout", detail=f"over {args.timeout} s: {err[-300:]}")
    got = [json.loads(x[7:]) for x in p.stdout.splitlines() if x.startswith("RESULT ")]
    if got:
        return got[-1]
    detail = (p.stderr or p.stdout)[-400:].replace("\n", " | ")
    oom = "OutOfMemoryError" in p.stderr or "out of memory" in p.stderr
    return dict(base, error="oom" if oom else f"crashed (rc {p.returncode})", detail=detail)


def _planner(args, unpaged: dict, all_paged: dict) -> tuple[list[int], dict]:
    from ramstream.planner import choose_paged_blocks, copy_seconds, estimate_overlap

    bb = unpaged["block_bytes"]
    d2h, h2d = unpaged["d2h_gbps"], unpaged["h2d_gbps"]
    copy_all = sum(copy_seconds(b, d2h, h2d) for b in bb)
    overlap = estimate_overlap(unpaged["s_per_step"], all_paged["s_per_step"], copy_all)
    idx, info = choose_paged_blocks(
        bb,
        unpaged_step_s=unpaged["s_per_step"],
        d2h_gbps=d2h,
        h2d_gbps=h2d,
        compute_overlap=overlap,
        max_slowdown=args.max_slowdown,
    )
    return idx, dict(info, overlap=overlap)


def walk(args, emit) -> None:
    for variant in args.variants.split(","):
        for batch in args.batch_list:
            cfg = {"variant": variant, "batch": batch}
            if variant == "stock":
                if not emit(_spawn(args, dict(cfg, mode="stock")))["ok"]:
                    break
                continue
            unpaged = emit(_spawn(args, dict(cfg, mode="unpaged", paged=[])))
            all_paged = emit(_spawn(args, dict(cfg, mode="all_paged", paged="all")))
            if not all_paged["ok"]:
                break
            if not unpaged["ok"]:
                continue
            idx, info = _planner(args, unpaged, all_paged)
            planned = _spawn(args, dict(cfg, mode="planner", paged=idx)) if idx else dict(unpaged)
            planned.update(
                mode="planner",
                overlap=info["overlap"],
                expected_slowdown=info["expected_slowdown"],
                reason=info["reason"],
            )
            if planned.get("ok"):
                planned["slowdown"] = planned["s_per_step"] / unpaged["s_per_step"] - 1
                planned["slowdown_all_paged"] = all_paged["s_per_step"] / unpaged["s_per_step"] - 1
            emit(planned)


def _table(results: list[dict]) -> str:
    lines = [
        f"{'variant':10s} {'mode':10s} {'batch':>5s} {'tok/s':>9s} {'s/step':>7s} "
        f"{'peak GiB':>8s} {'paged':>5s} {'host GiB':>8s} {'slowdown':>8s}"
    ]
    for r in results:
        if not r.get("ok"):
            why = r.get("error", "") + (f": {r['detail']}" if r.get("detail") else "")
            lines.append(
                f"{r['variant']:10s} {r.get('mode', '-'):10s} {r.get('batch', 0):5d} {'-':>9s}  {why[:70]}"
            )
            continue
        pv = r.get("peak_vram_gib")
        sd = r.get("slowdown")
        lines.append(
            f"{r['variant']:10s} {r['mode']:10s} {r['batch']:5d} {r['tokens_per_s']:9.0f} "
            f"{r['s_per_step']:7.3f} {'-' if pv is None else f'{pv:.2f}':>8s} "
            f"{r.get('paged_blocks', 0):5d} {r.get('host_act_gib', 0):8.2f} "
            f"{'' if sd is None else f'{sd:+.1%}':>8s}"
        )
    best = {}
    for r in results:
        if r.get("ok"):
            key = (r["variant"], r["mode"] if r["variant"] == "stock" or r["mode"] == "unpaged" else "paged")
            best[key] = max(best.get(key, 0), r["batch"])
    lines.append(
        "largest batch: " + ", ".join(f"{v}/{m}={b}" for (v, m), b in sorted(best.items()))
        if best
        else "largest batch: none fits"
    )
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--model", default="1.8b")
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--batches", default="1,2,4,8,12,16")
    ap.add_argument("--cap-gib", type=float, default=24.0)
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--variants", default="stock,ramstream")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--loss", choices=("dense", "chunked"), default="dense")
    ap.add_argument("--prefetch-depth", type=int, default=1)
    ap.add_argument("--min-offload-bytes", type=int, default=1 << 20)
    ap.add_argument("--max-slowdown", type=float, default=0.15)
    ap.add_argument(
        "--timeout",
        type=int,
        default=280,
        help="seconds per configuration (each runs in a process of its own)",
    )
    ap.add_argument("--config", help=argparse.SUPPRESS)  # set by the parent for a child
    ap.add_argument("--inject-oom", help=argparse.SUPPRESS)  # tests: MODE@BATCH[,...] raise OOM
    ap.add_argument("--out")
    args = ap.parse_args()
    if args.config:
        print("RESULT " + json.dumps(run_config(args, json.loads(args.config))), flush=True)
        return 0
    args.batch_list = [int(b) for b in args.batches.split(",") if b]
    for v in args.variants.split(","):
        if v not in ("stock", "ramstream"):
            ap.error(f"--variants: unknown variant {v!r}; accepted: stock, ramstream")
    results: list[dict] = []

    def emit(r: dict) -> dict:
        results.append(r)
        print(json.dumps({k: r[k] for k in r if k != "block_bytes"}), flush=True)
        return r

    walk(args, emit)
    print()
    print(_table(results))
    if args.out:
        tmp = f"{args.out}.tmp{os.getpid()}"
        with open(tmp, "w") as f:
            json.dump(results, f, indent=1)
        os.replace(tmp, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
