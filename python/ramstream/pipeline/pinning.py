"""Pipeline.set_offload_pinned (RamTorch 1.11's broadcasting set_pinned): which chunks of the
streamed stages stay resident, changed between steps. Every stage's spec is checked and its
device bytes weighed against its budget (the planner's arithmetic: pinned_streaming) before
anything moves; then each stage re-pins (StreamedStage.set_pinned: weights, `.grad` and
optimizer state kept bit for bit, nothing reset) and `offload_plan` follows.

"Stage" here is an entry of `pipe.modules` (RamTorch's stage_modules entry): the stage itself when
chunks_per_stage is 1, one of its pieces otherwise.
"""

from __future__ import annotations

import numbers
import operator

import torch

from ..blocks import spaced
from ..frontends.offload_model.ramtorch import follow_params
from ..planner.pipeline_split import pinned_streaming
from .split import piece_bytes
from .streamed import StreamedStage

__all__ = ["FORMS", "resolve", "set_offload_pinned"]

WHERE = "Pipeline.set_offload_pinned"
FORMS = (
    "an int (a count of evenly spaced chunks) or a set/frozenset of chunk indices (for every "
    "streamed stage), a list/tuple with one entry per stage (a count, a list of chunk indices, or "
    "None: left alone), or a dict {stage index: count or chunk indices}"
)


def _count(v) -> bool:
    return isinstance(v, numbers.Integral) and not isinstance(v, bool)


def _indices(spec, n: int, where: str) -> frozenset:
    """One stage's spec (a count or an iterable of chunk indices) for a stage of n chunks: the
    chunk indices to pin (a count: evenly spaced, as offload_pin). TypeError / ValueError."""
    if isinstance(spec, bool):
        raise TypeError(f"{where} must be a count or chunk indices, got a bool; the accepted forms: {FORMS}")
    if _count(spec):
        if not 0 <= spec <= n:
            raise ValueError(f"{where}: a count must be in [0, {n}] (the stage's chunks), got {spec}")
        return frozenset(spaced(int(spec), n))
    if isinstance(spec, (str, bytes, dict)) or not hasattr(spec, "__iter__"):
        raise TypeError(
            f"{where} must be a count or chunk indices, got {type(spec).__name__}; the accepted forms: {FORMS}"
        )
    idx = set()
    for i in spec:
        if isinstance(i, bool) or not _count(i):
            raise TypeError(f"{where}: chunk indices must be ints, got {type(i).__name__} {i!r}")
        idx.add(operator.index(i))
    bad = sorted(i for i in idx if not 0 <= i < n)
    if bad:
        raise ValueError(f"{where}: chunk indices must be in [0, {n}) (the stage's chunks), got {bad}")
    return frozenset(idx)


def resolve(modules, pinned) -> dict[int, frozenset]:
    """{stage index: the chunk indices to pin} of the stages `pinned` names (see FORMS), every
    spec checked against its stage (`modules`: pipe.modules). Raises before anything changes."""
    streamed = {c: m for c, m in enumerate(modules) if isinstance(m, StreamedStage)}
    total = len(modules)
    if not streamed:
        raise ValueError(
            f"{WHERE}: the pipeline has no streamed stages (build it with chunked stage_modules or "
            "chunk_modules and offload=True)"
        )
    if isinstance(pinned, dict):
        for k in pinned:
            if not _count(k):
                raise TypeError(
                    f"{WHERE}: pinned's keys must be stage indices (ints), got {k!r}; the accepted forms: {FORMS}"
                )
            if not 0 <= k < total:
                raise ValueError(f"{WHERE}: pinned names stage {k}; the pipeline has stages 0-{total - 1}")
        spec = {int(k): v for k, v in pinned.items() if v is not None}
    elif isinstance(pinned, (list, tuple)):
        if len(pinned) != total:
            raise ValueError(
                f"{WHERE}: pinned as a list/tuple has one entry per stage: {len(pinned)} entries for "
                f"{total} stages (a set broadcasts chunk indices to every streamed stage)"
            )
        spec = {i: v for i, v in enumerate(pinned) if v is not None}
    elif isinstance(pinned, (set, frozenset)) or (_count(pinned)):
        spec = dict.fromkeys(streamed, pinned)
    else:
        raise TypeError(f"{WHERE}: pinned must be {FORMS}; got {type(pinned).__name__}")
    resident = sorted(k for k in spec if k not in streamed)
    if resident:
        raise ValueError(
            f"{WHERE}: pinned gives a spec for stage(s) {resident}, which are resident (not streamed): give "
            f"None for them (the streamed stages are {sorted(streamed)})"
        )
    return {k: _indices(v, len(streamed[k].parts), f"{WHERE}: pinned[{k}]") for k, v in sorted(spec.items())}


