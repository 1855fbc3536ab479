"""Data parallel with wrap() (issue 5): per-step time, tokens/s, host state per rank, parity.

Worker (one process per rank; torchrun sets RANK/WORLD_SIZE/LOCAL_RANK; a plain `python` run is
one process without torch.distributed). Each rank trains on its slice of a global batch of
--batch x world sequences drawn from a fixed seed; rank 0 prints one JSON line and writes --out:

    torchrun --nproc-per-node 2 bench/train/bench_dp.py --model 1.8b --batch 8 --seq 512 --steps 10

Parity (--check): a single process trained on the full global batch saves its parameters
(--save-ref FILE); the data-parallel run loads them on rank 0 (--ref-file FILE) and reports the
largest absolute difference, and every rank hashes its parameters to show that the replicas are
bit-identical:

    python bench/train/bench_dp.py --model 1.8b --batch 16 --seq 512 --steps 10 --save-ref ref.pt
    torchrun --nproc-per-node 2 bench/train/bench_dp.py --model 1.8b --batch 8 --seq 512 \
        --steps 10 --check --ref-file ref.pt

Driver (--nproc N): runs the single-process baseline (--batch per process), the reference (with
--check) and the N-rank run under torch.distributed.run (or, with --rendezvous file, N processes
it starts that meet through a FileStore: no TCP port), then prints a table and a summary (the
throughput ratio, host bytes per rank against one process, parity); --out writes everything:

    python bench/train/bench_dp.py --nproc 2 --model 1.8b --batch 8 --seq 512 --steps 10 \
        --check --out dp.json
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import resource
import shutil
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from dp_launch import _launch, _launch_ranks, _table, summarize  # noqa: E402

# what a reference must share with the run it is compared against
REF_KEYS = ("model", "global_batch", "seq", "trained_steps", "seed", "lr", "amp", "device_type")


def _cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - not Linux
        return os.cpu_count() or 1


def _global_batches(n: int, global_batch: int, seq: int, vocab: int, seed: int):
    """n (inputs, targets) pairs of shape (global_batch, seq) on the CPU, the same on every rank
    and for every world size: next-token targets of random token streams."""
    import torch

    out = []
    for i in range(n):
        g = torch.Generator().manual_seed(seed * 1_000_003 + i)
        t = torch.randint(0, vocab, (global_batch, seq + 1), generator=g)
        out.append((t[:, :-1], t[:, 1:]))
    return out


def _param_digest(model) -> str:
    """sha256 over every parameter's bytes, in named order (equal digests: bit-identical)."""
    import torch

    h = hashlib.sha256()
    for name, p in model.named_parameters():
        h.update(name.encode())
        t = p.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8)
        h.update(memoryview(t.numpy()))
    return h.hexdigest()


def _load_reference(path: str, meta: dict) -> dict:
    """The saved reference, after checking that it was made for this run's data and steps."""
    import torch

    ref = torch.load(path, map_location="cpu", mmap=True, weights_only=True)
    bad = {k: (ref["meta"].get(k), meta[k]) for k in REF_KEYS if ref["meta"].get(k) != meta[k]}
    if bad:
        raise SystemExit(
            f"bench_dp: reference {path} was made for another run: "
            + ", ".join(f"{k}: reference {a!r} != this run {b!r}" for k, (a, b) in bad.items())
        )
    return ref


def _compare_with_reference(model, path: str, meta: dict) -> dict:
    """Largest absolute difference between the model's parameters and a saved reference."""

    ref = _load_reference(path, meta)
    worst, worst_name = 0.0, None
    for name, p in model.named_parameters():
        r = ref["params"][name].to(p.device)
        d = float((p.detach().float() - r.float()).abs().max()) if p.numel() else 0.0
        if d > worst or worst_name is None:
            worst, worst_name = d, name
    return {"parity_max_abs_diff": worst, "parity_worst_param": worst_name}


