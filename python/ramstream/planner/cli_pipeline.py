"""`ramstream plan --stages N`: the pipeline split the planner picks for a model (the embedding, each
block and the head are the pieces, in order) over N devices: per stage its pieces, parameter
GiB, predicted time share, device memory against its budget, the window and pinned chunks when
the stages stream, and the bubble of the default schedule (simulate/pipeline.py)."""

from __future__ import annotations

import json
import math

from .pipeline_split import BALANCES, PipelineSplit, split_pipeline, stage_bytes
from .rules import DEFAULT_RATES
from .shape import ModelShape
from .timing import MATMUL_EFFICIENCY

_GB = 2**30
OFFLOAD_FLAGS = {"auto": "auto", "true": True, "false": False}
DEFAULT_SCHEDULE = "1f1b"  # Pipeline.step's default schedule ...
DEFAULT_MICROBATCHES = 4  # ... and microbatch count


def add_arguments(p) -> None:
    g = p.add_argument_group("pipeline split (Pipeline / PipelineModel over several devices)")
    g.add_argument("--stages", type=int, metavar="N", help="plan a pipeline of N stages (one device each)")
    g.add_argument(
        "--stage-vram-gb",
        metavar="G[,G...]",
        help="each stage's device memory in GiB, one per stage (default: --vram-gb for every stage)",
    )
    g.add_argument(
        "--balance",
        choices=BALANCES,
        default="params",
        help="balance the stages by parameters (PipelineModel's default), children or estimated time "
        "(forward + backward flops at the matmul rate)",
    )
    g.add_argument(
        "--offload",
        choices=tuple(OFFLOAD_FLAGS),
        default="auto",
        help="stages resident (false), streaming their pieces (true, Pipeline(offload=True)), or "
        "resident when that fits, else streamed (auto, the default)",
    )
    g.add_argument(
        "--microbatches",
        type=int,
        default=DEFAULT_MICROBATCHES,
        metavar="M",
        help=f"microbatches of the simulated {DEFAULT_SCHEDULE} step (default: {DEFAULT_MICROBATCHES})",
    )


def piece_numbers(shape: ModelShape, tflops: float) -> dict:
    """The planner's numbers per piece (embedding, blocks, head): names, parameter elements,
    (parameters, gradients, optimizer) bytes and forward / backward seconds for the shape's
    batch x seq at `tflops` x MATMUL_EFFICIENCY."""
    rate = tflops * 1e12 * MATMUL_EFFICIENCY
    parts = shape.parts
    names = ["embedding"] + [f"block {i}" for i in range(len(shape.blocks))] + ["head"]
    e = shape.elem_bytes
    return {
        "names": names,
        "params": [p.trained_numel + p.frozen_numel for p in parts],
        "detail": [stage_bytes(p.weight_bytes, p.trained_numel, p.trained_numel * e) for p in parts],
        "fwd": [p.fwd_flops_per_token * shape.tokens / rate for p in parts],
        "bwd": [p.bwd_flops_per_token * shape.tokens / rate for p in parts],
    }


def budgets_of(args, n: int, profile_vram) -> list[int]:
    """Bytes per stage from --stage-vram-gb, else --vram-gb, else the cached profile's free memory
    (`profile_vram`); ValueError naming the flag and what it accepts."""
    if args.stage_vram_gb is not None:
        try:
            vals = [float(x) for x in args.stage_vram_gb.split(",")]
        except ValueError:
            vals = []
        if len(vals) != n or not all(math.isfinite(v) and v > 0 for v in vals):
            raise ValueError(
                f"--stage-vram-gb {args.stage_vram_gb!r} is not accepted; accepted: {n} comma-separated "
                f"GiB values, finite and > 0, one per stage (--stages {n})"
            )
        return [int(v * _GB) for v in vals]
    if args.vram_gb is not None:
        return [int(args.vram_gb * _GB)] * n
    if profile_vram:
        return [int(profile_vram)] * n
    raise ValueError(
        "--stages needs the devices' memory: pass --vram-gb G (every stage) or --stage-vram-gb G,G,... "
        "(no cached GPU profile exists)"
    )


def plan_split(shape: ModelShape, n: int, budgets, *, balance: str, offload, tflops: float):
    """(PipelineSplit, piece numbers) for the shape over n stages: the planner's split_pipeline."""
    nums = piece_numbers(shape, tflops)
    times = [f + b for f, b in zip(nums["fwd"], nums["bwd"])]
    split = split_pipeline(
        n,
        params=nums["params"],
        detail=nums["detail"],
        times=times,
        balance=balance,
        budgets=budgets,
        offload=offload,
    )
    return split, nums


def bubble(split: PipelineSplit, nums: dict, microbatches: int):
    """The default schedule simulated (simulate/pipeline.py) with each stage's forward and backward
    seconds per microbatch: its PipelinePrediction."""
    from ..simulate.pipeline import simulate_schedule

    tf = [sum(nums["fwd"][s.start : s.stop]) / microbatches for s in split.stages]
    tb = [sum(nums["bwd"][s.start : s.stop]) / microbatches for s in split.stages]
    return simulate_schedule(
        DEFAULT_SCHEDULE, stages=len(split.stages), microbatches=microbatches, tf=tf, tb=tb
    )


