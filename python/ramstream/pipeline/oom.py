"""A stage that runs out of device memory in Pipeline.step()/infer(): the error the caller gets
instead of the allocator's bare one (PipelineOutOfMemoryError, still a torch.OutOfMemoryError and a
MemoryError): where it happened, the schedule's arithmetic (how many microbatches' saved activations
each stage holds at once) and the device memory, and the changes that hold less. The step's own
rule (runtime.py) already left every weight, `.grad` and optimizer state as before it."""

from __future__ import annotations

import torch

from ..simulate.pipeline import peak_in_flight
from . import schedule as schedules

_GIB = 2**30


class PipelineOutOfMemoryError(torch.OutOfMemoryError, MemoryError):
    """A pipeline stage ran out of device memory; the message has the arithmetic (oom.py)."""


def _memory(devices) -> str:
    parts = []
    for d in dict.fromkeys(devices):  # each device once, in stage order
        if d.type == "cuda":
            now, peak = torch.cuda.memory_allocated(d), torch.cuda.max_memory_allocated(d)
            free, total = torch.cuda.mem_get_info(d)
            parts.append(
                f"{d}: {now / _GIB:.2f} GiB allocated after the failure, {peak / _GIB:.2f} GiB at the "
                f"process's peak, {free / _GIB:.2f} of {total / _GIB:.2f} GiB free on the device"
            )
    return "; ".join(parts)


def explain(error: BaseException, run, *, stages: int, chunks_per_stage: int, devices, paging: bool):
    """The PipelineOutOfMemoryError for `error` (a torch.OutOfMemoryError out of `run`, run.py's
    Run: its ops per stage and where it failed, run.failed_at = (stage, op) or None)."""
    n = run.n
    peaks = [peak_in_flight(row) for row in run.ops]
    where = ""
    if run.failed_at is not None:
        s, op = run.failed_at
        kind = "forward" if op.kind == "F" else "backward"
        where = f" stage {s} ({devices[s]}), the {kind} of microbatch {op.mb} through chunk {op.chunk}:"
    first = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
    lines = [f"Pipeline: out of device memory in{where} {first}"]
    if run.train:
        lines.append(
            f"the schedule holds up to {peaks} microbatches' saved activations per stage at once (stage 0 "
            f"first; {n} microbatches of the batch, each 1/{n} of it)"
        )
    mem = _memory(devices)
    if mem:
        lines.append(f"device memory: {mem}")
    hints = []
    if run.train:
        textbook = (
            [peak_in_flight(row) for row in schedules.build("1f1b", stages, n, 1)]
            if chunks_per_stage == 1
            else None
        )
        if textbook is not None and max(textbook) < max(peaks):
            hints.append(f'schedule="1f1b" holds at most {textbook} per stage instead of {peaks}')
        if not paging:
            hints.append("offload_activations=True pages the saved activations to host RAM")
        hints.append(
            "more microbatches (n_microbatches) make each smaller (under 1f1b the stages hold fewer "
            "than all of them)"
        )
    hints.append("a smaller batch, or a smaller offload_window for streamed stages")
    lines.append("what holds less: " + "; ".join(hints))
    lines.append("nothing changed: every weight, .grad and optimizer state is as before this call")
    return PipelineOutOfMemoryError("\n  ".join(lines))
