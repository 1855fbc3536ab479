"""Cheap argument validation shared by the ops modules: messages name the function and argument."""

from __future__ import annotations

import math
import numbers
import operator

import torch

from . import _adamw_rules as _rules

__all__ = [
    "check_float",
    "check_int",
    "check_tensor",
    "check_adamw_hyper",
    "check_no_overlap",
    "bump_version",
    "FLOAT_DTYPES",
    "MOMENT_DTYPES",
]

FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
MOMENT_DTYPES = (torch.float32, torch.bfloat16)


def _names(dtypes) -> str:
    return "/".join(str(d).replace("torch.", "") for d in dtypes)


def check_float(op: str, name: str, value, *, ge=None, gt=None, lt=None, le=None) -> float:
    """``float(value)``; ValueError "op: name must be a finite float >= 0, got nan" unless it is a
    finite real number within the given bounds (ge: >=, gt: >, lt: <, le: <=). TypeError for
    non-numbers."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{op}: {name} must be a float, got {type(value).__name__}")
    v = float(value)
    rule = "a finite float"
    if ge is not None:
        rule += f" >= {ge:g}"
    if gt is not None:
        rule += f" > {gt:g}"
    if lt is not None:
        rule += f"{' and' if ge is not None or gt is not None else ''} < {lt:g}"
    if le is not None:
        rule += f" and <= {le:g}"
    ok = math.isfinite(v)
    ok = ok and (ge is None or v >= ge) and (gt is None or v > gt)
    ok = ok and (lt is None or v < lt) and (le is None or v <= le)
    if not ok:
        raise ValueError(f"{op}: {name} must be {rule}, got {v!r}")
    return v


def check_int(op: str, name: str, value, *, ge=None, lt=None) -> int:
    """``int(value)`` for a true integer (bool rejected) within [ge, lt); TypeError or ValueError."""
    if isinstance(value, bool):
        raise TypeError(f"{op}: {name} must be an int, got bool")
    try:
        v = operator.index(value)
    except TypeError:
        raise TypeError(f"{op}: {name} must be an int, got {type(value).__name__}") from None
    if (ge is not None and v < ge) or (lt is not None and v >= lt):
        rule = " and ".join(
            s for s in (f">= {ge}" if ge is not None else "", f"< {lt}" if lt is not None else "") if s
        )
        raise ValueError(f"{op}: {name} must be an int {rule}, got {v}")
    return v


def check_tensor(op: str, name: str, t, dtypes=None, *, contiguous: bool = True) -> torch.Tensor:
    """TypeError unless ``t`` is a tensor of one of ``dtypes``; ValueError if it must be contiguous
    and is not (in-place arguments are never copied silently)."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{op}: {name} must be a torch.Tensor, got {type(t).__name__}")
    if dtypes is not None and t.dtype not in dtypes:
        raise TypeError(f"{op}: {name} must be {_names(dtypes)}, got {t.dtype}")
    if contiguous and not t.is_contiguous():
        raise ValueError(
            f"{op}: {name} must be contiguous (call .contiguous() first; an in-place argument "
            "is never copied silently)"
        )
    return t


def check_adamw_hyper(
    op: str, *, step, lr, beta1, beta2, eps, weight_decay, grad_scale=1.0, seed=0, offset=0
) -> dict:
    """Validates AdamW hyper-parameters by the rules of ``_adamw_rules`` (those of the kernels:
    finite, lr >= 0, 0 <= beta < 1, eps > 0, weight_decay >= 0, step >= 1, grad_scale finite in
    float32, 0 <= seed < 2**64, offset >= 0; TypeError for a wrong type, ValueError for a bad
    value) and returns them normalised (floats and ints) as a dict of keyword arguments."""
    lr, beta1, beta2, eps, weight_decay = _rules.check_hypers(
        op, lr=lr, beta1=beta1, beta2=beta2, eps=eps, weight_decay=weight_decay
    )
    return {
        "lr": lr,
        "beta1": beta1,
        "beta2": beta2,
        "eps": eps,
        "weight_decay": weight_decay,
        "step": _rules.check_int(op, "step", step),
        "grad_scale": _rules.check_float(op, "grad_scale", grad_scale),
        "seed": _rules.check_int(op, "seed", seed),
        "offset": _rules.check_int(op, "offset", offset),
    }


def _byte_span(t: torch.Tensor) -> tuple[int, int]:
    """[first, last + 1) bytes a tensor's elements can touch (any strides, storage offset)."""
    start = t.data_ptr()
    last = sum((size - 1) * stride for size, stride in zip(t.shape, t.stride()) if stride > 0)
    first = sum((size - 1) * stride for size, stride in zip(t.shape, t.stride()) if stride < 0)
    return start + first * t.element_size(), start + (last + 1) * t.element_size()


def check_no_overlap(op: str, tensors, *, same_ok=()) -> None:
    """ValueError "op: exp_avg_sq shares memory with exp_avg" when two of the named ``tensors``
    ((name, tensor or None) pairs) on one device have a byte in common: a kernel that writes one
    while reading the other would compute garbage. ``same_ok`` lists name pairs allowed to be
    exactly the same memory (same address, dtype and numel), e.g. ("out", "grad")."""
    live = [(n, t) for n, t in tensors if t is not None and t.numel() > 0]
    for i, (an, a) in enumerate(live):
        a0, a1 = _byte_span(a)
        for bn, b in live[i + 1 :]:
            if a.device != b.device:
                continue
            b0, b1 = _byte_span(b)
            if a0 < b1 and b0 < a1:
                exact = (a0, a1, a.dtype) == (b0, b1, b.dtype)
                if exact and ((an, bn) in same_ok or (bn, an) in same_ok):
                    continue
                allowed = "".join(f"; {x} may be exactly {y}" for x, y in same_ok)
                raise ValueError(
                    f"{op}: {bn} shares memory with {an} (in-place arguments must not overlap"
                    f"{allowed}); pass separate tensors"
                )


def bump_version(*tensors) -> None:
    """Marks tensors written through DLPack as modified in place, as torch's own in-place ops do:
    autograd then refuses a backward that saved their old values instead of using the new ones."""
    for t in tensors:
        if t is not None:
            torch.autograd.graph.increment_version(t)
