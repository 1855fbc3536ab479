"""Delayed parameter update (wrap(delayed_update=...), issue 29 part 2): the same run with and
without it, loss curves and s/step side by side, each variant in its own process (the VRAM cap is
per process; the host state of the first is gone before the second starts).

The data is learnable (tokens from a fixed random Markov chain: each token has 4 equally likely
successors, so the loss can fall to ln 4 = 1.386), the same batches in both runs, so the curves
show what one step of staleness costs. Baseline: the undelayed run of the same process layout.

    python bench/train/bench_delayed.py --model 6.85b --batch 8 --seq 512 --cap-gib 24 \
        --steps 200 --out delayed.json --plot delayed.png          # the H200 run
    python bench/train/bench_delayed.py --device cpu --tiny        # the CPU, seconds: a smoke test
    python bench/train/bench_delayed.py --device cpu --tiny --steps 200 --warmup 40 \
        --out docs/img/delayed_update_cpu.json --plot docs/img/delayed_update_cpu.png   # the docs' toy run

Reports per variant: losses (one per step), s/step (median over the steps after --skip), the
host AdamW time per step, the engine's delayed_steps; and the ratio delayed/plain of s/step and
the mean loss over the last 20 steps of each.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))


def markov_batches(vocab: int, batch: int, seq: int, steps: int, seed: int = 0):
    """`steps` batches of (batch, seq + 1) tokens from a fixed random 4-successor Markov chain."""
    import torch

    g = torch.Generator().manual_seed(seed)
    succ = torch.randint(0, vocab, (vocab, 4), generator=g)
    out = []
    for _ in range(steps):
        x = torch.empty(batch, seq + 1, dtype=torch.long)
        x[:, 0] = torch.randint(0, vocab, (batch,), generator=g)
        pick = torch.randint(0, 4, (batch, seq), generator=g)
        for t in range(seq):
            x[:, t + 1] = succ[x[:, t], pick[:, t]]
        out.append(x)
    return out


def write_json(path: str, results: dict) -> None:
    """The results to `path`, through a temporary name."""
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(results, f, indent=1)
    os.replace(tmp, path)


def capped_device(args):
    """args.device as a torch.device; on a GPU, this process's memory capped at args.cap_gib GiB
    (0: no cap) with torch.cuda.set_per_process_memory_fraction."""
    from vram_cap import cap_vram

    return cap_vram(args.device, args.cap_gib)


def run_variant(args, delayed) -> dict:
    """One training run in this process; delayed: False or the delayed_update value."""
    import torch

    import ramstream

    sys.path.insert(0, HERE)
    from stream_models import build_gpt

    dev = capped_device(args)
    cuda = dev.type == "cuda"
    key = "gpt_tiny" if args.tiny else f"gpt{args.model}"
    torch.manual_seed(0)
    model, vocab = build_gpt(key, args.seq, torch.device("cpu"))
    if args.dtype == "bf16":
        model = model.to(torch.bfloat16)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.1)
    options = dict(device=str(dev), delayed_update=delayed, moment_dtype=args.moments)
    if cuda:
        options.update(loss="chunked", batch=args.batch, seq=args.seq)
    name = "plain" if delayed is False else f"delayed, warm-up {delayed}"
    t_wrap = time.perf_counter()
    model, opt = ramstream.wrap(model, opt, **options)
    # progress on stderr (the parent lets it through): a run cut by a time limit still shows how far
    # it got and at what pace
    print(f"[{name}] wrap() {time.perf_counter() - t_wrap:.1f} s", file=sys.stderr, flush=True)
    data = markov_batches(vocab, args.batch, args.seq, args.steps)

    def loss_fn(x):
        if cuda:
            return ramstream.chunked_cross_entropy(model.hidden(x[:, :-1]), model.head.weight, x[:, 1:])
        return model(x[:, :-1], x[:, 1:])

    losses, times = [], []
    for x in data:
        t0 = time.perf_counter()
        x = x.to(dev, non_blocking=True)
        loss = loss_fn(x)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())  # the device's work for this step is done
        times.append(time.perf_counter() - t0)
        if len(times) % 10 == 0 or len(times) == 1:
            print(
                f"[{name}] step {len(times)}: loss {losses[-1]:.4f}, {times[-1]:.3f} s",
                file=sys.stderr,
                flush=True,
            )
    opt.synchronize()
    st = opt.stats()
    timed = times[args.skip :] or times
    out = dict(
        delayed_update=delayed,
        losses=losses,
        step_s=statistics.median(timed),
        host_update_s_per_step=st["host_update_s"] / max(1, st["steps"]),
        delayed_steps=st["delayed_steps"],
        steps=st["steps"],
        wait_s_per_step=st["wait_s"] / max(1, st["steps"]),
    )
    if cuda:
        out["peak_gib"] = torch.cuda.max_memory_allocated(dev) / 2**30
    engine = getattr(opt, "_engine", None)
    if engine is not None:  # the optimizer's placement: the mapped share is updated by the GPU, undelayed
        total = max(1, sum(b.numel for b in engine.buckets))
        out["placement"] = {
            p: sum(b.numel for b in engine.buckets if b.placement == p) / total
            for p in ("device", "mapped", "host")
        }
    return out


def _child(args, name: str, script: str = __file__) -> dict:
    """One variant of `script` (this one, or bench_nvme.py) in its own process, run with this
    process's arguments and --variant `name` (the VRAM cap and the host state are per process)."""
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "r.json")
        cmd = [
            sys.executable,
            os.path.abspath(script),
            *sys.argv[1:],
            "--variant",
            name,
            "--variant-out",
            path,
        ]
        # stderr passes through (progress, and the traceback of a failed run)
        p = subprocess.run(cmd, stdout=subprocess.PIPE, text=True, check=False)
        if p.returncode != 0:
            print(p.stdout[-4000:], file=sys.stderr)
            return dict(error=f"exit status {p.returncode} (its stderr is above)")
        with open(path) as f:
            return json.load(f)


