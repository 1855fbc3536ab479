"""The pipeline schedule simulator: when each stage runs each op of a schedule
(ramstream.pipeline.schedule), optionally with each stage's weights streamed from host RAM.

Dependencies (schedule.dependencies): F(mb, c) starts after F(mb, c-1) ends, B(mb, c) after
B(mb, c+1) and F(mb, c) end; a dependency on another stage adds `comm` (the activation or
gradient hop); a stage runs its list in order, one op at a time. Times are in any unit
(seconds, or 1 for "one forward").

Weight streaming (window=W, the `pipeline` subcommand) applies simulate/offload.py's model to
every stage at once, each with its own copy engine: a chunk is `layers` layer pieces (units),
and a stage walks its units in a known order (a forward through chunk c: its units 0..L-1; a
backward: L-1..0). W is the device slots for streamed units, the running one included; at each
unit's hook the stage loads the next W streamed units of its walk not loaded yet (one at a time
on its copy lane, each no earlier than the compute issued before the hook: the evicted units'
memory is free then), evicting the loaded ones used farthest ahead; a unit's compute waits for
its load. `pin` evenly spaced units per stage stay resident (offload.pinned_chunks) and, as in
offload.py, load nothing at their hooks. After a
backward through a streamed unit its gradients go home on the stage's D2H lane (td2h each).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ..pipeline.schedule import Op, build, canonical, check, dependencies, execution_order
from .offload import pinned_chunks


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


def _times(name: str, value, n: int, what: str) -> list[float]:
    """`value` (a number, or one per `what`) as n finite floats >= 0; ValueError naming `name`."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        vals = [float(value)] * n
    else:
        try:
            vals = [float(v) for v in value]
        except (TypeError, ValueError):
            raise ValueError(f"simulate_pipeline: {name} must be a number or one per {what}") from None
        if len(vals) != n:
            raise ValueError(f"simulate_pipeline: {name} has {len(vals)} values for {n} {what}s")
    bad = [v for v in vals if not 0.0 <= v < float("inf")]
    if bad:
        raise ValueError(f"simulate_pipeline: {name} must be finite and >= 0, got {bad[0]!r}")
    return vals


def peak_in_flight(ops: list[Op]) -> int:
    """The most forwards of a stage's op list whose backward has not run yet (a stage runs one op
    at a time, so this depends on the order only)."""
    now = peak = 0
    for op in ops:
        now += 1 if op.kind == "F" else -1
        peak = max(peak, now)
    return peak


class _Stage:
    """One stage's lanes: compute, and with streaming its H2D and D2H copy lanes."""

    def __init__(self, s, ops, layers, tf, tb, stream=None):
        self.s, self.layers, self.tf, self.tb = s, layers, tf, tb
        self.compute = self.copy = self.d2h = 0.0
        self.busy = self.h2d_busy = 0.0
        self.copies: list[CopySpan] = []
        self.pieces: list[OpSpan] = []
        self.stream = stream  # None, or (window, pinned units, th2d per unit, td2h per unit, stages)
        if stream is not None:
            # the walk: (unit, global layer index) in the order the stage computes them
            p = stream[4]
            self.walk = []
            for op in ops:
                j = op.chunk // p
                order = range(layers) if op.kind == "F" else range(layers - 1, -1, -1)
                self.walk += [(j * layers + u, op.chunk * layers + u) for u in order]
            self.pos = 0
            self.loaded: dict[int, float] = {}  # unit -> load end
            # after[i]: the walk position where walk[i]'s unit is next used (len: never again)
            self.after = [len(self.walk)] * len(self.walk)
            last: dict[int, int] = {}
            for i in range(len(self.walk) - 1, -1, -1):
                u = self.walk[i][0]
                self.after[i] = last.get(u, len(self.walk))
                last[u] = i
            self.next_use = last  # unit -> its next use at or after self.pos

    def run(self, op: Op, ready: float) -> tuple[float, float]:
        """Runs `op` no earlier than `ready`; returns its (start, end)."""
        cost = self.tf if op.kind == "F" else self.tb
        start = ready
        for u in range(self.layers):
            t = cost[op.chunk * self.layers + u]
            begin = max(self.compute, ready)
            if self.stream is not None:
                begin = max(begin, self._hook())
            start = begin if u == 0 else start
            self.compute = begin + t
            self.busy += t
            if self.layers > 1:
                self.pieces.append(OpSpan(self.s, op.kind, op.mb, op.chunk, begin, self.compute))
            if self.stream is not None:
                self._write(op.kind)
                self.next_use[self.walk[self.pos][0]] = self.after[self.pos]
                self.pos += 1
        return start, self.compute

    def _hook(self) -> float:
        """Loads at the current unit's hook; returns when the unit's weights are on the device."""
        window, pinned, th2d, _, _ = self.stream
        unit = self.walk[self.pos][0]
        if unit in pinned:
            return 0.0
        want: list[tuple[int, int]] = []
        keep: set[int] = set()
        for i in range(self.pos, len(self.walk)):
            u, gu = self.walk[i]
            if u not in pinned and u not in keep:
                want.append((u, gu))
                keep.add(u)
                if len(want) == window:
                    break
        for u, gu in want:
            if u in self.loaded:
                continue
            if len(self.loaded) >= window:  # evict the one used farthest ahead (never in `want`)
                del self.loaded[max((x for x in self.loaded if x not in keep), key=self.next_use.get)]
            begin = max(self.copy, self.compute)
            self.copy = begin + th2d[gu]
            self.h2d_busy += th2d[gu]
            self.loaded[u] = self.copy
            self.copies.append(CopySpan(self.s, "h2d", u, begin, self.copy))
        return self.loaded[unit]

    def _write(self, kind: str) -> None:
        _, pinned, _, td2h, _ = self.stream
        unit, g = self.walk[self.pos]
        if kind == "B" and unit not in pinned and td2h[g] > 0:
            begin = max(self.d2h, self.compute)
            self.d2h = begin + td2h[g]
            self.copies.append(CopySpan(self.s, "d2h", unit, begin, self.d2h))


