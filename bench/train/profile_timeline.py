"""A torch.profiler chrome trace (JSON, .gz too) as a timeline table: for each window of the
traced span, how busy each GPU stream (kernels, host-to-device and device-to-host copies apart)
and each host thread (the union of its top-level CPU ops) were, in percent. Shows where a step
waits: on the GPU, on a copy engine, or on the host launching work.

    python bench/train/profile_timeline.py trace.json.gz --windows 20
"""

from __future__ import annotations

import argparse
import gzip
import json
from collections import defaultdict


def _load(path: str) -> list[dict]:
    op = gzip.open if path.endswith(".gz") else open
    with op(path, "rt") as f:
        d = json.load(f)
    return d["traceEvents"] if isinstance(d, dict) else d


def _lane(e: dict) -> str | None:
    """The lane an event counts in, or None."""
    cat = e.get("cat", "")
    name = e.get("name", "")
    if cat in ("kernel", "gpu_memcpy", "gpu_memset"):
        kind = (
            "kernel"
            if cat == "kernel"
            else ("h2d" if "HtoD" in name else "d2h" if "DtoH" in name else "copy")
        )
        return f"gpu {kind} s{e.get('tid')}"
    if cat == "cpu_op":
        return f"host t{e.get('tid')}"
    return None


def _union(iv: list[tuple[float, float]]) -> list[tuple[float, float]]:
    out: list[list[float]] = []
    for a, b in sorted(iv):
        if out and a <= out[-1][1]:
            out[-1][1] = max(out[-1][1], b)
        else:
            out.append([a, b])
    return [(a, b) for a, b in out]


def timeline(events: list[dict], windows: int) -> tuple[list[str], list[float], dict[str, list[float]]]:
    """(lanes, window starts in ms, lane -> busy percent per window)."""
    lanes: dict[str, list] = defaultdict(list)
    for e in events:
        if e.get("ph") != "X" or "dur" not in e:
            continue
        lane = _lane(e)
        if lane is not None:
            lanes[lane].append((float(e["ts"]), float(e["ts"]) + float(e["dur"])))
    if not lanes:
        raise SystemExit("no kernel, copy or CPU-op events in the trace")
    t0 = min(a for iv in lanes.values() for a, _ in iv)
    t1 = max(b for iv in lanes.values() for _, b in iv)
    w = (t1 - t0) / windows
    busy = {}
    for lane, iv in lanes.items():
        per = [0.0] * windows
        for a, b in _union(iv):
            for k in range(int((a - t0) // w), min(windows, int((b - t0) // w) + 1)):
                lo, hi = t0 + k * w, t0 + (k + 1) * w
                per[k] += max(0.0, min(b, hi) - max(a, lo))
        busy[lane] = [100 * x / w for x in per]
    names = sorted(busy, key=lambda n: -sum(busy[n]))
    return names, [k * w / 1e3 for k in range(windows)], busy


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("trace")
    ap.add_argument("--windows", type=int, default=20)
    ap.add_argument("--lanes", type=int, default=8, help="the busiest lanes shown")
    a = ap.parse_args(argv)
    if a.windows < 1 or a.lanes < 1:
        raise SystemExit("--windows and --lanes: positive integers")
    names, starts, busy = timeline(_load(a.trace), a.windows)
    names = names[: a.lanes]
    print("window_ms " + " ".join(f"{n.replace(' ', '_'):>16}" for n in names))
    for k, s in enumerate(starts):
        print(f"{s:9.1f} " + " ".join(f"{busy[n][k]:16.0f}" for n in names))
    print("mean      " + " ".join(f"{sum(busy[n]) / len(starts):16.0f}" for n in names))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