def _warmup_of(args, name: str):
    """delayed_update's value for variant `name`: False (plain), --warmup or --extra-warmup."""
    return {"plain": False, "delayed": args.warmup, "delayed2": args.extra_warmup}[name]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--model", default="6.85b", choices=["6.85b", "1.8b"])
    ap.add_argument("--tiny", action="store_true", help="the tiny GPT, few steps (a smoke test)")
    ap.add_argument("--dtype", default="bf16", choices=["bf16", "fp32"])
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--cap-gib", type=float, default=24.0)
    ap.add_argument(
        "--moments",
        default="bfloat16",
        choices=["auto", "float32", "bfloat16"],
        help="moment_dtype of both variants (default bfloat16, the issue's 0.90 s baseline: with fp32 "
        "moments the delayed run's host state does not fit a 128 GiB machine)",
    )
    ap.add_argument("--steps", type=int, default=None, help="default 200 (--tiny: 12)")
    ap.add_argument("--lr", type=float, default=3e-4)
    ap.add_argument(
        "--warmup",
        type=int,
        default=None,
        help="delayed_update's undelayed warm-up steps (default 40; --tiny: 2)",
    )
    ap.add_argument(
        "--extra-warmup",
        type=int,
        default=None,
        help="a second delayed run with this many warm-up steps (variant 'delayed2'), e.g. 5 beside 40",
    )
    ap.add_argument("--skip", type=int, default=45, help="steps left out of s/step (warm-up, plan)")
    ap.add_argument("--out", default=None, help="JSON results")
    ap.add_argument("--plot", default=None, help="a PNG of both loss curves (matplotlib)")
    ap.add_argument(
        "--variants",
        default="plain,delayed",
        help="which runs, comma-separated (plain, delayed): one per device call when a call's time limit "
        "cannot hold both; --combine joins their JSON files afterwards",
    )
    ap.add_argument(
        "--combine",
        nargs="+",
        default=None,
        metavar="JSON",
        help="join the results of earlier runs (each with its own variants) into --out / --plot; runs nothing",
    )
    ap.add_argument("--variant", default=None, help=argparse.SUPPRESS)  # the child process's run
    ap.add_argument("--variant-out", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.tiny:  # the tiny GPT in fp32; a smoke test unless --steps/--warmup are given
        args.batch, args.seq, args.cap_gib, args.dtype = min(args.batch, 8), min(args.seq, 64), 0, "fp32"
        args.steps = 12 if args.steps is None else args.steps
        args.warmup = 2 if args.warmup is None else args.warmup
        args.skip = min(args.skip, args.steps // 4)
    args.steps = 200 if args.steps is None else args.steps
    args.warmup = 40 if args.warmup is None else args.warmup
    for name in ("warmup", "extra_warmup"):
        v = getattr(args, name)
        if v is not None and v < 0:
            ap.error(f"--{name.replace('_', '-')} must be an int >= 0 (undelayed warm-up steps), got {v}")
    if args.variant is not None:
        res = run_variant(args, _warmup_of(args, args.variant))
        with open(args.variant_out, "w") as f:
            json.dump(res, f)
        return 0
    if args.combine:
        return _combine(args)
    results = {}
    wanted = [v.strip() for v in args.variants.split(",") if v.strip()]
    if not wanted or any(v not in ("plain", "delayed") for v in wanted):
        ap.error(f"--variants {args.variants!r}: accepted: plain, delayed, comma-separated")
    names = tuple(wanted) + (("delayed2",) if args.extra_warmup is not None else ())
    for name in names:
        if args.device == "cpu":  # no per-process cap to keep apart: both runs in this process
            results[name] = run_variant(args, _warmup_of(args, name))
        else:
            results[name] = _child(args, name)
        r = results[name]
        if "error" in r:
            continue
        print(
            f"{name:8s} (warm-up {_warmup_of(args, name)}) s/step {r['step_s']:.4f}  host AdamW/step {r['host_update_s_per_step']:.4f} s  "
            f"last loss {r['losses'][-1]:.4f}  delayed steps {r['delayed_steps']}"
            + "".join(f"  {k} {v:.0%}" for k, v in r.get("placement", {}).items())
        )
    ok = all("error" not in r for r in results.values())
    results["config"] = {
        k: v for k, v in vars(args).items() if k not in ("variant", "variant_out", "out", "plot", "combine")
    }
    return _finish(args, results, ok)


def _combine(args) -> int:
    """--combine: the variants of several result files in one (the config of the first)."""
    results: dict = {}
    for path in args.combine:
        try:
            with open(path) as f:
                r = json.load(f)
        except (OSError, ValueError) as exc:
            print(f"--combine: {path} is not a results file of this script ({exc})", file=sys.stderr)
            return 2
        if not isinstance(r, dict) or "config" not in r:
            print(f"--combine: {path} is not a results file of this script (no config)", file=sys.stderr)
            return 2
        for k in ("plain", "delayed", "delayed2"):
            if k in r:
                results[k] = r[k]
        results.setdefault("config", r["config"])
    if "plain" not in results or "delayed" not in results:
        print("--combine: needs a plain and a delayed run among the files", file=sys.stderr)
        return 2
    ok = all("error" not in results[k] for k in ("plain", "delayed"))
    return _finish(args, results, ok)


def _finish(args, results: dict, ok: bool) -> int:
    """The ratio and the tail losses when both runs are there; --out, --plot."""
    names = [k for k in ("plain", "delayed", "delayed2") if k in results]
    if ok and "plain" in results and "delayed" in results:
        p, d = results["plain"], results["delayed"]
        tail = min(20, len(p["losses"]))
        results["ratio_step_s"] = d["step_s"] / p["step_s"]
        results["tail_mean_loss"] = {k: statistics.fmean(results[k]["losses"][-tail:]) for k in names}
        print(
            f"delayed/plain s/step {results['ratio_step_s']:.3f}; mean loss of the last {tail} steps: "
            + ", ".join(f"{k} {v:.4f}" for k, v in results["tail_mean_loss"].items())
        )
    if args.out:
        write_json(args.out, results)
    if args.plot and ok:
        plot(results, args.plot)
    return 0 if ok else 1


def plot(results: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cfg = results["config"]
    fig, ax = plt.subplots(figsize=(7, 4))
    for name in [k for k in ("plain", "delayed", "delayed2") if k in results and "losses" in results[k]]:
        r = results[name]
        w = {"delayed": cfg["warmup"], "delayed2": cfg.get("extra_warmup")}.get(name)
        label = "no delay" if name == "plain" else f"delayed_update={w} (warm-up steps)"
        if cfg["device"] != "cpu":  # on the CPU engine compute and host AdamW share the cores
            label += f": {r['step_s']:.3f} s/step"
        ax.plot(range(1, len(r["losses"]) + 1), r["losses"], label=label, lw=1)
    ax.axvline(cfg["warmup"], color="grey", lw=0.8, ls=":")
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    model = "tiny GPT" if cfg["tiny"] else f"GPT {cfg['model']}"
    ax.set_title(f"{model}, {cfg['batch']}x{cfg['seq']}, {cfg['device']}: delayed vs plain")
    ax.legend()
    fig.tight_layout()
    tmp = path + ".tmp.png"
    fig.savefig(tmp, dpi=110)
    os.replace(tmp, path)


if __name__ == "__main__":
    raise SystemExit(main())
