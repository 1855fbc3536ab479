"""python -m ramstream.simulate schedule | pipeline: pipeline schedules simulated (makespan, bubble,
saved activations, a text Gantt chart), alone or with each stage's weights streamed from host RAM.
RamTorch's option names (--p, --m, --v, --chunks) are accepted beside ours."""

from __future__ import annotations

import argparse
import json
import math
import sys

from .._paths import arg_type, check_writable
from ..pipeline.schedule import NAMES, canonical
from .pipeline import simulate_pipeline, simulate_schedule, window_table
from .pipeline_gantt import LEGEND, ascii_gantt, plot_pipeline


def _int(low: int):
    def parse(text: str) -> int:
        try:
            v = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be an int >= {low}, got {text!r}") from None
        if v < low:
            raise argparse.ArgumentTypeError(f"must be an int >= {low}, got {v}")
        return v

    parse.__name__ = "int"
    return parse


def _time(text: str) -> float:
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a time >= 0, got {text!r}") from None
    if not (v >= 0 and math.isfinite(v)):
        raise argparse.ArgumentTypeError(f"must be a finite time >= 0, got {text!r}")
    return v


def _labels(text: str) -> list[str]:
    labels = [x.strip() for x in text.split(",")]
    if not all(labels):
        raise argparse.ArgumentTypeError(f"must be comma-separated labels, one per stage, got {text!r}")
    return labels


def _common(p: argparse.ArgumentParser, tb: float, of: str = "") -> None:
    p.add_argument("--stages", "--p", type=_int(1), default=4, help="pipeline stages (GPUs; default 4)")
    p.add_argument("--microbatches", "--m", type=_int(1), default=8, help="microbatches (default 8)")
    p.add_argument("--tb", type=_time, default=tb, help=f"backward time{of} (default {tb:g})")
    p.add_argument("--comm", type=_time, default=0.0, help="time of one hop between stages (default 0)")
    p.add_argument(
        "--virtual",
        "--v",
        type=_int(1),
        default=1,
        help="chunks per stage of the interleaved schedule (default 1)",
    )
    p.add_argument("--width", type=_int(1), default=100, help="text Gantt width in characters (default 100)")
    p.add_argument(
        "--plot",
        metavar="GANTT.png",
        type=arg_type(check_writable),
        help="a Gantt chart image (needs matplotlib: ramstream[plot])",
    )
    p.add_argument("--json", action="store_true", help="print the results as JSON instead of text")


def add_parsers(sub) -> None:
    """Adds the `schedule` and `pipeline` subcommands to the subparsers `sub`."""
    p = sub.add_parser(
        "schedule",
        help="pipeline schedules: makespan, bubble, saved activations, Gantt",
        description="Simulates pipeline schedules with resident weights. --tf/--tb are one stage's "
        "share of a microbatch (the interleaved schedule splits it over its --virtual chunks). " + LEGEND,
    )
    p.add_argument(
        "--schedule",
        action="append",
        choices=NAMES,
        help="a schedule (repeat to compare; default: gpipe, 1f1b and, with --virtual > 1, interleaved)",
    )
    p.add_argument("--tf", type=_time, default=1.0, help="forward time (default 1)")
    p.add_argument(
        "--devices",
        type=_labels,
        help="a device label per stage, comma-separated (e.g. 0,0,1,1): stages with one label share "
        "that device, ops running at once on it sharing its speed (default: a device per stage)",
    )
    _common(p, tb=1.0)
    p = sub.add_parser(
        "pipeline",
        help="a pipeline schedule with each stage's weights streamed from host RAM",
        description="Simulates a pipeline schedule whose stages stream their weights: each chunk "
        "is --layers pieces, each stage has --window device slots for streamed pieces. " + LEGEND,
    )
    p.add_argument("--schedule", choices=NAMES, default="1f1b", help="the schedule (default 1f1b)")
    p.add_argument(
        "--layers",
        "--chunks",
        type=_int(1),
        default=8,
        help="layer pieces per chunk (RamTorch's --chunks; default 8)",
    )
    p.add_argument(
        "--window",
        type=_int(1),
        help="device slots for streamed pieces per stage, the running one included (default: a table: resident, then 1 .. pieces)",
    )
    p.add_argument("--tf", type=_time, default=1.0, help="forward time of one piece (default 1)")
    p.add_argument("--th2d", type=_time, default=0.5, help="H2D time of one piece's weights (default 0.5)")
    p.add_argument(
        "--td2h", type=_time, default=0.5, help="D2H time of one piece's gradients (default 0.5; 0: none)"
    )
    p.add_argument(
        "--pin", type=_int(0), default=0, help="evenly spaced pieces per stage kept resident (default 0)"
    )
    p.add_argument(
        "--chunk-major",
        action="store_true",
        help="a stage's consecutive forwards (backwards) walk each piece over all their microbatches, "
        "as Pipeline(offload_chunk_major=True) runs streamed stages (one chunk per stage)",
    )
    _common(p, tb=2.0, of=" of one piece")