def run_worker(args) -> dict | None:
    """Trains on this rank; returns the result on rank 0 (None elsewhere)."""
    import torch
    import torch.distributed as dist

    sys.path.insert(0, HERE)
    from gpt import CONFIGS, GPT

    import ramstream

    launched = "RANK" in os.environ and "WORLD_SIZE" in os.environ
    rank = int(os.environ.get("RANK", "0")) if launched else 0
    world = int(os.environ.get("WORLD_SIZE", "1")) if launched else 1
    local = int(os.environ.get("LOCAL_RANK", "0")) if launched else 0
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", "1")) if launched else 1
    cuda = args.device == "cuda"
    if cuda:
        if not torch.cuda.is_available():
            raise SystemExit("bench_dp: --device cuda but torch sees no GPU (use --device cpu)")
        dev = torch.device("cuda", local % torch.cuda.device_count())
        torch.cuda.set_device(dev)
    else:
        dev = torch.device("cpu")
    backend = None
    if launched:
        os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
        backend = args.backend or ("nccl" if cuda else "gloo")
        if backend == "nccl" and local_world > torch.cuda.device_count():
            raise SystemExit(
                f"bench_dp: {local_world} ranks per node but "
                f"{torch.cuda.device_count()} GPU(s); NCCL needs one GPU per rank "
                "(--backend gloo shares a GPU)"
            )
        extra = {"device_id": dev} if backend == "nccl" else {}
        init_file = os.environ.get("RAMSTREAM_DP_INIT_FILE")
        if init_file:  # --rendezvous file: the ranks meet in a file, no port to race for
            extra.update(init_method=f"file://{init_file}", rank=rank, world_size=world)
        dist.init_process_group(backend, **extra)

    def gather(obj):
        if not launched:
            return [obj]
        out = [None] * world
        dist.all_gather_object(out, obj)
        return out

    cfg = dict(CONFIGS[args.model], ctx=max(1024, args.seq))
    options = {"offload": True, **json.loads(args.options)}
    options.setdefault("threads", max(1, _cores() // local_world))
    amp = args.amp if cuda else "off"
    out = {
        "bench": "dp",
        "world": world,
        "backend": backend,
        "device": str(dev),
        "model": args.model,
        "batch_per_rank": args.batch,
        "global_batch": args.batch * world,
        "seq": args.seq,
        "steps": args.steps,
        "warmup": args.warmup,
        "trained_steps": args.warmup + args.steps,
        "seed": args.seed,
        "lr": args.lr,
        "amp": amp,
        "device_type": dev.type,
        "options": options,
    }
    try:
        if args.ref_file and rank == 0:
            _load_reference(args.ref_file, out)  # fail before training, not after
        torch.manual_seed(args.seed)  # the same initial model on every rank
        model = GPT(**cfg).to(dev)
        out["params"] = sum(p.numel() for p in model.parameters())
        t0 = time.perf_counter()
        model, opt = ramstream.wrap(
            model, torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.1), **options
        )
        out["wrap_s"] = time.perf_counter() - t0
        out["data_parallel"] = opt._engine.dp is not None
        data = _global_batches(
            args.warmup + args.steps, args.batch * world, args.seq, cfg["vocab"], args.seed
        )
        lo, hi = rank * args.batch, (rank + 1) * args.batch
        sync = torch.cuda.synchronize if cuda else (lambda: None)
        if cuda:
            torch.cuda.reset_peak_memory_stats(dev)
        times, losses = [], []
        for i, (x, y) in enumerate(data):
            x, y = x[lo:hi].to(dev), y[lo:hi].to(dev)
            sync()
            t0 = time.perf_counter()
            with torch.autocast("cuda", dtype=torch.bfloat16, enabled=amp == "bf16"):
                loss = model(x, y)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            losses.append(loss.item())
            sync()
            if i >= args.warmup:
                times.append(time.perf_counter() - t0)
        opt.synchronize()
        times.sort()
        report = ramstream.memory_report(model)["optimizer"]
        mine = {
            "s_per_step": times[len(times) // 2] if times else None,
            "min_s": times[0] if times else None,
            "losses": losses,
            "host_state_bytes": report["host_state_bytes"],
            "landing_bytes": report["landing_bytes"],
            "moment_dtype": report["moment_dtype"],
            "peak_vram_gib": torch.cuda.max_memory_allocated(dev) / 2**30 if cuda else None,
            "host_rss_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20,
            "digest": _param_digest(model) if args.check else None,
        }
        ranks = gather(mine)
        if rank == 0:
            step = max(r["s_per_step"] for r in ranks) if times else None
            out.update(
                ok=True,
                s_per_step=step,
                min_s=max(r["min_s"] for r in ranks) if times else None,
                s_per_step_by_rank=[r["s_per_step"] for r in ranks],
                tokens_per_s=world * args.batch * args.seq / step if step else None,
                loss=sum(r["losses"][-1] for r in ranks) / world,
                host_state_bytes_by_rank=[r["host_state_bytes"] for r in ranks],
                host_state_bytes_total=sum(r["host_state_bytes"] for r in ranks),
                landing_bytes_by_rank=[r["landing_bytes"] for r in ranks],
                moment_dtype=ranks[0]["moment_dtype"],
                peak_vram_gib=max(r["peak_vram_gib"] for r in ranks) if cuda else None,
                peak_vram_gib_by_rank=[r["peak_vram_gib"] for r in ranks],
                host_rss_gib_by_rank=[r["host_rss_gib"] for r in ranks],
            )
            if args.check:
                digests = [r["digest"] for r in ranks]
                out["param_sha256_by_rank"] = [d[:16] for d in digests]
                out["replicas_identical"] = len(set(digests)) == 1
            if args.ref_file:
                out.update(_compare_with_reference(model, args.ref_file, out))
                out["parity_tol"] = args.tol
                out["parity_ok"] = out["parity_max_abs_diff"] < args.tol
            if args.save_ref:
                _save_reference(model, args.save_ref, out)
                out["saved_ref"] = args.save_ref
        opt.close()
        if launched:
            dist.barrier()
    finally:
        if launched:
            dist.destroy_process_group()
    return out if rank == 0 else None


def _save_reference(model, path: str, meta: dict) -> None:
    import torch

    params = {n: p.detach().to("cpu", copy=True) for n, p in model.named_parameters()}
    tmp = path + ".tmp"
    torch.save({"meta": {k: meta[k] for k in REF_KEYS}, "params": params}, tmp)
    os.replace(tmp, path)


def _common_args(args, batch: int) -> list[str]:
    a = [
        "--model",
        args.model,
        "--batch",
        str(batch),
        "--seq",
        str(args.seq),
        "--steps",
        str(args.steps),
        "--warmup",
        str(args.warmup),
        "--device",
        args.device,
        "--options",
        args.options,
        "--lr",
        repr(args.lr),
        "--seed",
        str(args.seed),
        "--amp",
        args.amp,
        "--tol",
        repr(args.tol),
    ]
    return a + (["--backend", args.backend] if args.backend else [])


def drive(args) -> dict:
    """The single-process baseline, the full-batch reference (--check) and the N-rank run."""
    n = args.nproc
    work = args.workdir or tempfile.mkdtemp(prefix="bench_dp_")
    os.makedirs(work, exist_ok=True)
    me = [sys.executable, os.path.abspath(__file__)]
    runs = {}
    try:
        runs["single"] = _launch(
            "single",
            me + _common_args(args, args.batch) + ["--out", f"{work}/single.json"],
            f"{work}/single.json",
            args.timeout,
        )
        dp_extra = []
        if args.check:
            ref = f"{work}/ref.pt"
            runs["reference"] = _launch(
                "reference",
                me
                + _common_args(args, args.batch * n)
                + ["--save-ref", ref, "--out", f"{work}/reference.json"],
                f"{work}/reference.json",
                args.timeout,
            )
            dp_extra = ["--check", "--ref-file", ref]
        worker_args = _common_args(args, args.batch) + dp_extra + ["--out", f"{work}/dp.json"]
        if args.rendezvous == "file":
            init_file = f"{work}/rendezvous"
            if os.path.exists(init_file):
                os.remove(init_file)  # a FileStore file left by an earlier run would be joined
            runs["dp"] = _launch_ranks("dp", me + worker_args, n, init_file, f"{work}/dp.json", args.timeout)
        else:
            runs["dp"] = _launch(
                "dp",
                [
                    sys.executable,
                    "-m",
                    "torch.distributed.run",
                    "--standalone",
                    "--nproc-per-node",
                    str(n),
                    os.path.abspath(__file__),
                ]
                + worker_args,
                f"{work}/dp.json",
                args.timeout,
            )
    finally:
        if not args.workdir:
            shutil.rmtree(work, ignore_errors=True)
    return {"runs": list(runs.values()), "summary": summarize(runs, n)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="1.8b", help="a key of gpt.CONFIGS")
    ap.add_argument("--batch", type=int, default=8, help="sequences per rank per step")
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--steps", type=int, default=10, help="timed steps (after --warmup)")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    ap.add_argument(
        "--backend", choices=("nccl", "gloo"), help="default: nccl with --device cuda, gloo with --device cpu"
    )
    ap.add_argument(
        "--amp",
        choices=("bf16", "off"),
        default="bf16",
        help="bf16 autocast on cuda (the CPU always runs fp32)",
    )
    ap.add_argument(
        "--options",
        default="{}",
        help="extra wrap() options as JSON "
        "(offload=True is set; threads defaults to the cores / ranks per node)",
    )
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--check",
        action="store_true",
        help="hash every rank's parameters (bit-identical replicas); with --nproc "
        "also train and compare against the single-process reference",
    )
    ap.add_argument("--save-ref", metavar="FILE", help="save the final parameters (reference)")
    ap.add_argument(
        "--ref-file", metavar="FILE", help="rank 0 compares its final parameters with this reference"
    )
    ap.add_argument("--tol", type=float, default=1e-5, help="parity target (max abs difference)")
    ap.add_argument("--nproc", type=int, help="driver: single process, reference, N ranks")
    ap.add_argument("--workdir", help="driver: keep the runs' files (reference) here")
    ap.add_argument("--timeout", type=float, default=1800, help="driver: seconds per run")
    ap.add_argument(
        "--rendezvous",
        choices=("torchrun", "file"),
        default="torchrun",
        help="driver: the N ranks under torchrun --standalone, or started by the "
        "driver and meeting in a file (no TCP port; what the tests use)",
    )
    ap.add_argument("--out", help="write the JSON result here")
    args = ap.parse_args()
    json.loads(args.options)
    if args.steps < 1 or args.warmup < 0 or args.batch < 1 or args.seq < 1:
        ap.error("--steps, --batch and --seq must be >= 1, --warmup >= 0")
    if args.nproc is not None:
        if args.nproc < 1:
            ap.error("--nproc must be >= 1")
        res = drive(args)
        _table(res)
    else:
        res = run_worker(args)
        if res is None:
            return 0
        print(json.dumps(res), flush=True)
    if args.out:
        tmp = args.out + ".tmp"
        with open(tmp, "w") as f:
            json.dump(res, f, indent=1)
        os.replace(tmp, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
