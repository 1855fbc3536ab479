"""The block stack activation paging, recompute and weight streaming work in: find_blocks() (a
model's repeated layer stack), chosen_blocks() / fraction_to_blocks() (which of its blocks an option
picks), spaced() (evenly spaced resident chunks: OffloadModel's and the pipeline's `pin`) and
ranges_text() for logs.

A leaf: imports torch and the standard library only, so that planner/, quant/, weights/,
activations/ and options.py can all use it without importing each other.
"""

from __future__ import annotations

import math

import torch.nn as nn

__all__ = ["check_blocks", "chosen_blocks", "find_blocks", "fraction_to_blocks", "ranges_text", "spaced"]


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


def check_blocks(where: str, model: nn.Module, blocks) -> list[nn.Module]:
    """``blocks`` as a list: a non-empty sequence of nn.Modules, each a submodule of ``model``;
    ValueError naming ``where``'s blocks argument and what is accepted otherwise (a block of another
    model would be streamed, counted or packed while the model's own layers are not)."""
    if not isinstance(blocks, (nn.ModuleList, nn.Sequential)) and isinstance(blocks, nn.Module):
        blocks = None  # a single module is not a list of blocks
    try:
        items = None if blocks is None or isinstance(blocks, (str, bytes)) else list(blocks)
    except TypeError:
        items = None
    if not items or not all(isinstance(b, nn.Module) for b in items):
        raise ValueError(f"{where}: blocks must be a non-empty list of nn.Module, got {blocks!r:.80}")
    mine = {id(m) for m in model.modules()}
    foreign = [i for i, b in enumerate(items) if id(b) not in mine]
    if foreign:
        raise ValueError(
            f"{where}: blocks {foreign} are not submodules of the model ({type(model).__name__}); "
            "pass the model's own layers (such as list(model.layers))"
        )
    return items


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


def spaced(pin: int, n: int) -> set[int]:
    """`pin` evenly spaced chunks of `n` (RamTorch's `pin`): chunk i * n // pin for i = 0 .. pin-1,
    the first chunk of each of `pin` strides of n / pin chunks (pin=2 of 5: 0 and 2; 6 of 12:
    0, 2, 4, 6, 8, 10; pin=n: every chunk)."""
    return {i * n // pin for i in range(pin)}


def fraction_to_blocks(fraction: float, n_blocks: int) -> list[int]:
    """The first round(fraction * n_blocks) block indices (halves round up), for
    ``activation_offload=<fraction>``. fraction in [0, 1]; n_blocks an int >= 0."""
    if (
        isinstance(fraction, bool)
        or not isinstance(fraction, (int, float))
        or not math.isfinite(fraction)
        or not 0.0 <= fraction <= 1.0
    ):
        raise ValueError(f"fraction_to_blocks: fraction must be a number in [0, 1], got {fraction!r}")
    if isinstance(n_blocks, bool) or not isinstance(n_blocks, int) or n_blocks < 0:
        raise ValueError(f"fraction_to_blocks: n_blocks must be an int >= 0, got {n_blocks!r}")
    k = min(n_blocks, int(math.floor(fraction * n_blocks + 0.5 + 1e-9)))
    return list(range(k))


def chosen_blocks(name: str, option, n: int) -> list[int]:
    """The block indices for a parsed choice other than "auto": False none, True all, a fraction
    the first round(fraction * n) (halves up), a list those (ValueError when out of range)."""
    if option is False:
        return []
    if option is True:
        return list(range(n))
    if isinstance(option, float):
        return fraction_to_blocks(option, n)
    bad = [i for i in option if not 0 <= i < n]
    if bad:
        raise ValueError(
            f"wrap(): option {name}={option!r}: block indices {bad} out of range; the model has "
            f"{n} blocks (0 to {n - 1})"
        )
    return list(option)
