"""Per-chunk times for the simulator from a real step: the spans of a ramstream trace (the
OffloadModel.step(profile_path=...) JSON, or a live Tracer), as simulate_offload's arguments."""

from __future__ import annotations

import json
import os
import re
import tempfile

_NAME = re.compile(r"^(forward|backward|load) (\d+)$")


def times_from_trace(trace, *, keep_activations=True) -> dict:
    """{"layers", "tf", "tb", "th2d", "td2h"} from a trace (a path, or the parsed JSON).

    Each chunk's forward and backward are the mean of its spans; with keep_activations False or
    "checkpoint" the backward span includes the recompute, so tb is it less the forward. th2d is
    the mean of the chunk's load spans; a chunk never loaded (pinned) gets the mean of the others
    (the simulator loads no pinned chunk). td2h is the chunk's D2H spans per backward."""
    if isinstance(trace, (str, os.PathLike)):
        with open(trace) as f:
            trace = json.load(f)
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    acc: dict = {"forward": {}, "backward": {}, "load": {}}
    d2h: dict = {}
    for ev in events:
        if ev.get("ph") != "X":
            continue
        m = _NAME.match(ev.get("name", ""))
        if m:
            acc[m.group(1)].setdefault(int(m.group(2)), []).append(ev["dur"] * 1e-6)
        elif ev.get("cat") == "d2h" and "chunk" in ev.get("args", {}):
            d2h.setdefault(int(ev["args"]["chunk"]), []).append(ev["dur"] * 1e-6)
    if not acc["forward"]:
        raise ValueError(
            "times_from_trace: the trace has no 'forward <chunk>' spans (trace an OffloadModel step)"
        )
    n = max(acc["forward"]) + 1
    missing = [k for k in range(n) if k not in acc["forward"] or k not in acc["backward"]]
    if missing:
        raise ValueError(f"times_from_trace: chunks {missing} have no forward or backward span")

    def mean(v):
        return sum(v) / len(v)

    tf = [mean(acc["forward"][k]) for k in range(n)]
    tb = [mean(acc["backward"][k]) for k in range(n)]
    if keep_activations is not True:
        tb = [max(0.0, b - f) for b, f in zip(tb, tf)]
    loads = acc["load"]
    avg = mean([mean(v) for v in loads.values()]) if loads else 0.0
    th2d = [mean(loads[k]) if k in loads else avg for k in range(n)]
    passes = max(1, len(acc["backward"][0]))
    td2h = [sum(d2h.get(k, [])) / passes for k in range(n)]
    return {"layers": n, "tf": tf, "tb": tb, "th2d": th2d, "td2h": td2h}


def measure_step(model, x, **step_kw) -> dict:
    """Runs model.step(x, **step_kw) (an OffloadModel) under a trace and returns its per-chunk
    times (times_from_trace) plus "step_s", the step's wall time."""
    fd, path = tempfile.mkstemp(suffix=".json", prefix="ramstream-measure-")
    os.close(fd)
    try:
        import time

        t0 = time.perf_counter()
        model.step(x, profile_path=path, **step_kw)
        wall = time.perf_counter() - t0
        out = times_from_trace(path, keep_activations=model.keep_activations)
    finally:
        os.unlink(path)
    out["step_s"] = wall
    return out
