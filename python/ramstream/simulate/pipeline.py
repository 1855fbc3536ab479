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

chunk_major=True (with streaming, one chunk per stage) models the runtime's chunk-major runs
(Pipeline(offload_chunk_major=True), pipeline/chunk_major.py): consecutive forwards (or backwards)
of a stage form one run (a backward run only when all its forwards ran in runs of two or more, as
the runtime's tapes decide), which starts when all its inputs are there and walks each unit over
all its microbatches while the unit is loaded; every op of a run ends with the run (the runtime
hands the outputs on then); a backward run over every microbatch sends each unit's gradients home
once, after its last microbatch.
"""

from __future__ import annotations

from ..pipeline.chunk_major import batches
from ..pipeline.schedule import Op, dependencies, execution_order
from ._base import (
    CopySpan,
    OpSpan,
    PipelinePrediction,
    _times,
    check_comm,
    peak_in_flight,
    prediction,
    schedule_ops,
)
from .offload import pinned_chunks
from .shared import shared_devices, simulate_shared

__all__ = [
    "CopySpan",
    "OpSpan",
    "PipelinePrediction",
    "peak_in_flight",
    "simulate_pipeline",
    "simulate_schedule",
    "window_table",
]


class _Stage:
    """One stage's lanes: compute, and with streaming its H2D and D2H copy lanes."""

    def __init__(self, s, runs, layers, tf, tb, stream=None):
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
            for run in runs:  # a run of several ops walks each unit over all of them in a row
                j, c = run[0].chunk // p, run[0].chunk
                order = range(layers) if run[0].kind == "F" else range(layers - 1, -1, -1)
                self.walk += [(j * layers + u, c * layers + u) for u in order for _ in run]
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
        return self.run_group([op], ready, once=False)[op]

    def run_group(self, run: list, ready: float, *, once: bool) -> dict:
        """Runs the ops of `run` (one chunk, one kind) unit by unit, each unit over all of them,
        no earlier than `ready`; once: a unit's gradients go home after its last op only. Returns
        {op: (start, end)}, every op ending with the run."""
        kind, chunk = run[0].kind, run[0].chunk
        cost = self.tf if kind == "F" else self.tb
        order = range(self.layers) if kind == "F" else range(self.layers - 1, -1, -1)  # the walk's
        starts: dict = {}
        for u in order:
            t = cost[chunk * self.layers + u]
            for k, op in enumerate(run):
                begin = max(self.compute, ready)
                if self.stream is not None:
                    begin = max(begin, self._hook())
                starts.setdefault(op, begin)
                self.compute = begin + t
                self.busy += t
                if self.layers > 1:
                    self.pieces.append(OpSpan(self.s, op.kind, op.mb, op.chunk, begin, self.compute))
                if self.stream is not None:
                    if not once or k == len(run) - 1:
                        self._write(kind)
                    self.next_use[self.walk[self.pos][0]] = self.after[self.pos]
                    self.pos += 1
        return {op: (starts[op], self.compute) for op in run}

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
    chunk_major: bool = False,
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
        chunk_major: runs of a stage's consecutive forwards (backwards) walk each unit over all
            their microbatches (the runtime's offload_chunk_major; needs window, one chunk per
            stage): the module docstring has the rules.
    ValueError naming the argument for a bad value or schedule.
    """
    name, ops = schedule_ops(schedule, stages, microbatches, chunks_per_stage)
    if isinstance(layers, bool) or not isinstance(layers, int) or layers < 1:
        raise ValueError(f"simulate_pipeline: layers must be an int >= 1, got {layers!r}")
    chunks = stages * chunks_per_stage
    n = chunks * layers
    what = "chunk" if layers == 1 else "layer piece"
    tf, tb = _times("tf", tf, n, what), _times("tb", tb, n, what)
    check_comm(comm)
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
    if not isinstance(chunk_major, bool):
        raise ValueError(f"simulate_pipeline: chunk_major must be a bool, got {chunk_major!r}")
    if chunk_major and (window is None or chunks_per_stage != 1):
        raise ValueError(
            "simulate_pipeline: chunk_major needs window (streamed weights) and chunks_per_stage=1, as the runtime"
        )
    runs = [_runs(row, microbatches) if chunk_major else [[op] for op in row] for row in ops]
    lanes = [_Stage(s, runs[s], layers, tf, tb, stream) for s in range(stages)]
    end: dict[Op, float] = {}
    spans = []
    for s, run in _run_order(ops, runs, chunks):
        ready = 0.0
        for d in (d for op in run for d in dependencies(op, chunks)):
            ready = max(ready, end[d] + (comm if d.chunk % stages != s else 0.0))
        once = len(run) > 1 and run[0].kind == "B" and len(run) == microbatches
        for op, (start, end[op]) in lanes[s].run_group(run, ready, once=once).items():
            spans.append(OpSpan(s, op.kind, op.mb, op.chunk, start, end[op]))
    copies = [c for lane in lanes for c in lane.copies]
    makespan = max([sp.end for sp in spans] + [c.end for c in copies])
    busy = [lane.busy for lane in lanes]
    return prediction(
        name,
        stages,
        microbatches,
        chunks_per_stage,
        spans,
        busy,
        ops,
        stages,
        makespan,
        window=window,
        layers=layers,
        pinned=tuple(sorted(pinned)),
        h2d_busy=[lane.h2d_busy for lane in lanes] if stream else [],
        copies=copies,
        pieces=[sp for lane in lanes for sp in lane.pieces],
    )


def _runs(row: list, microbatches: int) -> list[list]:
    """A stage's op list cut into the runtime's chunk-major runs (pipeline/chunk_major.py): a
    backward run stays one run only when every one of its forwards ran in a run of two or more
    (the runtime's tapes); else its ops run one by one."""
    runs = batches(row, lambda op: True)
    taped = {(op.chunk, op.mb) for r in runs if r[0].kind == "F" and len(r) > 1 for op in r}
    out = []
    for r in runs:
        if r[0].kind == "B" and len(r) > 1 and not all((op.chunk, op.mb) in taped for op in r):
            out += [[op] for op in r]
        else:
            out.append(r)
    return out


def _run_order(ops, runs, chunks: int) -> list:
    """(stage, run) pairs in an order that runs each run after every dependency of its ops: the
    ops' execution_order when every run is one op, else run by run as their inputs are done."""
    if all(len(r) == 1 for row in runs for r in row):
        return [(s, [op]) for s, op in execution_order(ops, chunks)]
    order, done, nxt = [], set(), [0] * len(runs)
    while any(nxt[s] < len(runs[s]) for s in range(len(runs))):
        moved = False
        for s, row in enumerate(runs):
            if nxt[s] < len(row) and all(d in done for op in row[nxt[s]] for d in dependencies(op, chunks)):
                order.append((s, row[nxt[s]]))
                done.update(row[nxt[s]])
                nxt[s] += 1
                moved = True
        if not moved:  # cannot happen for one chunk per stage (pipeline/chunk_major.py)
            raise ValueError("simulate_pipeline: the chunk-major runs deadlock")
    return order


def simulate_schedule(
    schedule,
    *,
    stages: int,
    microbatches: int,
    chunks_per_stage: int = 1,
    tf=1.0,
    tb=1.0,
    comm=0.0,
    devices=None,
) -> PipelinePrediction:
    """simulate_pipeline with resident weights: each op through chunk c costs tf[c] / tb[c] (a
    number, or one per chunk). devices: None (each stage its own device), or a label per stage;
    stages with one label share that device (simulate/shared.py: ops running at once on it
    share its speed, tf / tb being an op's time alone on it)."""
    labels = shared_devices(devices, stages)
    if labels is not None:
        return simulate_shared(
            schedule,
            stages=stages,
            microbatches=microbatches,
            chunks_per_stage=chunks_per_stage,
            tf=tf,
            tb=tb,
            comm=comm,
            devices=labels,
        )
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
    base = {k: v for k, v in kw.items() if k not in ("th2d", "td2h", "pin", "chunk_major")}
    rows = [simulate_pipeline(schedule, **base)]
    streamed = max(1, units - int(kw.get("pin", 0) or 0))
    return rows + [simulate_pipeline(schedule, window=w, **kw) for w in (windows or range(1, streamed + 1))]