def _report(pred, serial: float, gpipe: float | None) -> str:
    line = (
        f"{pred.schedule:<12} makespan {pred.makespan:<8.4g} bubble {pred.bubble:6.1%}  "
        f"speed-up vs serial {serial / pred.makespan:.2f}x"
    )
    if gpipe:
        line += f", vs gpipe {gpipe / pred.makespan:.2f}x"
    return line + f"  peak in flight {pred.peak_in_flight}"


def _spans(pred) -> list:
    return [[sp.stage, sp.kind, sp.mb, sp.chunk, sp.start, sp.end] for sp in pred.spans]


def run_schedule(args) -> int:
    """The `schedule` subcommand: every schedule asked for, text or JSON; 2 on a bad argument."""
    names = args.schedule or ["gpipe", "1f1b"] + (["interleaved"] if args.virtual > 1 else [])
    p, m = args.stages, args.microbatches
    preds = []
    try:
        for name in names:
            v = args.virtual if name == "interleaved" else 1
            preds.append(
                simulate_schedule(
                    name,
                    stages=p,
                    microbatches=m,
                    chunks_per_stage=v,
                    tf=args.tf / v,
                    tb=args.tb / v,
                    comm=args.comm,
                    devices=args.devices,
                )
            )
        if args.plot:
            plot_pipeline(preds, args.plot)
    except (ValueError, ImportError) as e:
        print(f"simulate schedule: {e}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps([dict(pr.row(), spans=_spans(pr)) for pr in preds]))
        return 0
    serial = m * p * (args.tf + args.tb)
    gpipe = next((pr.makespan for pr in preds if pr.schedule == "gpipe"), None)
    shared = "" if args.devices is None else f", devices {','.join(args.devices)}"
    print(
        f"{p} stages, {m} microbatches, tf={args.tf:g}, tb={args.tb:g}, comm={args.comm:g}{shared} (serial {serial:g})"
    )
    print(LEGEND)
    for pr in preds:
        print()
        print(_report(pr, serial, gpipe))
        print(ascii_gantt(pr, args.width))
    return 0


def run_pipeline(args) -> int:
    """The `pipeline` subcommand: one window, or the table over windows; 2 on a bad argument."""
    if args.virtual > 1 and canonical(args.schedule) != "interleaved":
        print(f"simulate pipeline: --virtual {args.virtual} needs --schedule interleaved", file=sys.stderr)
        return 2
    kw = dict(
        stages=args.stages,
        microbatches=args.microbatches,
        chunks_per_stage=args.virtual,
        tf=args.tf,
        tb=args.tb,
        comm=args.comm,
        layers=args.layers,
        th2d=args.th2d,
        td2h=args.td2h,
        pin=args.pin,
        chunk_major=args.chunk_major,
    )
    try:
        if args.window is not None:
            preds = [simulate_pipeline(args.schedule, window=args.window, **kw)]
        else:
            preds = window_table(args.schedule, **kw)
        if args.plot:
            shown = preds if len(preds) == 1 else [preds[0], min(preds[1:], key=lambda pr: pr.makespan)]
            plot_pipeline(shown, args.plot)
    except (ValueError, ImportError) as e:
        print(f"simulate pipeline: {e}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps([pr.row() for pr in preds]))
        return 0
    base = preds[0]
    print(
        f"{base.schedule}: {args.stages} stages x {args.virtual} chunks x {args.layers} pieces, "
        f"{args.microbatches} microbatches, tf={args.tf:g} tb={args.tb:g} th2d={args.th2d:g} "
        f"td2h={args.td2h:g} comm={args.comm:g}, pin={args.pin}"
        + (", chunk-major" if args.chunk_major else "")
    )
    if len(preds) == 1:
        print(LEGEND)
        print(
            f"window {base.window}: makespan {base.makespan:.4g}, bubble {base.bubble:.1%}, peak in flight {base.peak_in_flight}"
        )
        print(ascii_gantt(base, args.width))
        return 0
    print(f"{'window':>8} {'makespan':>10} {'bubble':>7} {'vs resident':>11} {'max H2D busy':>12}")
    for pr in preds:
        w = "resident" if pr.window is None else pr.window
        h2d = max(pr.h2d_busy) if pr.h2d_busy else 0.0
        print(
            f"{w:>8} {pr.makespan:>10.4g} {pr.bubble:>7.1%} {pr.makespan / base.makespan:>10.2f}x {h2d:>12.4g}"
        )
    return 0
