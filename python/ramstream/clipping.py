"""Gradient clipping of a wrapped model: OffloadAdamW.clip_grad_norm_ (what Accelerate and FSDP
users call), and the guard on torch.nn.utils.clip_grad_norm_ / clip_grad_value_ that routes a
wrapped model's parameters to it or raises, so that neither is ever silently wrong.

A wrapped model's gradients leave the device during backward (p.grad is None afterwards), so
torch's functions would see no gradient, return 0 and clip nothing. The engine computes the
global norm on the host (squared norms summed in double) and scales this step's update by
clip_grad_norm_'s factor; that is possible only while the updates wait for step(): with
max_grad_norm= given to wrap(), or eager_updates=False.

The guard replaces the names in torch.nn.utils and torch.nn.utils.clip_grad once per process,
when the first OffloadAdamW is built; other parameters go to torch's own functions unchanged.
Code that bound the function before that (`from torch.nn.utils import clip_grad_norm_` at import
time) keeps torch's: call optimizer.clip_grad_norm_ there. Accelerate 1.x and transformers 5.x
look the name up at each call (Trainer -> accelerator.clip_grad_norm_ ->
torch.nn.utils.clip_grad_norm_), so the guard sees them.
"""

from __future__ import annotations

import math
import weakref

import torch

_optimizers: "weakref.WeakSet" = weakref.WeakSet()  # live OffloadAdamW instances
_originals: dict = {}  # name -> torch's function

DEFERRED = (
    "gradients leave the device during backward and, with eager_updates=True (the default) and "
    "no max_grad_norm, each bucket is updated as soon as its gradients are complete, before any "
    "clipping could apply. Pass max_grad_norm=<float> to ramstream.wrap() (it clips by the "
    "global norm itself; optimizer.clip_grad_norm_ then returns that norm and sets the limit "
    "for the step), or eager_updates=False (updates wait for step(), so "
    "optimizer.clip_grad_norm_ and torch.nn.utils.clip_grad_norm_ can clip them)"
)


def register(opt) -> None:
    """opt (an OffloadAdamW) takes part in the guard, which is installed on first use."""
    _optimizers.add(opt)
    install()


def check_max_norm(max_norm, norm_type) -> float:
    """max_norm as a float; ValueError naming the argument otherwise."""
    if torch.is_tensor(max_norm) and max_norm.numel() == 1:
        max_norm = float(max_norm)
    if (
        isinstance(max_norm, bool)
        or not isinstance(max_norm, (int, float))
        or math.isnan(max_norm)
        or max_norm < 0
    ):
        raise ValueError(
            f"clip_grad_norm_: max_norm={max_norm!r}; accepted: a number >= 0 "
            "(float('inf') returns the norm without clipping)"
        )
    if isinstance(norm_type, bool) or not isinstance(norm_type, (int, float)) or norm_type != 2:
        raise ValueError(
            f"clip_grad_norm_: norm_type={norm_type!r} is not supported for a "
            "ramstream-wrapped model; accepted: 2.0 (the engine sums squared norms "
            "on the host)"
        )
    return float(max_norm)


def engine_norm(e, max_norm: float) -> float:
    """The global L2 norm of the gradients gathered since the last step (0.0 when none); this
    step's clip limit becomes max_norm. Waits for the gradients still landing."""
    if e.max_grad_norm is None and e.eager_updates:
        raise RuntimeError(
            "ramstream: clip_grad_norm_ cannot clip a wrapped model's gradients here: " + DEFERRED
        )
    e.recover_if_abandoned()
    intake, updater = e.intake, e.updater
    if intake.in_backward:
        raise RuntimeError("ramstream: clip_grad_norm_ called during backward")
    if intake.micro == 0:
        return 0.0
    if updater.clip_now is not None and updater.clip_now[2] == intake.micro:
        norm = updater.clip_now[1]  # called again (Trainer logs the norm it clipped by)
    else:
        todo = [s for s in e.slots if s.arrivals > 0 and not s.updated]
        if e.max_grad_norm is not None and intake.micro < e.accumulation_steps:
            updater.norms_now(todo)  # the landings take norms in the last micro-batch only
        elif e.max_grad_norm is None:  # eager_updates=False: no norm taken while landing
            updater.norms_now(todo, accumulated=e.accumulation_steps > 1)
        norm = updater.total_norm()
    updater.clip_now = (max_norm, norm, intake.micro)
    return norm


