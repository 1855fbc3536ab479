"""Pipeline stages that share a device (Pipeline(devices=["cuda:0"] * 4), issue 28's P4 row).

simulate_pipeline gives every stage its own device: a stage's idle time is a bubble. When several
stages run on one GPU (or the CPU), what one stage leaves idle another fills, and ops that run at
the same time on one device slow each other down. The model here is processor sharing: a device
running n ops at once advances each at 1/n of its speed, so an op of cost t (its time alone on the
device) takes t while it runs alone and n*t while n run. The rest is simulate_pipeline's: each
stage runs its op list in order, one op at a time; F(mb, c) after F(mb, c-1), B(mb, c) after
B(mb, c+1) and F(mb, c), plus `comm` for a dependency on another stage.

exclusive_times() inverts the model: from measured op spans (start, end, device) it gives each
op's cost alone, the integral over its span of 1/(ops running on its device then). Fed back to
simulate_shared(), the costs of a simulated step give back its spans (tests/test_simulate_shared.py).
"""

from __future__ import annotations

from collections import Counter

from ..pipeline.schedule import Op, dependencies
from ._base import OpSpan, PipelinePrediction, _times, check_comm, prediction, schedule_ops

__all__ = ["exclusive_times", "shared_devices", "simulate_shared"]


def shared_devices(devices, stages: int) -> list | None:
    """`devices` (None, or one hashable label per stage) checked; None unless two stages share
    a label (then simulate_pipeline's model, one device per stage, is exact). ValueError naming
    `devices` for a wrong length or an unhashable label."""
    if devices is None:
        return None
    if isinstance(devices, (str, bytes)) or not hasattr(devices, "__len__") or len(devices) != stages:
        got = len(devices) if hasattr(devices, "__len__") and not isinstance(devices, str) else devices
        raise ValueError(f"simulate_schedule: devices must be one label per stage ({stages}), got {got!r}")
    try:
        labels = list(devices)
        distinct = len(set(labels))
    except TypeError:
        raise ValueError(f"simulate_schedule: devices must be hashable labels, got {devices!r}") from None
    return labels if distinct < stages else None


def simulate_shared(
    schedule,
    *,
    stages: int,
    microbatches: int,
    chunks_per_stage: int = 1,
    tf=1.0,
    tb=1.0,
    comm: float = 0.0,
    devices,
) -> PipelinePrediction:
    """One pipeline step whose stages run on `devices` (a label per stage; stages with one label
    share that device by processor sharing, the module docstring's model). tf / tb: an op's cost
    alone on its device (a number, or one per chunk). The prediction's busy[s] is the sum of stage
    s's op costs and its bubble the devices' idle share, 1 - sum(busy) / (devices * makespan).
    ValueError naming the argument for a bad value or schedule."""
    name, ops = schedule_ops(schedule, stages, microbatches, chunks_per_stage)
    chunks = stages * chunks_per_stage
    tf, tb = _times("tf", tf, chunks, "chunk"), _times("tb", tb, chunks, "chunk")
    check_comm(comm)
    if devices is None:
        raise ValueError(f"simulate_shared: devices must be one label per stage ({stages}), got None")
    dev = shared_devices(devices, stages) or list(devices)  # checked: length, hashable labels
    cost = {op: (tf if op.kind == "F" else tb)[op.chunk] for row in ops for op in row}
    tol = 1e-12 * max([1.0, *cost.values()])
    nxt = [0] * stages
    end: dict[Op, float] = {}
    start: dict[Op, float] = {}
    running: dict[int, list] = {}  # stage -> [op, cost left]
    spans: list[OpSpan] = []
    total = sum(len(row) for row in ops)
    t = 0.0
    while len(end) < total:
        later = []  # times at which a waiting op's inputs arrive
        for s in range(stages):
            if s in running or nxt[s] == len(ops[s]):
                continue
            op = ops[s][nxt[s]]
            deps = dependencies(op, chunks)
            if any(d not in end for d in deps):
                continue
            ready = max([0.0] + [end[d] + (comm if d.chunk % stages != s else 0.0) for d in deps])
            if ready <= t:
                running[s] = [op, cost[op]]
                start[op] = t
            else:
                later.append(ready)
        share = Counter(dev[s] for s in running)
        finish = [t + left * share[dev[s]] for s, (_, left) in running.items()]
        if not finish and not later:  # check() rules this out for a listed schedule
            raise ValueError("simulate_schedule: the schedule deadlocks")
        t_next = min(finish + later)
        for s in list(running):
            op, left = running[s]
            left -= (t_next - t) / share[dev[s]]
            if left <= tol:
                end[op] = t_next
                spans.append(OpSpan(s, op.kind, op.mb, op.chunk, start[op], t_next))
                del running[s]
                nxt[s] += 1
            else:
                running[s][1] = left
        t = t_next
    makespan = max((sp.end for sp in spans), default=0.0)
    busy = [sum(cost[op] for op in row) for row in ops]
    return prediction(name, stages, microbatches, chunks_per_stage, spans, busy, ops, len(set(dev)), makespan)


def exclusive_times(spans, devices) -> list[float]:
    """Each span's cost alone on its device under processor sharing: the integral over the span
    of 1 / (spans of its device covering that instant). spans: (stage, start, end) triples;
    devices: a label per stage. ValueError for a span that ends before it starts or whose stage
    has no label."""
    spans = [(int(s), float(a), float(b)) for s, a, b in spans]
    for s, a, b in spans:
        if not 0 <= s < len(devices):
            raise ValueError(
                f"exclusive_times: a span's stage {s} has no entry in devices ({len(devices)} stages)"
            )
        if not b >= a:
            raise ValueError(f"exclusive_times: a span of stage {s} ends ({b}) before it starts ({a})")
    dev = [devices[s] for s, _, _ in spans]
    out = [0.0] * len(spans)
    # a sweep over the span edges (ends before starts at one instant; empty spans cost 0)
    edges = sorted([(b, 0, i) for i, (_, a, b) in enumerate(spans) if b > a] +
                   [(a, 1, i) for i, (_, a, b) in enumerate(spans) if b > a])  # fmt: skip
    active: set[int] = set()
    last = None
    for t, starts, i in edges:
        if active and t > last:
            n = Counter(dev[j] for j in active)
            for j in active:
                out[j] += (t - last) / n[dev[j]]
        last = t
        (active.add if starts else active.discard)(i)
    return out
