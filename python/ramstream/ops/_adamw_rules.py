"""The AdamW hyper-parameter rules in one place: what each accepts, and the error naming a bad one.

Used by OffloadAdamW (its defaults), the engine (every param group, at each step), the tensor
functions (``ramstream.ops.adamw.adamw_``, ``ramstream.ops.cuda.adamw_``) and
``_checks.check_adamw_hyper``. The compiled kernels apply the same rules with the same words
(``cpp/include/ramstream/adamw_rules.h``), so a value accepted here is never refused there.

A float hyper-parameter is a real number (bool excluded) or a one-element real tensor, as
``torch.optim.AdamW`` accepts for lr and betas; its value must be finite and within its range.
An int is a true integer (``operator.index``; bool excluded). Errors name the caller, the
argument and what is accepted: "adamw_: beta1 must be a finite float in [0, 1), got 1.0". A value
of the wrong type raises ``type_error`` (TypeError for the tensor functions; ValueError where the
optimizer's options are checked, like every other option).
"""

from __future__ import annotations

import math
import numbers
import operator

import torch

__all__ = [
    "FLOAT32_MAX",
    "FLOAT_RULES",
    "INT_RULES",
    "check_betas",
    "check_float",
    "check_group",
    "check_hypers",
    "check_int",
]

FLOAT32_MAX = 3.4028234663852886e38

# rule -> (what is accepted, the test of a finite value)
FLOAT_RULES = {
    "lr": ("a finite float >= 0", lambda v: v >= 0),
    "beta1": ("a finite float in [0, 1)", lambda v: 0 <= v < 1),
    "beta2": ("a finite float in [0, 1)", lambda v: 0 <= v < 1),
    "eps": ("a finite float > 0", lambda v: v > 0),
    "weight_decay": ("a finite float >= 0", lambda v: v >= 0),
    "grad_scale": ("a finite float within float32's range", lambda v: abs(v) <= FLOAT32_MAX),
}
# rule -> (what is accepted, lowest, first value above the range)
INT_RULES = {
    "step": ("an int in [1, 2**63)", 1, 1 << 63),
    "seed": ("an int in [0, 2**64)", 0, 1 << 64),
    "offset": ("an int in [0, 2**63)", 0, 1 << 63),
}


def _real(value) -> float | None:
    """float(value) for a real number or a one-element real tensor; None for anything else."""
    if torch.is_tensor(value):
        if value.numel() != 1 or value.dtype == torch.bool or value.is_complex():
            return None
        value = value.item()
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        return None
    try:
        return float(value)
    except OverflowError:  # an int beyond float's range
        return math.inf if value > 0 else -math.inf


def check_float(
    where: str, rule: str, value, *, name: str | None = None, type_error: type[Exception] = TypeError
) -> float:
    """The float value of hyper-parameter ``rule`` (a key of FLOAT_RULES), reported as ``name``."""
    accepted, ok = FLOAT_RULES[rule]
    name = rule if name is None else name
    v = _real(value)
    if v is None:
        raise type_error(f"{where}: {name} must be {accepted}, got {value!r} ({type(value).__name__})")
    if not math.isfinite(v) or not ok(v):
        raise ValueError(f"{where}: {name} must be {accepted}, got {v!r}")
    return v


def check_int(
    where: str, rule: str, value, *, name: str | None = None, type_error: type[Exception] = TypeError
) -> int:
    """The int value of ``rule`` (a key of INT_RULES: step, seed, offset)."""
    accepted, lo, hi = INT_RULES[rule]
    name = rule if name is None else name
    try:
        v = None if isinstance(value, bool) else operator.index(value)
    except TypeError:
        v = None
    if v is None:
        raise type_error(f"{where}: {name} must be {accepted}, got {value!r} ({type(value).__name__})")
    if not lo <= v < hi:
        raise ValueError(f"{where}: {name} must be {accepted}, got {v}")
    return v


def check_hypers(
    where: str,
    *,
    lr,
    beta1,
    beta2,
    eps,
    weight_decay,
    names: dict | None = None,
    type_error: type[Exception] = TypeError,
) -> tuple[float, float, float, float, float]:
    """(lr, beta1, beta2, eps, weight_decay) as floats, checked in that order; ``names`` maps a rule
    to the name the caller's user knows (e.g. "beta1" -> "betas[0]")."""
    names = names or {}
    values = {"lr": lr, "beta1": beta1, "beta2": beta2, "eps": eps, "weight_decay": weight_decay}
    return tuple(
        check_float(where, rule, v, name=names.get(rule), type_error=type_error) for rule, v in values.items()
    )


def check_betas(where: str, betas, *, name: str = "betas") -> tuple:
    """The two betas of a (beta1, beta2) pair; ValueError when ``betas`` is not a pair."""
    if not isinstance(betas, (tuple, list)) or len(betas) != 2:
        raise ValueError(
            f"{where}: {name} must be a pair (beta1, beta2) of finite floats in [0, 1), got {betas!r}"
        )
    return betas[0], betas[1]


def check_group(where: str, group: dict, index: int) -> tuple[float, float, float, float, float]:
    """(lr, beta1, beta2, eps, weight_decay) of param group ``index`` as floats; every error is a
    ValueError naming the entry, e.g. "ramstream: param_groups[0]['betas'][1] must be ..."."""
    g = f"param_groups[{index}]"
    b1, b2 = check_betas(where, group["betas"], name=f"{g}['betas']")
    names = {
        "lr": f"{g}['lr']",
        "beta1": f"{g}['betas'][0]",
        "beta2": f"{g}['betas'][1]",
        "eps": f"{g}['eps']",
        "weight_decay": f"{g}['weight_decay']",
    }
    return check_hypers(
        where,
        lr=group["lr"],
        beta1=b1,
        beta2=b2,
        eps=group["eps"],
        weight_decay=group["weight_decay"],
        names=names,
        type_error=ValueError,
    )