def simulate_pipeline(
    schedule,
    *,
    stages: int,
    microbatches: int,
    chunks_per_stage: int = 1,
    tf=1.0,
    tb=1.0,
    comm: float = 0.0,
    layers: int = 1,
    window: int | None = None,
    th2d=0.0,
    td2h=0.0,
    pin: int = 0,
) -> PipelinePrediction:
    """Simulates one pipeline step.

    Args:
        schedule: a schedule name (schedule.NAMES) or per-stage op lists (checked with
            schedule.check; their backwards may come in any order).
        stages, microbatches, chunks_per_stage: as schedule.build's.
        tf, tb: the forward / backward time of one layer piece: a number, or one per piece in
            model order (stages * chunks_per_stage * layers; with layers=1, one per chunk).
        comm: the time of an activation or gradient hop between two stages.
        layers: layer pieces (streaming units) per chunk; an op through a chunk runs them all.
        window: streaming slots per stage, the running unit included (None: weights resident,
            no copies); th2d / td2h: a piece's load and gradient write-back time (a number or
            one per piece); pin: evenly spaced pieces per stage kept resident.
    ValueError naming the argument for a bad value or schedule.
    """
    if isinstance(schedule, str):
        name = canonical(schedule)
        ops = build(schedule, stages, microbatches, chunks_per_stage)
    else:
        name = "custom"
        check(schedule, stages, microbatches, chunks_per_stage, ordered_backward=False)
        ops = [[Op(*op) for op in row] for row in schedule]
    if isinstance(layers, bool) or not isinstance(layers, int) or layers < 1:
        raise ValueError(f"simulate_pipeline: layers must be an int >= 1, got {layers!r}")
    chunks = stages * chunks_per_stage
    n = chunks * layers
    what = "chunk" if layers == 1 else "layer piece"
    tf, tb = _times("tf", tf, n, what), _times("tb", tb, n, what)
    if isinstance(comm, bool) or not isinstance(comm, (int, float)) or not 0.0 <= comm < float("inf"):
        raise ValueError(f"simulate_pipeline: comm must be a finite time >= 0, got {comm!r}")
    stream = None
    pinned: set[int] = set()
    if window is not None:
        if isinstance(window, bool) or not isinstance(window, int) or window < 1:
            raise ValueError(f"simulate_pipeline: window must be an int >= 1 or None, got {window!r}")
        units = chunks_per_stage * layers
        try:
            pinned = pinned_chunks(pin, None, units)
        except ValueError:
            raise ValueError(
                f"simulate_pipeline: pin must be an int in [0, {units}] (layer pieces per stage), got {pin!r}"
            ) from None
        stream = (window, pinned, _times("th2d", th2d, n, what), _times("td2h", td2h, n, what), stages)
    elif pin:
        raise ValueError("simulate_pipeline: pin needs window (streamed weights)")
    lanes = [_Stage(s, ops[s], layers, tf, tb, stream) for s in range(stages)]
    end: dict[Op, float] = {}
    spans = []
    for s, op in execution_order(ops, chunks):
        ready = 0.0
        for d in dependencies(op, chunks):
            ready = max(ready, end[d] + (comm if d.chunk % stages != s else 0.0))
        start, end[op] = lanes[s].run(op, ready)
        spans.append(OpSpan(s, op.kind, op.mb, op.chunk, start, end[op]))
    copies = [c for lane in lanes for c in lane.copies]
    makespan = max([sp.end for sp in spans] + [c.end for c in copies])
    busy = [lane.busy for lane in lanes]
    return PipelinePrediction(
        schedule=name,
        stages=stages,
        microbatches=microbatches,
        chunks_per_stage=chunks_per_stage,
        makespan=makespan,
        busy=busy,
        bubble=1.0 - sum(busy) / (stages * makespan) if makespan > 0 else 0.0,
        peak_in_flight=[peak_in_flight(row) for row in ops],
        window=window,
        layers=layers,
        pinned=tuple(sorted(pinned)),
        h2d_busy=[lane.h2d_busy for lane in lanes] if stream else [],
        spans=spans,
        copies=copies,
        pieces=[sp for lane in lanes for sp in lane.pieces],
    )


def simulate_schedule(
    schedule, *, stages: int, microbatches: int, chunks_per_stage: int = 1, tf=1.0, tb=1.0, comm=0.0
) -> PipelinePrediction:
    """simulate_pipeline with resident weights: each op through chunk c costs tf[c] / tb[c] (a
    number, or one per chunk)."""
    return simulate_pipeline(
        schedule,
        stages=stages,
        microbatches=microbatches,
        chunks_per_stage=chunks_per_stage,
        tf=tf,
        tb=tb,
        comm=comm,
    )


def window_table(schedule, *, windows=None, **kw) -> list[PipelinePrediction]:
    """simulate_pipeline with resident weights, then for every window in `windows` (default
    1 .. the streamed pieces per stage: a larger window changes nothing)."""
    units = kw.get("chunks_per_stage", 1) * kw.get("layers", 1)
    base = {k: v for k, v in kw.items() if k not in ("th2d", "td2h", "pin")}
    rows = [simulate_pipeline(schedule, **base)]
    streamed = max(1, units - int(kw.get("pin", 0) or 0))
    return rows + [simulate_pipeline(schedule, window=w, **kw) for w in (windows or range(1, streamed + 1))]
