"""Cutting a model into contiguous pipeline pieces: the pieces of an nn.Sequential (its children,
in order) at a split_spec's points, or balanced by parameter count (balance()); _Sequence runs
a list of modules as one stage."""

from __future__ import annotations

import torch.nn as nn

__all__ = ["Sequence", "balance", "children_of", "split_model"]


class Sequence(nn.Module):
    """Modules run in order as one stage; a tuple output becomes the next one's positional
    arguments (OffloadModel's convention)."""

    def __init__(self, modules) -> None:
        super().__init__()
        self.parts = nn.ModuleList(modules)

    def forward(self, *args):
        x = args
        for m in self.parts:
            x = m(*x) if isinstance(x, tuple) else m(x)
        return x


def children_of(model, where: str = "Pipeline") -> list[tuple[str, nn.Module]]:
    """The named children of an nn.Sequential (its forward runs them in order, so any contiguous
    cut of them is a pipeline) or of an nn.ModuleList (a list of blocks, run in order: a tuple
    output is the next block's arguments). Other models: TypeError saying what to pass instead."""
    if not isinstance(model, (nn.Sequential, nn.ModuleList)):
        raise TypeError(
            f"{where}: model must be an nn.Sequential or an nn.ModuleList of blocks (run in order, so "
            f"ramstream can cut it without tracing), got {type(model).__name__}; cut other models "
            "yourself and pass stage_modules=[...] (modules run in order, a tuple output is the next "
            "one's arguments)"
        )
    kids = list(model.named_children())
    if not kids:
        raise ValueError(f"{where}: model has no children to split")
    return kids


def _point(v) -> str:
    name = getattr(v, "name", v)  # torch.distributed.pipelining.SplitPoint or a string
    if isinstance(name, str) and name.lower() in ("beginning", "end"):
        return name.lower()
    raise ValueError(
        f"Pipeline: split_spec values must be SplitPoint.BEGINNING/END or 'beginning'/'end', got {v!r}"
    )


def split_model(model, split_spec, n_stages: int | None, weights=None, where: str = "Pipeline") -> list:
    """The stage modules of an nn.Sequential (or nn.ModuleList): split_spec {child name: SplitPoint.BEGINNING (a new
    stage starts at the child) or .END (a stage ends after it)}, or None (balanced by parameter
    count over n_stages, or by `weights` when given). A piece of several children is a Sequence
    of them (the same module objects: the model's parameters are the pipeline's)."""
    kids = children_of(model, where)
    names = [k for k, _ in kids]
    if split_spec is None:
        n = n_stages or 1
        counts = balance([sum(p.numel() for p in m.parameters()) for _, m in kids], n, weights)
    else:
        if not isinstance(split_spec, dict):
            raise TypeError(
                f"{where}: split_spec must be a dict {{child name: SplitPoint}}, got {type(split_spec).__name__}"
            )
        cuts = set()
        for k, v in split_spec.items():
            if k not in names:
                raise ValueError(
                    f"{where}: split_spec names {k!r}, which is not a child of the model ({names[:8]})"
                )
            i = names.index(k) + (_point(v) == "end")
            if 0 < i < len(names):
                cuts.add(i)
        edges = [0, *sorted(cuts), len(names)]
        counts = [b - a for a, b in zip(edges, edges[1:])]
        if n_stages is not None and len(counts) != n_stages:
            raise ValueError(f"{where}: split_spec makes {len(counts)} stages for {n_stages} devices")
    out, i = [], 0
    for c in counts:
        part = [m for _, m in kids[i : i + c]]
        out.append(part[0] if len(part) == 1 else Sequence(part))
        i += c
    return out


def balance(weights, n: int, device_weights=None) -> list[int]:
    """Contiguous counts (one per stage, each >= 1) of `weights` (e.g. parameters per child) that
    minimise the heaviest stage's load / device_weights[stage] (None: equal); among ties the
    later stages are the smaller (a parameter-free child stays with the layer before it). ValueError when there are fewer weights than stages or a bad device weight."""
    k = len(weights)
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"balance: the number of stages must be an int >= 1, got {n!r}")
    if k < n:
        raise ValueError(
            f"PipelineModel: cannot split {k} children into {n} stages (one child at least each)"
        )
    if device_weights is None:
        dw = [1.0] * n
    else:
        try:
            dw = [float(w) for w in device_weights]
        except (TypeError, ValueError):
            raise TypeError(
                f"PipelineModel: device_weights must be a list of numbers, got {device_weights!r}"
            ) from None
        if len(dw) != n:
            raise ValueError(f"PipelineModel: device_weights has {len(dw)} entries for {n} stages")
        if not all(w > 0 and w != float("inf") for w in dw):
            raise ValueError(
                f"PipelineModel: device_weights must be positive and finite, got {device_weights!r}"
            )
    pre = [0]
    for w in weights:
        pre.append(pre[-1] + w)
    inf = float("inf")
    # best[s][i]: the smallest heaviest load placing the first i weights on the first s stages
    best = [[inf] * (k + 1) for _ in range(n + 1)]
    cut = [[0] * (k + 1) for _ in range(n + 1)]
    best[0][0] = 0.0
    for s in range(1, n + 1):
        for i in range(s, k - (n - s) + 1):
            for j in range(i - 1, s - 2, -1):  # latest cut first: ties leave later stages smaller
                cost = max(best[s - 1][j], (pre[i] - pre[j]) / dw[s - 1])
                if cost < best[s][i]:
                    best[s][i], cut[s][i] = cost, j
    counts, i = [], k
    for s in range(n, 0, -1):
        j = cut[s][i]
        counts.append(i - j)
        i = j
    return counts[::-1]
