"""A step whose gradients are not finite: the error step() raises, and which parameters had them.

The global norm that clipping needs (max_grad_norm, clip_grad_norm_) is known before any update
of the step is queued, so a NaN or Inf in it stops the step there: no update runs, weights,
master weights, moments and step counts stay as they were, the gradients are dropped and the
next step trains. Which parameters were at fault is looked up only then (the buckets whose
squared norm was not finite, then their slots one by one): nothing is added to a good step.
"""

from __future__ import annotations

import math
import os
import sys
import warnings

import torch

from ..ops import _raw

SHOWN = 5  # parameters named in a message


class NonFiniteGradientError(RuntimeError):
    """optimizer.step() found a NaN or Inf in the gradients' global norm and applied no update.

    Attributes: norm (the global L2 norm, nan or inf), parameters (the names, or shapes where the
    model's names are unknown, of the parameters found with non-finite gradients, in forward
    order; on a data-parallel rank only those whose gradients it holds), step (the number the
    step would have had). A RuntimeError, as torch.nn.utils.clip_grad_norm_(error_if_nonfinite=
    True) raises, so code that catches that keeps working."""

    def __init__(self, message: str, *, norm: float, parameters: list[str], step: int) -> None:
        super().__init__(message)
        self.norm, self.parameters, self.step = norm, parameters, step


def describe(norm: float, names: list[str], step: int, limit: str, skipping: bool) -> str:
    """The message of a skipped step (warning or error); limit: what asked for the norm."""
    if names:
        shown = ", ".join(names[:SHOWN]) + (f" and {len(names) - SHOWN} more" if len(names) > SHOWN else "")
        where = f"non-finite gradients in {len(names)} parameter(s): {shown}"
    else:
        where = "the parameters with non-finite gradients are on other ranks"
    what = (
        f"ramstream: step {step} skipped: the global gradient norm is {norm} ({limit}); {where}. "
        "No update was applied: weights, master weights, moments and step counts are as they "
        "were, the gradients are dropped, and the next step trains. Usual causes: a NaN or Inf "
        "loss (look at this batch), an overflow in low precision, a learning rate too high."
    )
    if not skipping:
        what += " Pass skip_nonfinite=True to wrap() to skip such steps with a warning instead."
    return what


def warn_caller(msg: str) -> None:
    """A RuntimeWarning attributed to the first frame outside ramstream and torch (the user's
    optimizer.step() call, however many wrappers torch's Optimizer adds around step)."""
    inside = (os.path.dirname(os.path.dirname(__file__)), os.path.dirname(torch.__file__))
    level, f = 2, sys._getframe(1)
    while f is not None and f.f_code.co_filename.startswith(inside):
        level, f = level + 1, f.f_back
    warnings.warn(msg, RuntimeWarning, stacklevel=level)


def slot_name(names: dict, s) -> str:
    """A slot's parameter name in the model (engine.names), else its shape."""
    for n, x in names.items():
        if x is s:
            return n
    return f"<parameter of shape {tuple(s.param.shape)}>"


def find_nonfinite(slots, grad_of) -> list:
    """The slots whose gradient (grad_of(slot): a 1-D float tensor, or None when this process
    does not hold it) has a NaN or Inf, in the order given. Only called after a non-finite norm."""
    bad = []
    for s in slots:
        g = grad_of(s)
        if g is None or g.numel() == 0:
            continue
        if g.device.type == "cpu" and g.is_contiguous():
            finite = math.isfinite(_raw.sq_norm_ptr(ptr=g.data_ptr(), dtype=g.dtype, n=g.numel()))
        else:
            finite = bool(torch.isfinite(g).all())
        if not finite:
            bad.append(s)
    return bad