def resident_norm(r, max_norm: float) -> float:
    """As engine_norm, for the device-side optimizer of offload="auto" (updates run in step())."""
    r.recover_if_abandoned()
    if r._in_backward:
        raise RuntimeError("ramstream: clip_grad_norm_ called during backward")
    if r._clip_now is not None and not r._clip_stale:
        norm = r._clip_now[1]
    else:
        norm = math.sqrt(r._sq_norm(r.grads.values())) if r.grads else 0.0
    r._clip_now, r._clip_stale = (max_norm, norm), False
    return norm


# ---- the guard on torch.nn.utils ----------------------------------------------------------------
def _owner(params: list):
    """(optimizer, ids of its trainable parameters) for the wrapped parameters among params, or
    (None, None) when none is wrapped."""
    given = {id(p) for p in params}
    for opt in list(_optimizers):
        if opt._closed:
            continue
        ids = {id(p) for g in opt.param_groups for p in g["params"] if p.requires_grad}
        if ids & given:
            return opt, ids
    return None, None


def _as_list(parameters) -> list:
    return [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)


def _check_whole(params: list, ids: set) -> None:
    others = sum(1 for p in params if id(p) not in ids and p.grad is not None)
    missing = len(ids - {id(p) for p in params})
    if others or missing:
        raise ValueError(
            "torch.nn.utils.clip_grad_norm_: ramstream clips a wrapped model's global norm only, "
            f"but the parameters given leave out {missing} of its trainable parameters and add "
            f"{others} others that have gradients: pass exactly the wrapped model's parameters "
            "(model.parameters()) and clip any others separately, or call "
            "optimizer.clip_grad_norm_(max_norm)"
        )


def _guarded_norm(parameters, max_norm, norm_type=2.0, error_if_nonfinite=False, foreach=None):
    params = _as_list(parameters)
    opt, ids = _owner(params)
    if opt is None:
        return _originals["clip_grad_norm_"](
            params, max_norm, norm_type=norm_type, error_if_nonfinite=error_if_nonfinite, foreach=foreach
        )
    _check_whole(params, ids)
    norm = opt.clip_grad_norm_(max_norm, norm_type=norm_type)
    if error_if_nonfinite and not bool(torch.isfinite(norm)):
        raise RuntimeError(
            f"The total norm of order {float(norm_type)} for gradients from "
            "`parameters` is non-finite, so it cannot be clipped. To disable this "
            "error and scale the gradients by the non-finite norm anyway, set "
            "`error_if_nonfinite=False`"
        )
    return norm


def _guarded_value(parameters, clip_value, foreach=None):
    params = _as_list(parameters)
    opt, _ = _owner(params)
    if opt is None:
        return _originals["clip_grad_value_"](params, clip_value, foreach=foreach)
    raise RuntimeError(
        "torch.nn.utils.clip_grad_value_ cannot clip a ramstream-wrapped model's gradients: they "
        "leave the device during backward (p.grad is None afterwards) and ramstream clips by the "
        "global norm only. Clip by norm instead: pass max_grad_norm=<float> to ramstream.wrap(), "
        "or call optimizer.clip_grad_norm_(max_norm) (with max_grad_norm= or eager_updates=False)"
    )


def install() -> None:
    """Replaces clip_grad_norm_ and clip_grad_value_ in torch.nn.utils and
    torch.nn.utils.clip_grad, once per process (torch.nn.utils.clip_grad_norm, the deprecated
    name, calls the module's clip_grad_norm_ and so reaches the guard too)."""
    if _originals:
        return
    import torch.nn.utils as utils
    from torch.nn.utils import clip_grad

    _originals["clip_grad_norm_"] = clip_grad.clip_grad_norm_
    _originals["clip_grad_value_"] = clip_grad.clip_grad_value_
    for name, fn in (("clip_grad_norm_", _guarded_norm), ("clip_grad_value_", _guarded_value)):
        fn.__doc__ = (
            f"ramstream's guard on torch's {name}: the parameters of a model wrapped by "
            "ramstream go to ramstream (ramstream/clipping.py), others to torch's "
            f"function, documented below.\n\n{_originals[name].__doc__ or ''}"
        )
        for mod in (utils, clip_grad):
            setattr(mod, name, fn)
