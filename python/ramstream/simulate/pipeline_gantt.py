"""Gantt charts of simulated pipeline steps (simulate/pipeline.py): text for the terminal, and an
image with matplotlib (the optional extra ramstream[plot])."""

from __future__ import annotations

import os

LEGEND = "0-9: forward of microbatch mb % 10, a-j: its backward, '=': H2D load, '.': idle"


def _lane(spans, cells: int, scale: float, char) -> str:
    """One row: the character of the span covering each cell's midpoint ('.' where none does)."""
    spans = sorted(spans, key=lambda sp: sp.start)
    out, k = [], 0
    for i in range(cells):
        t = (i + 0.5) / scale
        while k < len(spans) and spans[k].end <= t:
            k += 1
        out.append(char(spans[k]) if k < len(spans) and spans[k].start <= t else ".")
    return "".join(out)


def _op_char(sp) -> str:
    return str(sp.mb % 10) if sp.kind == "F" else "abcdefghij"[sp.mb % 10]


def ascii_gantt(prediction, width: int = 100) -> str:
    """The step as text, one row per stage (and one per stage's H2D lane when streaming), `width`
    cells across the makespan."""
    if isinstance(width, bool) or not isinstance(width, int) or width < 1:
        raise ValueError(f"ascii_gantt: width must be an int >= 1, got {width!r}")
    p = prediction
    if p.makespan <= 0:
        return ""
    scale = width / p.makespan
    rows = []
    for s in range(p.stages):
        ops = [sp for sp in (p.pieces or p.spans) if sp.stage == s]
        rows.append(f"stage {s:<3}|{_lane(ops, width, scale, _op_char)}|")
        if p.window is not None:
            loads = [c for c in p.copies if c.stage == s and c.lane == "h2d"]
            rows.append(f"  h2d {s:<3}|{_lane(loads, width, scale, lambda c: '=')}|")
    return "\n".join(rows)


def _pyplot():
    from .gantt import pyplot

    return pyplot()


def plot_pipeline(predictions, path) -> None:
    """Writes one Gantt chart per prediction (stacked, one shared time axis) as an image to
    `path`: forwards green, backwards orange, darker for later chunks of a stage, H2D loads
    blue. ImportError with the install line when matplotlib is missing."""
    plt = _pyplot()
    preds = list(predictions)
    heights = [p.stages * (2 if p.window is not None else 1) for p in preds]
    fig, axes = plt.subplots(
        len(preds), 1, figsize=(12, 1 + 0.35 * sum(heights) + 0.6 * len(preds)), sharex=True, squeeze=False
    )
    for ax, p in zip(axes[:, 0], preds):
        lanes = 2 if p.window is not None else 1
        for sp in p.pieces or p.spans:
            y = sp.stage * lanes
            shade = 1.0 - 0.45 * (sp.chunk // p.stages) / max(1, p.chunks_per_stage - 1)
            base = (0.2, 0.65, 0.3) if sp.kind == "F" else (1.0, 0.55, 0.1)
            colour = tuple(c * shade for c in base)
            ax.barh(y, sp.end - sp.start, left=sp.start, color=colour, edgecolor="black", linewidth=0.3)
            if sp.end - sp.start > p.makespan / 80:
                ax.text((sp.start + sp.end) / 2, y, str(sp.mb), ha="center", va="center", fontsize=6)
        for c in p.copies:
            if c.lane == "h2d":
                ax.barh(c.stage * lanes + 1, c.end - c.start, left=c.start, color="tab:blue", height=0.5)
        labels = []
        for s in range(p.stages):
            labels += [f"stage {s}"] + (["H2D"] if lanes == 2 else [])
        ax.set_yticks(range(len(labels)), labels)
        ax.invert_yaxis()
        title = f"{p.schedule}: makespan {p.makespan:.4g}, bubble {p.bubble:.1%}"
        ax.set_title(title + (f", window {p.window}" if p.window is not None else ""), fontsize=9)
    axes[-1, 0].set_xlabel("time")
    fig.tight_layout()
    tmp = f"{os.fspath(path)}.tmp.{os.getpid()}{os.path.splitext(os.fspath(path))[1]}"
    fig.savefig(tmp, dpi=120)
    plt.close(fig)
    os.replace(tmp, path)
