"""The optimizer wrap() is given, converted: its param groups and state for OffloadAdamW, and the
hand-over that keeps LR schedulers made on it working."""

from __future__ import annotations

import weakref

import torch

from ..optim import OffloadAdamW
from ..options import WrapOptions


class UnsupportedOptimizerError(ValueError, TypeError):
    """wrap() given an optimizer that is not Adam/AdamW: a ValueError as ramstream's other refused
    values, and a TypeError as TrainStream raises for it."""


def _convert_optimizer(optimizer, model: torch.nn.Module, opts: WrapOptions):
    """(param_groups, state_dict or None) from a torch AdamW/Adam/OffloadAdamW or None."""
    if optimizer is None:
        params = [p for p in model.parameters() if p.requires_grad]
        if not params:
            raise ValueError("wrap(): the model has no trainable parameters")
        return [{"params": params, "lr": opts.lr}], None, {}
    if isinstance(optimizer, OffloadAdamW):
        sd = optimizer.state_dict()
        optimizer.close()
        return list(optimizer.param_groups), sd, {}
    if type(optimizer) in (torch.optim.AdamW, torch.optim.Adam):
        name = type(optimizer).__name__
        for g in optimizer.param_groups:
            if g.get("amsgrad") or g.get("maximize"):
                raise ValueError(f"wrap(): {name} with amsgrad or maximize is not supported")
            if (
                name == "Adam"
                and g.get("weight_decay", 0) != 0
                and not g.get("decoupled_weight_decay", False)
            ):
                raise ValueError(
                    "wrap(): torch.optim.Adam with weight_decay != 0 adds L2 decay to "
                    "the gradient, which ramstream's AdamW does not do; use "
                    "torch.optim.AdamW, or Adam with weight_decay=0"
                )
        sd = optimizer.state_dict() if optimizer.state else None
        # the same group dicts: what an LR scheduler of the given optimizer writes, we read
        return list(optimizer.param_groups), sd, {}
    raise UnsupportedOptimizerError(
        f"wrap(): optimizer of type {type(optimizer).__name__} is not accepted; "
        "accepted: torch.optim.AdamW, torch.optim.Adam, ramstream.OffloadAdamW, None"
    )


def _hand_over(old: torch.optim.Optimizer, new: OffloadAdamW) -> None:
    """The given optimizer shares its param group dicts with the new one (set up by
    _convert_optimizer), so LR schedulers created on it before wrap() keep working; its state,
    now in host RAM, is dropped (device memory it held is freed); torch's schedulers check
    `_opt_called` to warn about a scheduler stepped before its optimizer: the new optimizer's
    steps count."""
    if not isinstance(old, OffloadAdamW):
        old.state.clear()
    ref = weakref.ref(old)

    def mark_called() -> None:
        o = ref()
        if o is not None:
            o._opt_called = True

    new._step_callbacks.append(mark_called)