def _optimizers(optimizers) -> list:
    if isinstance(optimizers, torch.optim.Optimizer):
        return [optimizers]
    if isinstance(optimizers, (str, bytes)) or not hasattr(optimizers, "__iter__"):
        raise TypeError(
            f"{WHERE}: optimizers must be a torch optimizer or an iterable of them, got {type(optimizers).__name__}"
        )
    opts = list(optimizers)
    bad = [type(o).__name__ for o in opts if not isinstance(o, torch.optim.Optimizer)]
    if bad:
        raise TypeError(f"{WHERE}: optimizers must be torch.optim.Optimizers, got {bad}")
    return opts


def _summary(st: StreamedStage, before: list, change, plan) -> dict:
    to_pin, to_unpin, moved = change
    pinned = [p for i in st.pinned for p in st.parts[i].parameters()]
    return {
        "pinned": to_pin,
        "unpinned": to_unpin,
        "bytes_moved": sum(p.nbytes for p in moved),
        "grads_discarded": False,
        "pinned_before": before,
        "pinned_after": list(st.pinned),
        "device": str(st.device),
        "resident_bytes": sum(p.nbytes for p in pinned),
        "resident_grad_bytes": sum(p.grad.nbytes for p in pinned if p.grad is not None),
        "streamed_bytes": st.streamer.home_bytes()["streamed_bytes"],
        "device_bytes": plan.device_bytes,
        "budget": plan.budget,
        "plan": plan,
    }


def set_offload_pinned(pipe, pinned, *, optimizers=(), force: bool = False) -> dict:
    """Pipeline.set_offload_pinned (runtime.py documents it): checked, weighed, then applied;
    {stage index: summary}. Holds the pipeline's lock: refused while a step(), infer() or an
    infer_open() stream runs."""
    pipe._check_open()
    if not isinstance(force, bool):
        raise TypeError(f"{WHERE}: force must be a bool, got {type(force).__name__}")
    if pipe._host_opt is not None:
        raise ValueError(
            f"{WHERE}: not with the host optimizer attached (its buckets live where the chunks do); close it first"
        )
    opts = _optimizers(optimizers)
    if not pipe._lock.acquire(blocking=False):
        raise RuntimeError(
            f"{WHERE}: a step() or infer() is running, or an infer_open() stream is open; re-pin between "
            "steps (after step() returned, with no stream open)"
        )
    try:
        modules = pipe.modules
        want = resolve(modules, pinned)
        order = [c for c, m in enumerate(modules) if isinstance(m, StreamedStage)]
        plans = {}
        for c, idx in want.items():
            old = pipe.offload_plan[order.index(c)]
            chunks = [piece_bytes(m) for m in modules[c].parts]
            plans[c] = pinned_streaming(chunks, idx, old.window, old.budget, stage=c, force=force)
        done = []
        try:
            for c, idx in want.items():
                st = modules[c]
                before = list(st.pinned)
                done.append((c, before, st.set_pinned(idx)))
        except BaseException:
            for c, before, _ in reversed(done):  # the stages already re-pinned go back
                modules[c].set_pinned(before)
            raise
        follow_params(opts, [p for _, _, ch in done for p in ch[2]])
        out = {}
        for c, before, change in done:
            pipe.offload_plan[order.index(c)] = plans[c]
            out[c] = _summary(modules[c], before, change, plans[c])
        return out
    finally:
        pipe._lock.release()
