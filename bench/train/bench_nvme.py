"""The disk tier of issue 29, with its data in RAM and on disk, each variant in its own process
on a GPU (the VRAM cap is per process), the disk's own rates measured first in the same run.

    python bench/train/bench_nvme.py --model 6.85b --dtype bf16 --batch 8 --seq 512 --cap-gib 24 \
        --dir /nvme/scratch --out nvme.json                            # the GPU run
    python bench/train/bench_nvme.py --device cpu --tiny --dir /tmp    # the CPU: a smoke test
    python bench/train/bench_nvme.py --what weights --model 6.85b --cap-gib 24 --dir /nvme/scratch \
        --out nvme_w.json     # wrap(nvme_weights=True): a frozen base's streamed weights on disk
    python bench/train/bench_nvme.py --what offload --model 1.8b --cap-gib 24 --dir /nvme/scratch \
        --out nvme_o.json     # OffloadModel(nvme=, nvme_path=): every chunk's weights on disk

--what state (default): the host optimizer state, in RAM and with --share of it on disk
(wrap(nvme_dir=..., nvme_offload=...)). --what weights: a frozen-base model (every Linear weight
frozen, the norms and biases trained: the LoRA shape of a host state, with no adapter library)
with param_offload=True, the streamed blocks' frozen weights in pinned RAM and on disk
(nvme_weights=True). --what offload: OffloadModel over the GPT's blocks, one chunk each, frozen
whole (a disk chunk may hold no trained parameter), the embedding, ln_f and head trained on the
device (nvme_offload.py), the chunks in pinned RAM and all of them on disk (nvme = their count).

Reports per variant: s/step (median after --skip), the disk bytes read and written per step over
the timed steps only (the counters' difference from before the first timed step to the end: the
write of the state at wrap() and the warm-up are not counted), the losses; for the disk variant
the disk GB/s achieved (bytes per step / s per step) against the measured rates, and the bound
the issue names, max(the RAM run's step, disk bytes / measured rates), with the ratio s/step /
bound; for --what offload the read GB/s achieved against the measured read rate (target >= 80 %).

The losses of the disk variant should equal the RAM run's bit for bit (the disk tier is
bit-exact on CPU and GPU: tests/test_nvme_state.py). A GPU run is not deterministic from run to
run (the embedding's backward adds with atomics), so the RAM variant runs twice (--no-control:
once) and the verdict compares the disk run's max |dloss| against the two RAM runs' spread.
--deterministic runs every variant with torch.use_deterministic_algorithms(True, warn_only=True)
and CUBLAS_WORKSPACE_CONFIG=:4096:8 (set before torch starts CUDA).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
CUBLAS_DETERMINISTIC = ":4096:8"
READ_RATE_TARGET = 0.8  # --what offload: read GB/s achieved / measured (issue 29)
LABELS = {"ram": "ram", "disk": "disk", "ram_control": "control"}


def timed_steps(args, step, io, sync=lambda: None) -> dict:
    """args.steps calls of step(i) -> loss. s/step: the median of the timed steps (those after
    --skip). io() -> (disk bytes read, written) so far: the bytes per step are its difference over
    the timed steps, from before the first (after sync(): the warm-up's I/O in flight has ended
    and is counted before) to the end (after sync())."""
    first = args.skip if args.skip < args.steps else 0
    losses, times, io0 = [], [], (0, 0)
    for i in range(args.steps):
        if i == first:
            sync()
            io0 = io()
        t0 = time.perf_counter()
        losses.append(step(i))
        times.append(time.perf_counter() - t0)
    sync()
    io1 = io()
    n = args.steps - first
    return dict(
        losses=losses,
        steps_s=times,
        step_s=statistics.median(times[first:]),
        timed_steps=n,
        disk_read_per_step=(io1[0] - io0[0]) / n,
        disk_written_per_step=(io1[1] - io0[1]) / n,
    )


@contextlib.contextmanager
def determinism(on: bool):
    """--deterministic for the run: torch.use_deterministic_algorithms(True, warn_only=True) and
    scaled_dot_product_attention on its math kernel (an H100 run showed cuDNN's attention backward
    nondeterministic even so: "cuDNN Attention defaults to a non-deterministic algorithm"); the
    settings before restored after (the CPU runs share one process)."""
    import torch

    if not on:
        yield
        return
    sdp = torch.backends.cuda
    before = (
        torch.are_deterministic_algorithms_enabled(),
        torch.is_deterministic_algorithms_warn_only_enabled(),
        sdp.cudnn_sdp_enabled(),
        sdp.flash_sdp_enabled(),
        sdp.mem_efficient_sdp_enabled(),
    )
    torch.use_deterministic_algorithms(True, warn_only=True)
    for enable in (sdp.enable_cudnn_sdp, sdp.enable_flash_sdp, sdp.enable_mem_efficient_sdp):
        enable(False)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(before[0], warn_only=before[1])
        for enable, was in zip(
            (sdp.enable_cudnn_sdp, sdp.enable_flash_sdp, sdp.enable_mem_efficient_sdp), before[2:]
        ):
            enable(was)


def run_variant(args, share) -> dict:
    """One training run in this process; share: 0 (in RAM) or the share on disk."""
    import torch

    sys.path.insert(0, HERE)
    with determinism(args.deterministic):
        if args.what == "offload":
            from nvme_offload import run_offload

            out = run_offload(args, on_disk=bool(share))
        else:
            out = run_wrapped(args, share)
        out["deterministic_algorithms"] = torch.are_deterministic_algorithms_enabled()
    out["cublas_workspace_config"] = os.environ.get("CUBLAS_WORKSPACE_CONFIG")
    return out


def run_wrapped(args, share) -> dict:
    """--what state / weights: the GPT through ramstream.wrap() with the disk tier at `share`."""
    import torch

    import ramstream

    sys.path.insert(0, HERE)
    from bench_delayed import capped_device, markov_batches
    from stream_models import build_gpt

    dev = capped_device(args)
    cuda = dev.type == "cuda"
    torch.manual_seed(0)
    model, vocab = build_gpt("gpt_tiny" if args.tiny else f"gpt{args.model}", args.seq, torch.device("cpu"))
    if args.dtype == "bf16":
        model = model.to(torch.bfloat16)
    if args.what == "weights":  # a frozen base: Linear weights frozen, norms and biases trained
        for m in model.modules():
            if isinstance(m, torch.nn.Linear):
                m.weight.requires_grad_(False)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=args.lr, weight_decay=0.1)
    options = dict(device=str(dev), nvme_dir=args.dir, nvme_offload=share if share else False)
    if args.what == "weights":
        options.update(nvme_offload=False, param_offload=True, nvme_weights=bool(share))
    if cuda:
        options.update(loss="chunked", batch=args.batch, seq=args.seq, moment_dtype=args.moments)
    t0 = time.perf_counter()
    model, opt = ramstream.wrap(model, opt, **options)
    setup_s = time.perf_counter() - t0
    data = markov_batches(vocab, args.batch, args.seq, args.steps)

    def step(i: int) -> float:
        x = data[i].to(dev, non_blocking=True)
        if cuda:
            loss = ramstream.chunked_cross_entropy(model.hidden(x[:, :-1]), model.head.weight, x[:, 1:])
        else:
            loss = model(x[:, :-1], x[:, 1:])
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss.item()

    def disk_weights() -> dict:  # the weights' reads, from the disk weights' own report
        return ramstream.memory_report(model)["params"].get("nvme_weights") or {}

    def io() -> tuple[int, int]:
        if args.what == "weights":
            return disk_weights().get("bytes_read", 0), 0
        st = opt.stats()
        return st.get("nvme_bytes_read", 0), st.get("nvme_bytes_written", 0)

    out = dict(share=share, setup_s=setup_s)
    out.update(timed_steps(args, step, io, opt.synchronize))
    st = opt.stats()
    on_disk = (
        disk_weights().get("bytes_on_disk", 0) if args.what == "weights" else st.get("nvme_state_bytes", 0)
    )
    out.update(
        host_update_s_per_step=st["host_update_s"] / max(1, st["steps"]),
        disk_state_bytes=on_disk,
        host_state_bytes=st.get("host_state_bytes"),
    )
    if cuda:
        out["peak_gib"] = torch.cuda.max_memory_allocated(dev) / 2**30
    opt.close()
    return out


def max_dloss(a: list, b: list) -> float:
    """max |a[i] - b[i]| over the steps (inf where one is NaN and the other is not)."""
    out = 0.0
    for x, y in zip(a, b):
        if x != y:
            d = abs(x - y)
            out = max(out, math.inf if math.isnan(d) else d)
    return out


SAME_ORDER = 4.0
"""A disk run's loss difference up to this many times the RAM run's own run-to-run spread is read
as the same GPU nondeterminism: one repeat measures the spread only roughly (an H100 run showed
2.2e-4 between two RAM runs and 3.4e-4 disk vs RAM); --deterministic compares bit for bit."""


def verdict(dloss: float, spread: float | None) -> str:
    """The disk run's losses against the RAM run's, given the RAM run's own run-to-run spread."""
    if dloss == 0:
        return "losses bit-equal (disk vs RAM)"
    if spread is None:
        return f"losses differ by {dloss:.3g}; run-to-run spread not measured (--no-control)"
    if dloss <= spread:
        return f"losses differ by {dloss:.3g}, within the run-to-run spread {spread:.3g} of the RAM run"
    if dloss <= SAME_ORDER * spread:
        return (
            f"losses differ by {dloss:.3g}, the order of the run-to-run spread {spread:.3g} of the RAM run "
            f"(within {SAME_ORDER:g}x: GPU nondeterminism; --deterministic compares bit for bit)"
        )
    return (
        f"losses differ by {dloss:.3g}, beyond the run-to-run spread {spread:.3g} of the RAM run: "
        "a real finding (the disk tier is meant to be bit-exact)"
    )


