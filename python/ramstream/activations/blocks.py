"""find_blocks(): a model's repeated layer stack, the unit activation paging works in (and ranges_text for logs)."""

from __future__ import annotations

import torch.nn as nn

__all__ = ["find_blocks"]


def find_blocks(model: nn.Module) -> list[nn.Module]:
    """The blocks of the model's repeated layer stack, in order.

    The stack is the nn.ModuleList or nn.Sequential holding >= 2 modules, all of one class and
    together holding parameters, with the most parameters (ties: more children, then the outermost),
    e.g. ``model.layers`` of a Llama-like model or ``transformer.h`` of GPT-2. A module listed twice
    (shared weights) is returned once. Raises ValueError when the model has no such container.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"find_blocks: model must be a torch.nn.Module, got {type(model).__name__}")
    best = None
    seen: list[str] = []
    for order, (name, m) in enumerate(model.named_modules()):
        if not isinstance(m, (nn.ModuleList, nn.Sequential)):
            continue
        children = list(dict.fromkeys(m))  # unique, in order
        classes = sorted({type(c).__name__ for c in children})
        seen.append(
            f"{name or '<root>'} ({type(m).__name__} of {len(children)}: {', '.join(classes) or 'empty'})"
        )
        if len(children) < 2 or len(classes) != 1 or len({type(c) for c in children}) != 1:
            continue
        numel = sum(p.numel() for p in m.parameters())
        if numel == 0:
            continue
        key = (numel, len(children), -order)
        if best is None or key > best[0]:
            best = (key, children)
    if best is None:
        found = "; ".join(seen[:6]) if seen else "none"
        raise ValueError(
            f"find_blocks: no repeated layer stack found in {type(model).__name__}: expected an "
            "nn.ModuleList or nn.Sequential holding >= 2 modules of one class with parameters "
            f"(such as model.layers or transformer.h); containers seen: {found}. Pass the blocks "
            "explicitly (blocks=[...])."
        )
    return best[1]


def ranges_text(idx: list[int]) -> str:
    """Block indices for a log line: [0,1,2,5] -> '0-2,5'."""
    if not idx:
        return "none"
    out, start, prev = [], idx[0], idx[0]
    for i in idx[1:] + [None]:
        if i is not None and i == prev + 1:
            prev = i
            continue
        out.append(f"{start}-{prev}" if prev > start else f"{start}")
        if i is not None:
            start = prev = i
    return ",".join(out)
