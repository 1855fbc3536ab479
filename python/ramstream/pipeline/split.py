"""Cutting a model into contiguous pipeline pieces: the pieces of an nn.Sequential (its children,
in order) at a split_spec's points, or balanced by parameter count (balance(), partition.py's
routine); Sequence runs a list of modules as one stage."""

from __future__ import annotations

import torch.nn as nn

from .partition import partition as balance  # one routine: split.balance is partition
from .partition import stage_bytes

__all__ = ["Sequence", "balance", "children_of", "piece_bytes", "split_model"]


def piece_bytes(m: nn.Module) -> tuple[int, int, int]:
    """(parameters, gradients, AdamW state) bytes of a module resident on its device, the numbers
    the planner's split and streaming choices take (planner/pipeline_split.py stage_bytes)."""
    params = list(m.parameters())
    trained = [p for p in params if p.requires_grad]
    return stage_bytes(
        sum(p.numel() * p.element_size() for p in params),
        sum(p.numel() for p in trained),
        sum(p.numel() * p.element_size() for p in trained),
    )


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
