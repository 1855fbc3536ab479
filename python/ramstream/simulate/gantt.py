"""The Gantt chart of a simulated step (matplotlib: the optional extra ramstream[plot])."""

from __future__ import annotations

import os

_COLOURS = {
    "load": "tab:blue",
    "forward": "tab:green",
    "recompute": "tab:olive",
    "backward": "tab:orange",
    "write": "tab:purple",
    "stall": "tab:red",
}


def pyplot():
    """matplotlib.pyplot on the Agg backend (files only), or ImportError naming the install."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as e:
        raise ImportError(
            "ramstream.simulate --plot needs matplotlib: pip install 'ramstream[plot]' (or pip install matplotlib)"
        ) from e
    return plt


def plot_gantt(prediction, path) -> None:
    """Writes the lanes of `prediction` (a simulate_offload Prediction) as an image to `path`."""
    plt = pyplot()
    lanes = ["h2d", "compute", "d2h"]
    fig, ax = plt.subplots(figsize=(12, 3))
    for sp in prediction.spans:
        y = lanes.index(sp.lane)
        ax.barh(
            y, sp.end - sp.start, left=sp.start, color=_COLOURS[sp.kind], edgecolor="black", linewidth=0.3
        )
        if sp.kind != "stall" and sp.end - sp.start > prediction.makespan / 60:
            ax.text((sp.start + sp.end) / 2, y, str(sp.chunk), ha="center", va="center", fontsize=6)
    ax.set_yticks(range(len(lanes)), ["H2D", "compute", "D2H"])
    ax.invert_yaxis()
    ax.set_xlabel("seconds")
    ax.set_title(
        f"window={prediction.window}: makespan {prediction.makespan:.4g} s, "
        f"GPU utilisation {prediction.utilisation:.0%}, peak {prediction.peak_chunks} chunks"
    )
    handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c in _COLOURS.values()]
    ax.legend(handles, list(_COLOURS), loc="upper right", fontsize=6, ncol=6)
    fig.tight_layout()
    tmp = f"{os.fspath(path)}.tmp.{os.getpid()}{os.path.splitext(os.fspath(path))[1]}"
    fig.savefig(tmp, dpi=120)
    plt.close(fig)
    os.replace(tmp, path)
