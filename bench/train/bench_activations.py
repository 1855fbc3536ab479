"""Activation paging on the 1.8B GPT under a VRAM cap: the largest batch (x seq) that stock torch,
ramstream without activation paging and ramstream with it can train, tokens/s, peak VRAM, and the
slowdown of paging against no paging at the batches where both fit.

Each variant runs in its own process (the cap is per process) and walks the batch list upwards
until a step runs out of memory:
  stock       torch.optim.AdamW(fused=True), everything on the GPU
  ramstream   wrap(); at each batch: unpaged (if it fits; block bytes measured), all blocks paged,
              and the planner's choice (choose_paged_blocks with the measured unpaged step, copy
              bandwidth and the overlap seen with all blocks paged; max slowdown --max-slowdown)

    python bench/train/bench_activations.py --model 1.8b --seq 1024 --batches 1,2,4,8,12,16
    python bench/train/bench_activations.py --model tiny --device cpu --batches 1,2   # smoke run

Prints one JSON line per measurement and a table; --out writes the JSON list.
"""
from __future__ import annotations

import argparse
import gc
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


def run_variant(args) -> list[dict]:
    import torch

    sys.path.insert(0, HERE)
    from gpt import CONFIGS, GPT

    dev = torch.device(args.device)
    if dev.type == "cuda" and dev.index is None:
        dev = torch.device("cuda", torch.cuda.current_device())
    if dev.type == "cuda" and args.cap_gib:
        total = torch.cuda.get_device_properties(dev).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, args.cap_gib * 2**30 / total), dev)
    torch.manual_seed(0)
    cfg = dict(CONFIGS[args.model], ctx=max(1024, args.seq))
    results: list[dict] = []
    base = {"variant": args.variant, "model": args.model, "seq": args.seq, "cap_gib": args.cap_gib,
            "loss_fn": args.loss}
    try:
        model = GPT(**cfg).to(dev)
    except torch.OutOfMemoryError as e:
        return [dict(base, ok=False, batch=0, mode="-", error="OOM creating the model: "
                     + str(e).split("\n")[0][:160])]
    params = sum(p.numel() for p in model.parameters())
    off = None
    if args.variant == "stock":
        try:
            opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.1,
                                    fused=dev.type == "cuda")
        except torch.OutOfMemoryError as e:
            return [dict(base, ok=False, batch=0, mode="-", error=str(e)[:160])]
    else:
        import ramstream
        from ramstream.activations import ActivationOffloader, find_blocks

        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.1)
        t0 = time.perf_counter()
        model, opt = ramstream.wrap(model, opt)
        base["wrap_s"] = time.perf_counter() - t0
        off = ActivationOffloader(find_blocks(model), dev, prefetch_depth=args.prefetch_depth,
                                  min_offload_bytes=args.min_offload_bytes).attach()
        d2h, h2d = _measure_bandwidth(dev)
        base.update(d2h_gbps=d2h, h2d_gbps=h2d)

    def loss_fn(x, y):
        if args.loss == "chunked":
            import ramstream

            return ramstream.chunked_cross_entropy(model.hidden(x), model.head.weight, y)
        return model(x, y)

    def steps(batch: int, paged: list[int] | None) -> dict:
        """warmup + timed steps at `batch`; {} on OOM (state cleaned up)."""
        if off is not None:
            off.set_paged(paged or [])
        x = torch.randint(0, cfg["vocab"], (batch, args.seq), device=dev)
        y = torch.randint(0, cfg["vocab"], (batch, args.seq), device=dev)
        times, oom = [], None
        stall0 = off.stats()["h2d_stall_s"] if off is not None else 0.0
        if dev.type == "cuda":
            torch.cuda.reset_peak_memory_stats(dev)
        try:
            for i in range(args.warmup + args.steps):
                _sync(dev)
                t0 = time.perf_counter()
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
        except torch.OutOfMemoryError as e:
            oom = "OOM: " + str(e).split("\n")[0][:160]
        if oom is not None:
            loss = None  # noqa: F841 - drop the graph before freeing the cache
            opt.zero_grad(set_to_none=True)
            gc.collect()
            if dev.type == "cuda":
                torch.cuda.empty_cache()
            return {"ok": False, "error": oom}
        times.sort()
        s = times[len(times) // 2]
        out = {"ok": True, "s_per_step": s, "tokens_per_s": batch * args.seq / s, "loss": loss_v,
               "peak_vram_gib": (torch.cuda.max_memory_allocated(dev) / 2**30
                                 if dev.type == "cuda" else None)}
        if off is not None:
            st = off.stats()
            out.update(h2d_stall_s_per_step=(st["h2d_stall_s"] - stall0)
                       / (args.warmup + args.steps),
                       paged_blocks=len(st["paged_blocks"]),
                       paged_gib=st["bytes_paged_last_pass"] / 2**30,
                       host_act_gib=st["host_bytes_held"] / 2**30,
                       block_bytes=st["block_bytes"])
        return out

    def emit(r):
        r = dict(base, params=params, **r)
        results.append(r)
        print("RESULT " + json.dumps(r), flush=True)

    for batch in args.batch_list:
        if args.variant == "stock":
            r = steps(batch, None)
            emit(dict(r, batch=batch, mode="stock"))
            if not r["ok"]:
                break
            continue
        from ramstream.planner import choose_paged_blocks, copy_seconds, estimate_overlap

        off.set_measuring(True)
        unpaged = steps(batch, [])
        off.set_measuring(False)
        emit(dict(unpaged, batch=batch, mode="unpaged"))
        all_paged = steps(batch, list(range(len(off.blocks))))
        emit(dict(all_paged, batch=batch, mode="all_paged"))
        if not all_paged["ok"]:
            break
        if unpaged["ok"]:
            bb = unpaged["block_bytes"]
            copy_all = sum(copy_seconds(b, base["d2h_gbps"], base["h2d_gbps"]) for b in bb)
            overlap = estimate_overlap(unpaged["s_per_step"], all_paged["s_per_step"], copy_all)
            idx, info = choose_paged_blocks(bb, unpaged_step_s=unpaged["s_per_step"],
                                            d2h_gbps=base["d2h_gbps"], h2d_gbps=base["h2d_gbps"],
                                            compute_overlap=overlap,
                                            max_slowdown=args.max_slowdown)
            planned = steps(batch, idx) if idx else dict(unpaged)
            planned.update(batch=batch, mode="planner", overlap=overlap,
                           expected_slowdown=info["expected_slowdown"], reason=info["reason"])
            if planned.get("ok"):
                planned["slowdown"] = planned["s_per_step"] / unpaged["s_per_step"] - 1
                planned["slowdown_all_paged"] = (all_paged["s_per_step"] / unpaged["s_per_step"]
                                                 - 1)
            emit(planned)
    return results


def _table(results: list[dict]) -> str:
    lines = [f"{'variant':10s} {'mode':10s} {'batch':>5s} {'tok/s':>9s} {'s/step':>7s} "
             f"{'peak GiB':>8s} {'paged':>5s} {'host GiB':>8s} {'slowdown':>8s}"]
    for r in results:
        if not r.get("ok"):
            lines.append(f"{r['variant']:10s} {r.get('mode', '-'):10s} {r.get('batch', 0):5d} "
                         f"{'-':>9s}  {r.get('error', '')[:70]}")
            continue
        pv = r.get("peak_vram_gib")
        sd = r.get("slowdown")
        lines.append(
            f"{r['variant']:10s} {r['mode']:10s} {r['batch']:5d} {r['tokens_per_s']:9.0f} "
            f"{r['s_per_step']:7.3f} {'-' if pv is None else f'{pv:.2f}':>8s} "
            f"{r.get('paged_blocks', 0):5d} {r.get('host_act_gib', 0):8.2f} "
            f"{'' if sd is None else f'{sd:+.1%}':>8s}")
    best = {}
    for r in results:
        if r.get("ok"):
            key = (r["variant"], r["mode"] if r["variant"] == "stock" or r["mode"] == "unpaged"
                   else "paged")
            best[key] = max(best.get(key, 0), r["batch"])
    lines.append("largest batch: " + ", ".join(f"{v}/{m}={b}" for (v, m), b in sorted(best.items()))
                 if best else "largest batch: none fits")
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
    ap.add_argument("--timeout", type=int, default=280, help="seconds per variant process")
    ap.add_argument("--variant", help=argparse.SUPPRESS)
    ap.add_argument("--out")
    args = ap.parse_args()
    args.batch_list = [int(b) for b in args.batches.split(",") if b]
    if args.variant:
        run_variant(args)
        return 0
    results: list[dict] = []
    for v in args.variants.split(","):
        cmd = [sys.executable, __file__, "--variant", v, "--model", args.model, "--seq",
               str(args.seq), "--batches", args.batches, "--cap-gib", str(args.cap_gib),
               "--steps", str(args.steps), "--warmup", str(args.warmup), "--device", args.device,
               "--loss", args.loss, "--prefetch-depth", str(args.prefetch_depth),
               "--min-offload-bytes", str(args.min_offload_bytes),
               "--max-slowdown", str(args.max_slowdown)]
        try:
            p = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout)
            out, err = p.stdout, p.stderr
        except subprocess.TimeoutExpired as e:
            out = e.stdout.decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
            err = f"timed out after {args.timeout} s"
        got = [json.loads(x[7:]) for x in out.splitlines() if x.startswith("RESULT ")]
        if not got or err.startswith("timed out"):
            got.append({"variant": v, "ok": False, "mode": "-", "batch": 0,
                        "error": err[-300:].replace("\n", " | ")})
        for r in got:
            print(json.dumps({k: r[k] for k in r if k != "block_bytes"}), flush=True)
        results += got
    print()
    print(_table(results))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
