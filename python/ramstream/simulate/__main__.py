"""python -m ramstream.simulate offload: the predicted OffloadModel step per window (OffloadModel's
and RamTorch's meaning: device slots for streamed chunks, the running one included).
python -m ramstream.simulate schedule | pipeline: pipeline schedules, alone or with weight
streaming per stage (_cli_pipeline.py)."""

from __future__ import annotations

import argparse
import json
import sys

from .._paths import arg_type, check_writable, read_json
from ._cli_pipeline import add_parsers, run_pipeline, run_schedule
from .measure import times_from_trace
from .offload import simulate_offload, table


def _keep(v: str):
    m = {"true": True, "false": False, "checkpoint": "checkpoint"}
    if v.lower() not in m:
        raise argparse.ArgumentTypeError(f"--keep-activations must be true, false or checkpoint, got {v!r}")
    return m[v.lower()]


def _trace(path: str) -> dict:
    """The trace at `path`, read and checked at argument parsing (times_from_trace finds its spans)."""
    doc = read_json(path, "trace")
    try:
        times_from_trace(doc)
    except ValueError as e:
        raise ValueError(f"trace {path!r}: {str(e).removeprefix('times_from_trace: ')}") from None
    return {"path": path, "doc": doc}


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m ramstream.simulate", description=__doc__)
    sub = ap.add_subparsers(dest="what", required=True)
    p = sub.add_parser("offload", help="an OffloadModel step: H2D loads, compute, D2H write-backs")
    p.add_argument("--layers", type=int, help="the number of chunks")
    p.add_argument("--tf", type=float, help="forward seconds per chunk")
    p.add_argument("--tb", type=float, help="backward seconds per chunk (without the recompute)")
    p.add_argument("--th2d", type=float, help="H2D seconds per chunk load")
    p.add_argument("--td2h", type=float, help="D2H seconds per chunk's gradients (default 0)")
    p.add_argument(
        "--window",
        type=int,
        help="device slots for streamed chunks, the running one included (1: no load overlaps "
        "compute; default: a table over 1..layers)",
    )
    p.add_argument(
        "--pin", type=int, default=0, help="PIN evenly spaced chunks stay resident (chunk i*layers//PIN)"
    )
    p.add_argument(
        "--keep-activations", type=_keep, default=False, help="true, false (default) or checkpoint"
    )
    p.add_argument("--serial", action="store_true", help="copies inline (device='cpu')")
    p.add_argument(
        "--measure",
        metavar="TRACE.json",
        type=arg_type(_trace),
        help="per-chunk times from OffloadModel.step(profile_path=...)",
    )
    p.add_argument(
        "--plot",
        metavar="GANTT.png",
        type=arg_type(check_writable),
        help="a Gantt chart (needs matplotlib: ramstream[plot])",
    )
    p.add_argument("--json", action="store_true", help="print the rows as JSON")
    add_parsers(sub)
    return ap


def main(argv=None) -> int:
    args = _parser().parse_args(argv)
    if args.what == "schedule":
        return run_schedule(args)
    if args.what == "pipeline":
        return run_pipeline(args)
    times: dict = {}
    if args.measure:
        times = times_from_trace(args.measure["doc"], keep_activations=args.keep_activations)
    for name in ("layers", "tf", "tb", "th2d", "td2h"):
        v = getattr(args, name)
        if v is not None:
            times[name] = v
    missing = [f"--{k}" for k in ("layers", "tf", "tb", "th2d") if k not in times]
    if missing:
        print(f"simulate offload: give {', '.join(missing)} (or --measure TRACE.json)", file=sys.stderr)
        return 2
    n = times.pop("layers")
    kw = dict(layers=n, pin=args.pin, keep_activations=args.keep_activations, serial=args.serial)
    kw["td2h"] = times.pop("td2h", 0.0)
    try:
        if args.window is not None:
            preds = [simulate_offload(times["tf"], times["tb"], times["th2d"], window=args.window, **kw)]
        else:
            preds = table(times["tf"], times["tb"], times["th2d"], **kw)
        if args.plot:
            from .gantt import plot_gantt

            plot_gantt(
                preds[0] if args.window is not None else min(preds, key=lambda p: p.makespan), args.plot
            )
    except (ValueError, ImportError) as e:
        print(f"simulate offload: {e}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps([p.row() for p in preds]))
        return 0
    print(
        f"{n} chunks, pin={args.pin}, keep_activations={args.keep_activations}"
        + (" (serial)" if args.serial else "")
    )
    print(f"{'window':>6} {'makespan s':>11} {'GPU util':>8} {'stall s':>9} {'peak chunks':>11}")
    for p in preds:
        print(f"{p.window:>6} {p.makespan:>11.4g} {p.utilisation:>8.1%} {p.stall:>9.4g} {p.peak_chunks:>11}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
