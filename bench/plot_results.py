"""Plots step time against the VRAM cap from bench/train/bench_defaults.py's JSON lines (--out).

    python bench/train/bench_defaults.py --rows R1,R3,R4 --caps 8,12,16,24 --out defaults.jsonl  # GPU
    python bench/plot_results.py defaults.jsonl            # -> docs/img/step_time_vs_cap.png

One line per (row, variant) over the runs whose status is "ok"; runs that did not finish (oom,
refused, timeout) are drawn as crosses at the bottom of the plot, labelled with their status.
Uncapped runs (cap 0) are left out. Every number comes from the JSON: nothing is typed in here.
matplotlib is optional for ramstream (`pip install 'ramstream[plot]'` or `pip install matplotlib`).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections import defaultdict

OUT = os.path.join(
    os.path.dirname(os.path.abspath(__file__)), os.pardir, "docs", "img", "step_time_vs_cap.png"
)


def read_runs(paths: list[str]) -> list[dict]:
    """Every JSON object of the files (JSON lines, or one JSON list), in file order."""
    runs: list[dict] = []
    for path in paths:
        with open(path) as f:
            text = f.read().strip()
        if text.startswith("["):
            runs.extend(json.loads(text))
        else:
            runs.extend(json.loads(line) for line in text.splitlines() if line.strip())
    return runs


def series(runs: list[dict]) -> tuple[dict, list[tuple[str, float, str]]]:
    """{(row, variant): [(cap GiB, s/step), ...] sorted by cap} of the finished capped runs, and
    (label, cap, status) of the capped runs that did not finish. A later run of a cell replaces
    an earlier one."""
    last: dict[tuple[str, str, float], dict] = {}
    for r in runs:
        cap = float(r.get("cap_gib") or 0)
        if cap > 0 and "row" in r:
            last[(r["row"], r.get("variant", "defaults"), cap)] = r
    ok: dict[tuple[str, str], list[tuple[float, float]]] = defaultdict(list)
    failed: list[tuple[str, float, str]] = []
    for (row, variant, cap), r in sorted(last.items()):
        if r.get("status") == "ok" and r.get("s_per_step"):
            ok[(f"{row} {describe(r)}" if "model" in r else row, variant)].append(
                (cap, float(r["s_per_step"]))
            )
        else:
            failed.append((f"{row} {variant}", cap, status_text(r)))
    return dict(ok), failed


def status_text(r: dict) -> str:
    """A run that did not finish, in words: a step the plan check refused (ramstream's
    PlanOutOfMemoryError, nothing ran) is told apart from an out-of-memory that happened."""
    status = str(r.get("status", "?"))
    if status == "oom" and "does not fit the plan" in str(r.get("error", "")):
        return f"refused at step {r.get('step', '?')} (plan check)"
    return status


def describe(r: dict) -> str:
    """A row's workload in words, from its record: "gpt1.8b full FT fp32 8x512"."""
    kind = "LoRA" if r.get("trained_params", 0) * 2 < r.get("params", 0) else "full FT"
    parts = [r.get("model", "?"), kind, r.get("dtype", ""), f"{r.get('batch', '?')}x{r.get('seq', '?')}"]
    return " ".join(str(p) for p in parts if p)


def plot(runs: list[dict], out: str, title: str | None = None, rows: list[str] | None = None) -> str:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:
        raise SystemExit("plot_results.py needs matplotlib: pip install matplotlib") from exc
    if rows:
        runs = [r for r in runs if r.get("row") in rows]
    ok, failed = series(runs)
    if not ok and not failed:
        raise SystemExit("no capped runs in the input (cap_gib > 0): nothing to plot")
    fig, ax = plt.subplots(figsize=(7, 4.2), dpi=120)
    for (row, variant), pts in ok.items():
        caps, secs = zip(*pts)
        ax.plot(caps, secs, marker="o", label=f"{row} {variant}")
    for label, cap, status in failed:
        ax.scatter([cap], [0], marker="x", color="black")
        ax.annotate(f"{label}: {status}", (cap, 0), textcoords="offset points", xytext=(4, 6), fontsize=7)
    ax.set_xlabel("VRAM cap (GiB, set_per_process_memory_fraction)")
    ax.set_ylabel("s/step (median of the settled steps)")
    ax.set_title(title or "ramstream defaults: step time against the VRAM cap")
    top = max((sec for pts in ok.values() for _, sec in pts), default=1.0)
    ax.set_ylim(0, top * 1.45)  # room above the lines for the legend
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="upper left")
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    fig.savefig(out)
    plt.close(fig)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("inputs", nargs="+", help="bench_defaults.py --out files (JSON lines)")
    ap.add_argument("--out", default=OUT, help="the PNG to write (default docs/img/step_time_vs_cap.png)")
    ap.add_argument("--title")
    ap.add_argument("--rows", help="comma-separated rows to draw (default: every row in the input)")
    args = ap.parse_args(argv)
    rows = [r.strip() for r in args.rows.split(",")] if args.rows else None
    print(plot(read_runs(args.inputs), args.out, args.title, rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
