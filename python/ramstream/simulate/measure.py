"""Per-chunk times for the simulator from a real step: the spans of a ramstream trace (the
OffloadModel.step(profile_path=...) JSON, or a live Tracer), as simulate_offload's arguments."""

from __future__ import annotations

import math
import os
import re
import tempfile

from .._paths import read_json

_NAME = re.compile(r"^(forward|backward|load) (\d+)$")


def times_from_trace(trace, *, keep_activations=True) -> dict:
    """{"layers", "tf", "tb", "th2d", "td2h"} from a trace (a path, or the parsed JSON).

    Each chunk's forward and backward are the mean of its spans; with keep_activations False or
    "checkpoint" the backward span includes the recompute, so tb is it less the forward. th2d is
    the mean of the chunk's load spans; a chunk never loaded (pinned) gets the mean of the others
    (the simulator loads no pinned chunk). td2h is the chunk's D2H spans per backward."""
    where = "times_from_trace"
    if isinstance(trace, (str, os.PathLike)):
        where = f"times_from_trace: {os.fspath(trace)!r}"
        trace = read_json(trace, "trace")
    events = trace.get("traceEvents") if isinstance(trace, dict) else trace
    if not isinstance(events, list):
        raise ValueError(
            f"{where}: not a trace (a JSON object with a 'traceEvents' list, or a list of events), "
            f"got {type(trace).__name__}" + (" without 'traceEvents'" if isinstance(trace, dict) else "")
        )
    acc: dict = {"forward": {}, "backward": {}, "load": {}}
    d2h: dict = {}
    for i, ev in enumerate(events):
        if not isinstance(ev, dict) or ev.get("ph") != "X":
            continue
        name, dur, args = ev.get("name"), ev.get("dur"), ev.get("args")
        m = _NAME.match(name) if isinstance(name, str) else None
        chunk = args.get("chunk") if isinstance(args, dict) else None
        if not m and not (ev.get("cat") == "d2h" and chunk is not None):
            continue
        if isinstance(dur, bool) or not isinstance(dur, (int, float)) or not math.isfinite(dur) or dur < 0:
            raise ValueError(f"{where}: event {i} ({name!r}) has dur={dur!r}; a span needs a finite dur >= 0")
        if m:
            acc[m.group(1)].setdefault(int(m.group(2)), []).append(dur * 1e-6)
        elif isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 0:
            raise ValueError(f"{where}: event {i} ({name!r}) has chunk={chunk!r}; expected an int >= 0")
        else:
            d2h.setdefault(chunk, []).append(dur * 1e-6)
    if not acc["forward"]:
        raise ValueError(f"{where}: the trace has no 'forward <chunk>' spans (trace an OffloadModel step)")
    n = max(acc["forward"]) + 1
    missing = [k for k in range(n) if k not in acc["forward"] or k not in acc["backward"]]
    if missing:
        raise ValueError(f"{where}: chunks {missing} have no forward or backward span")

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
