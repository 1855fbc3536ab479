"""One set of AdamW hyper-parameter rules everywhere: OffloadAdamW, the engine's param groups, the
tensor functions (host and CUDA checks) and the compiled kernel accept and refuse the same values,
and their errors name the argument with the same words (ramstream/ops/_adamw_rules.py and
cpp/include/ramstream/adamw_rules.h). The expected verdicts come from the documented rules,
written out here independently."""

from __future__ import annotations

import math
import re

import numpy as np
import pytest
import torch

import ramstream
import ramstream.functional as F
from ramstream._native import lib
from ramstream.ops import _checks

C = lib()
GOOD = {"lr": 1e-3, "beta1": 0.9, "beta2": 0.999, "eps": 1e-8, "weight_decay": 1e-2}
ACCEPTED = {
    "lr": "a finite float >= 0",
    "beta1": "a finite float in [0, 1)",
    "beta2": "a finite float in [0, 1)",
    "eps": "a finite float > 0",
    "weight_decay": "a finite float >= 0",
}
IN_RANGE = {
    "lr": lambda v: v >= 0,
    "beta1": lambda v: 0 <= v < 1,
    "beta2": lambda v: 0 <= v < 1,
    "eps": lambda v: v > 0,
    "weight_decay": lambda v: v >= 0,
}
BELOW_ONE = math.nextafter(1.0, 0.0)
VALUES = [
    0.0,
    -0.0,
    1e-3,
    0.5,
    BELOW_ONE,
    1.0,
    1e300,
    -1e-300,
    5e-324,
    -1.0,
    float("nan"),
    float("inf"),
    -float("inf"),
    0,
    2,
    10**400,
    np.float32(0.25),
    np.float64(2.0),
    torch.tensor(0.5),
    torch.tensor([0.125]),
    torch.tensor(0.0, dtype=torch.float64),
    torch.tensor(3),
    torch.tensor([0.1, 0.2]),
    torch.tensor(True),
    True,
    False,
    "0.1",
    None,
    [0.1],
    1j,
]


def verdict(rule, value):
    """'ok', 'value' (a number outside the rule) or 'type', from the documented rules."""
    if isinstance(value, (bool, str, list, complex)) or value is None:
        return "type"
    if torch.is_tensor(value):
        if value.numel() != 1 or value.dtype == torch.bool:
            return "type"
        value = value.item()
    try:
        v = float(value)
    except OverflowError:  # an int beyond float's range
        v = math.inf
    return "ok" if math.isfinite(v) and IN_RANGE[rule](v) else "value"


CASES = [(rule, v) for rule in GOOD for v in VALUES]
IDS = [f"{rule}={v!r}"[:40] for rule, v in CASES]


def _expect(kind, exc_for_type, words):
    if kind == "ok":
        return None
    return pytest.raises(ValueError if kind == "value" else exc_for_type, match=words)


def _run(ctx, fn):
    if ctx is None:
        fn()
    else:
        with ctx:
            fn()


@pytest.mark.parametrize("rule,value", CASES, ids=IDS)
def test_tensor_functions_follow_the_rules(rule, value):
    kind = verdict(rule, value)
    n = 8
    p, g = torch.ones(n), torch.full((n,), 0.5)
    m, v = torch.zeros(n), torch.zeros(n)
    hyper = GOOD | {rule: value}
    _run(
        _expect(kind, TypeError, rf"adamw_: {rule} must be {re.escape(ACCEPTED[rule])}"),
        lambda: F.adamw_(p, g, m, v, step=1, **hyper),
    )
    assert torch.equal(m, torch.zeros(n)) != (kind == "ok")  # written only when accepted
    # the CUDA function checks the same rules before it needs a GPU
    _run(
        _expect(kind, TypeError, rf"adamw_: {rule} must be"),
        lambda: _checks.check_adamw_hyper("adamw_", step=1, **hyper),
    )


@pytest.mark.parametrize(
    "rule,value",
    [c for c in CASES if isinstance(c[1], float)],
    ids=[i for i, c in zip(IDS, CASES) if isinstance(c[1], float)],
)
def test_the_compiled_kernel_follows_the_same_rules_with_the_same_words(rule, value):
    kind = verdict(rule, value)
    z = [torch.zeros(4) for _ in range(4)]
    ctx = (
        None
        if kind == "ok"
        else pytest.raises(ValueError, match=rf"^adamw: {rule} must be {re.escape(ACCEPTED[rule])}, got ")
    )
    _run(ctx, lambda: C.adamw_(*z, None, step=1, **(GOOD | {rule: value})))