def streamed_reads(split: PipelineSplit, shape: ModelShape, nums: dict, microbatches: int) -> list:
    """Per stage, the bytes of weights its streamed (unpinned) pieces read over PCIe per step:
    (microbatch-major: a forward and a backward load per microbatch, chunk-major GPipe: one of
    each per step, Pipeline(offload_chunk_major=...)); None for a stage that streams nothing."""
    out = []
    for s in split.stages:
        st = s.streaming
        streamed = 0 if st is None else sum(
            nums["params"][s.start + i] for i in range(s.count) if i not in set(st.pinned)
        )  # fmt: skip
        b = streamed * shape.elem_bytes
        out.append(None if b == 0 else {"microbatch_major": 2 * microbatches * b, "chunk_major_gpipe": 2 * b})
    return out


def _pieces(names, s) -> str:
    return names[s.start] if s.count == 1 else f"{names[s.start]} .. {names[s.stop - 1]} ({s.count})"


def report(split: PipelineSplit, nums: dict, pred, reads=None) -> dict:
    """The JSON object `--json` prints under "pipeline"."""
    d = split.to_dict()
    d["streamed_reads_per_step"] = reads
    d["pieces"] = nums["names"]
    d["stage_pieces"] = [nums["names"][s.start : s.stop] for s in split.stages]
    d["bubble"] = {
        "schedule": pred.schedule,
        "microbatches": pred.microbatches,
        "bubble": pred.bubble,
        "makespan_s": pred.makespan,
        "busy_s": pred.busy,
    }
    return d


def text(shape: ModelShape, split: PipelineSplit, nums: dict, pred, reads=()) -> str:
    shares = split.shares()
    out = [
        f"{shape.name} ({shape.batch} x {shape.seq} tokens, {shape.dtype}) over {len(split.stages)} stages, "
        f"balanced by {split.balance}, "
        + ("stages streamed (Pipeline(offload=True))" if split.streamed else "stages resident")
    ]
    for s, share in zip(split.stages, shares):
        cap = "unlimited" if s.budget is None else f"{s.budget / _GB:.2f} GiB"
        line = (
            f"  stage {s.index}: {_pieces(nums['names'], s)}: parameters {s.param_bytes / _GB:.3f} GiB, "
            f"time {share:.1%}, device memory {s.device_bytes / _GB:.3f} GiB of {cap}"
        )
        if s.streaming is not None:
            st = s.streaming
            line += f", streamed: window {st.window}, pin {st.pin} {list(st.pinned)}"
        out.append(line)
    out.append(
        f"  bubble of the default schedule ({pred.schedule}, {pred.microbatches} microbatches): "
        f"{pred.bubble:.1%} (step {pred.makespan * 1e3:.1f} ms predicted)"
    )
    for s, r in zip(split.stages, reads):
        if r is not None:
            out.append(
                f"  stage {s.index} reads about {r['microbatch_major'] / _GB:.2f} GiB of weights per step microbatch by "
                f"microbatch, {r['chunk_major_gpipe'] / _GB:.2f} GiB chunk-major under gpipe (stages sharing a GPU "
                "run chunk-major by default: Pipeline(offload_chunk_major='auto'))"
            )
    out.append("why:")
    out.extend("  " + line for line in split.lines)
    return "\n".join(out)


def run(args, shape: ModelShape, profile_vram, err) -> int:
    """Prints the split (or why it cannot fit: exit code 2); `err(message)` prints a refusal."""
    n = args.stages
    if n < 1:
        return err(f"--stages must be an int >= 1, got {n}")
    if args.microbatches < 1:
        return err(f"--microbatches must be an int >= 1, got {args.microbatches}")
    pieces = len(shape.blocks) + 2
    if n > pieces:
        return err(
            f"--stages {n}: the model has {pieces} pieces (embedding, {len(shape.blocks)} blocks, head)"
        )
    try:
        budgets = budgets_of(args, n, profile_vram)
    except ValueError as e:
        return err(str(e))
    tflops = args.tflops or DEFAULT_RATES["matmul_tflops"]
    try:
        split, nums = plan_split(
            shape, n, budgets, balance=args.balance, offload=OFFLOAD_FLAGS[args.offload], tflops=tflops
        )
    except MemoryError as e:
        if args.json:
            print(json.dumps({"fits": False, "error": str(e)}, indent=2))
        return err(str(e))
    pred = bubble(split, nums, args.microbatches)
    reads = streamed_reads(split, shape, nums, args.microbatches)
    if args.json:
        print(json.dumps({"fits": True, "pipeline": report(split, nums, pred, reads)}, indent=2))
    else:
        print(text(shape, split, nums, pred, reads))
    return 0