def summarize(results: dict, disk: dict, what: str = "state") -> dict:
    """The disk variant against the RAM one, the measured disk rates and the control."""
    ram, dsk, ctl = results["ram"], results["disk"], results.get("ram_control")
    read_s = dsk["disk_read_per_step"] / (disk["read_gbps"] * 1e9)
    write_s = dsk["disk_written_per_step"] / (disk["write_gbps"] * 1e9)
    bound = max(ram["step_s"], read_s + write_s)
    moved = dsk["disk_read_per_step"] + dsk["disk_written_per_step"]
    read_gbps = dsk["disk_read_per_step"] / dsk["step_s"] / 1e9
    spread = max_dloss(ram["losses"], ctl["losses"]) if ctl and "error" not in ctl else None
    dloss = max_dloss(ram["losses"], dsk["losses"])
    out = dict(
        ratio_step_s=dsk["step_s"] / ram["step_s"],
        bound_s=bound,
        ratio_to_bound=dsk["step_s"] / bound,
        disk_gbps_achieved=moved / dsk["step_s"] / 1e9,
        disk_read_gbps_achieved=read_gbps,
        read_rate_ratio=read_gbps / disk["read_gbps"],
        disk_time_at_measured_rates_s=read_s + write_s,
        losses_equal=ram["losses"] == dsk["losses"],
        ram_vs_ram_max_dloss=spread,
        disk_vs_ram_max_dloss=dloss,
        verdict=verdict(dloss, spread),
    )
    if what == "offload":
        out["read_rate_target"] = READ_RATE_TARGET
        out["read_rate_target_met"] = out["read_rate_ratio"] >= READ_RATE_TARGET
    return out


