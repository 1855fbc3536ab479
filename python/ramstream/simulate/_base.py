"""What the pipeline simulators share (pipeline.py: a device per stage; shared.py: stages that
share a device): the spans and the prediction they return, the schedule's op lists, and the
checks of their arguments."""

from __future__ import annotations

from dataclasses import dataclass, field

from ..pipeline.schedule import Op, build, canonical, check

__all__ = ["CopySpan", "OpSpan", "PipelinePrediction", "check_comm", "peak_in_flight", "schedule_ops"]


@dataclass(frozen=True)
class OpSpan:
    """One op on one stage: kind "F" or "B", microbatch, chunk, start and end time."""

    stage: int
    kind: str
    mb: int
    chunk: int
    start: float
    end: float


@dataclass(frozen=True)
class CopySpan:
    """One copy on a stage's lane ("h2d": a unit's weights in; "d2h": its gradients out); `unit`
    is the stage's unit index (local chunk * layers + layer)."""

    stage: int
    lane: str
    unit: int
    start: float
    end: float


@dataclass
class PipelinePrediction:
    """A simulated pipeline step.

    makespan: when the last op (or copy) ends. busy[s]: stage s's compute time. bubble: the idle
    share of the stages' compute, 1 - sum(busy) / (stages * makespan). peak_in_flight[s]: the most
    (microbatch, chunk) forwards on stage s whose backward has not ended (saved activations; with
    one chunk per stage, microbatches). window: streaming slots per stage (None: resident
    weights). h2d_busy[s]: stage s's load time. spans: every op, from its first piece's start
    to its last piece's end; pieces (with layers > 1): every piece's compute, as OpSpans
    (an op's pieces may wait for their loads in between); copies: every copy."""

    schedule: str
    stages: int
    microbatches: int
    chunks_per_stage: int
    makespan: float
    busy: list
    bubble: float
    peak_in_flight: list
    window: int | None = None
    layers: int = 1
    pinned: tuple = ()
    h2d_busy: list = field(default_factory=list)
    spans: list = field(default_factory=list)
    copies: list = field(default_factory=list)
    pieces: list = field(default_factory=list)

    def row(self) -> dict:
        """The summary as a JSON-ready dict (no spans)."""
        return {
            "schedule": self.schedule,
            "stages": self.stages,
            "microbatches": self.microbatches,
            "chunks_per_stage": self.chunks_per_stage,
            "window": self.window,
            "makespan": self.makespan,
            "bubble": self.bubble,
            "busy": self.busy,
            "peak_in_flight": self.peak_in_flight,
            "h2d_busy": self.h2d_busy,
        }


def _times(name: str, value, n: int, what: str, where: str = "simulate_pipeline") -> list[float]:
    """`value` (a number, or one per `what`) as n finite floats >= 0; ValueError naming `where`
    and `name`."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        vals = [float(value)] * n
    else:
        try:
            vals = [float(v) for v in value]
        except (TypeError, ValueError):
            raise ValueError(f"{where}: {name} must be a number or one per {what}") from None
        if len(vals) != n:
            raise ValueError(f"{where}: {name} has {len(vals)} values for {n} {what}s")
    bad = [v for v in vals if not 0.0 <= v < float("inf")]
    if bad:
        raise ValueError(f"{where}: {name} must be finite and >= 0, got {bad[0]!r}")
    return vals


def prediction(
    name: str,
    stages: int,
    microbatches: int,
    chunks_per_stage: int,
    spans: list,
    busy: list,
    ops: list,
    devices: int,
    makespan: float,
    **extra,
) -> PipelinePrediction:
    """A PipelinePrediction of a simulated step: the bubble is the idle share of `devices` devices
    (one per stage, or fewer where stages share one) over the makespan."""  # fmt: skip
    return PipelinePrediction(
        schedule=name,
        stages=stages,
        microbatches=microbatches,
        chunks_per_stage=chunks_per_stage,
        makespan=makespan,
        busy=busy,
        bubble=1.0 - sum(busy) / (devices * makespan) if makespan > 0 else 0.0,
        peak_in_flight=[peak_in_flight(row) for row in ops],
        spans=spans,
        **extra,
    )


def schedule_ops(schedule, stages: int, microbatches: int, chunks_per_stage: int) -> tuple[str, list]:
    """(name, per-stage op lists) of a schedule name (built) or of given op lists (checked: every
    op once, on its stage, no deadlock; backwards in any order; "custom")."""
    if isinstance(schedule, str):
        return canonical(schedule), build(schedule, stages, microbatches, chunks_per_stage)
    check(schedule, stages, microbatches, chunks_per_stage, ordered_backward=False)
    return "custom", [[Op(*op) for op in row] for row in schedule]


def check_comm(comm) -> None:
    """ValueError naming comm unless it is a finite time >= 0."""
    if isinstance(comm, bool) or not isinstance(comm, (int, float)) or not 0.0 <= comm < float("inf"):
        raise ValueError(f"simulate_pipeline: comm must be a finite time >= 0, got {comm!r}")


def peak_in_flight(ops: list[Op]) -> int:
    """The most forwards of a stage's op list whose backward has not run yet (a stage runs one op
    at a time, so this depends on the order only)."""
    now = peak = 0
    for op in ops:
        now += 1 if op.kind == "F" else -1
        peak = max(peak, now)
    return peak