def _optimizer_kwargs(rule, value):
    kw = {
        "lr": GOOD["lr"],
        "betas": (GOOD["beta1"], GOOD["beta2"]),
        "eps": GOOD["eps"],
        "weight_decay": GOOD["weight_decay"],
    }
    if rule == "beta1":
        kw["betas"] = (value, GOOD["beta2"])
    elif rule == "beta2":
        kw["betas"] = (GOOD["beta1"], value)
    else:
        kw[rule] = value
    return kw


NAMES = {
    "lr": "lr",
    "beta1": r"betas\[0\]",
    "beta2": r"betas\[1\]",
    "eps": "eps",
    "weight_decay": "weight_decay",
}
GROUP_NAMES = {
    "lr": r"\['lr'\]",
    "beta1": r"\['betas'\]\[0\]",
    "beta2": r"\['betas'\]\[1\]",
    "eps": r"\['eps'\]",
    "weight_decay": r"\['weight_decay'\]",
}


@pytest.mark.parametrize("rule,value", CASES, ids=IDS)
def test_offload_adamw_and_the_engine_follow_the_rules(rule, value):
    """Options are ValueErrors whatever is wrong with them (as every other option)."""
    kind = verdict(rule, value)
    words = re.escape(ACCEPTED[rule])
    model = torch.nn.Linear(4, 3)
    _run(
        _expect(kind, ValueError, rf"OffloadAdamW: {NAMES[rule]} must be {words}, got "),
        lambda: ramstream.OffloadAdamW(model.parameters(), **_optimizer_kwargs(rule, value)),
    )
    # the same value set in a param group later (a scheduler, the user) is checked at step()
    opt = ramstream.OffloadAdamW(model.parameters(), eager_updates=False)
    try:
        group = opt.param_groups[0]
        for k, v in _optimizer_kwargs(rule, value).items():
            group[k] = v
        before = model.weight.detach().clone()
        model(torch.ones(2, 4)).sum().backward()
        ctx = _expect(
            kind, ValueError, rf"ramstream: param_groups\[0\]{GROUP_NAMES[rule]} must be {words}, got "
        )
        _run(ctx, opt.step)
        opt.synchronize()
        if kind != "ok":  # refused before anything changed
            assert torch.equal(model.weight.detach(), before)
    finally:
        opt.close()


@pytest.mark.parametrize("betas", [(0.9,), (0.9, 0.99, 0.999), 0.9, None, "ab"])
def test_betas_must_be_a_pair(betas):
    model = torch.nn.Linear(2, 2)
    with pytest.raises(ValueError, match=r"OffloadAdamW: betas must be a pair \(beta1, beta2\)"):
        ramstream.OffloadAdamW(model.parameters(), betas=betas)
    opt = ramstream.OffloadAdamW(model.parameters(), eager_updates=False)
    try:
        opt.param_groups[0]["betas"] = betas
        model(torch.ones(1, 2)).sum().backward()
        with pytest.raises(ValueError, match=r"param_groups\[0\]\['betas'\] must be a pair"):
            opt.step()
    finally:
        opt.close()


@pytest.mark.parametrize(
    "rule,value,kind",
    [
        ("step", 0, ValueError),
        ("step", 2**63, ValueError),
        ("step", 1.0, TypeError),
        ("step", True, TypeError),
        ("step", np.int64(3), None),
        ("seed", -1, ValueError),
        ("seed", 2**64 - 1, None),
        ("seed", 2**64, ValueError),
        ("seed", "0", TypeError),
        ("grad_scale", 1e39, ValueError),
        ("grad_scale", -3.4e38, None),
        ("grad_scale", None, TypeError),
    ],
)
def test_step_seed_and_grad_scale_rules_are_shared(rule, value, kind):
    n = 8
    args = {"step": 1} | {rule: value}
    for call in (
        lambda: F.adamw_(torch.ones(n), torch.ones(n), torch.zeros(n), torch.zeros(n), **GOOD, **args),
        lambda: _checks.check_adamw_hyper("adamw_", **GOOD, **args),
    ):
        _run(None if kind is None else pytest.raises(kind, match=rf"adamw_: {rule} must be an? "), call)