def report(results: dict, disk: dict, what: str) -> None:
    s = results["summary"]
    print(
        f"disk/ram s/step {s['ratio_step_s']:.3f}; s/step / bound {s['ratio_to_bound']:.3f} (bound "
        f"{s['bound_s']:.3f} s); disk {s['disk_gbps_achieved']:.3g} GB/s achieved"
    )
    if what == "offload":
        met = "met" if s["read_rate_target_met"] else "NOT met"
        print(
            f"disk read {s['disk_read_gbps_achieved']:.3g} GB/s = {s['read_rate_ratio']:.0%} of the measured "
            f"{disk['read_gbps']:.2f} GB/s (target >= {READ_RATE_TARGET:.0%}: {met})"
        )
    spread = s["ram_vs_ram_max_dloss"]
    print(
        f"max |dloss|: ram vs ram {'-' if spread is None else f'{spread:.3g}'}, "
        f"disk vs ram {s['disk_vs_ram_max_dloss']:.3g}"
    )
    print(f"verdict: {s['verdict']}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--model", default="6.85b", choices=["6.85b", "1.8b"])
    ap.add_argument("--tiny", action="store_true", help="the tiny GPT, few steps (a smoke test)")
    ap.add_argument("--dtype", default="bf16", choices=["bf16", "fp32"])
    ap.add_argument("--moments", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--cap-gib", type=float, default=24.0)
    ap.add_argument("--steps", type=int, default=None, help="default 12 (--tiny: 6)")
    ap.add_argument("--skip", type=int, default=4, help="steps left out of s/step and bytes/step (warm-up)")
    ap.add_argument("--lr", type=float, default=3e-4)
    ap.add_argument("--dir", required=True, help="the folder the scratch file goes to (nvme_dir)")
    ap.add_argument(
        "--share", type=float, default=1.0, help="--what state: nvme_offload's share on disk (0, 1]"
    )
    ap.add_argument("--window", type=int, default=2, help="--what offload: OffloadModel's window")
    ap.add_argument(
        "--what",
        default="state",
        choices=["state", "weights", "offload"],
        help="state: the optimizer state on disk (nvme_offload); weights: a frozen base's streamed "
        "weights (nvme_weights); offload: OffloadModel's frozen chunks (nvme, nvme_path)",
    )
    ap.add_argument(
        "--no-control", action="store_true", help="run the RAM variant once (no run-to-run spread)"
    )
    ap.add_argument(
        "--deterministic",
        action="store_true",
        help="torch.use_deterministic_algorithms(True, warn_only=True), CUBLAS_WORKSPACE_CONFIG=:4096:8, "
        "attention on its math kernel",
    )
    ap.add_argument("--out", default=None, help="JSON results")
    ap.add_argument("--variant", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--variant-out", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.tiny:
        args.batch, args.seq, args.cap_gib, args.dtype = min(args.batch, 4), min(args.seq, 32), 0, "fp32"
        args.steps = 6 if args.steps is None else args.steps
        args.skip = min(args.skip, args.steps // 3)
    args.steps = 12 if args.steps is None else args.steps
    if args.steps < 1 or args.skip < 0 or args.window < 1:
        ap.error(f"--steps {args.steps}, --skip {args.skip}, --window {args.window}: need >= 1, >= 0, >= 1")
    if args.deterministic:  # before torch starts CUDA here and in the children (they inherit it)
        os.environ["CUBLAS_WORKSPACE_CONFIG"] = CUBLAS_DETERMINISTIC
    if args.variant is not None:
        res = run_variant(args, args.share if args.variant == "disk" else 0)
        with open(args.variant_out, "w") as f:
            json.dump(res, f)
        return 0
    from ramstream.disk import measure_disk

    sys.path.insert(0, HERE)
    from bench_delayed import _child, write_json

    disk = measure_disk(args.dir, size=(64 << 20) if args.tiny else (1 << 30))
    print(f"disk {args.dir}: read {disk['read_gbps']:.2f} GB/s, write {disk['write_gbps']:.2f} GB/s")
    results = {"disk_measured": disk}
    names = ("ram", "disk") + (() if args.no_control else ("ram_control",))
    for name in names:
        if args.device == "cpu":
            results[name] = run_variant(args, args.share if name == "disk" else 0)
        else:
            results[name] = _child(args, name, __file__)
        r = results[name]
        if "error" not in r:
            print(
                f"{LABELS[name]:7s} s/step {r['step_s']:.4f}  disk read/written per step "
                f"{r['disk_read_per_step'] / 1e9:.3f}/{r['disk_written_per_step'] / 1e9:.3f} GB  "
                f"last loss {r['losses'][-1]:.4f}"
            )
    ok = all("error" not in results[k] for k in names)
    if all("error" not in results[k] for k in ("ram", "disk")):
        results["summary"] = summarize(results, disk, args.what)
        report(results, disk, args.what)
    results["deterministic"] = (
        dict(use_deterministic_algorithms=True, warn_only=True, CUBLAS_WORKSPACE_CONFIG=CUBLAS_DETERMINISTIC)
        if args.deterministic
        else False
    )
    results["config"] = {k: v for k, v in vars(args).items() if k not in ("variant", "variant_out", "out")}
    if args.out:
        write_json(args.out, results)
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
