"""A step larger than the one wrap() planned for is checked against the plan before it runs: a
forward pre-hook on the wrapped model reads the step's batch x seq, and for a size not seen yet
re-plans with the weights where they are (planner.plan_training with the streamed blocks and the
recomputed ones fixed). When that cannot fit, the forward raises PlanOutOfMemoryError (a
torch.OutOfMemoryError and a MemoryError) with the arithmetic before anything ran, so nothing is
lost: re-wrap with batch= and seq= (wrap() then streams what that step needs)."""

from __future__ import annotations

import warnings

import torch

from ..planner.plan import plan_training
from ..planner.result import PlanError

_GIB = 2**30


class PlanOutOfMemoryError(torch.OutOfMemoryError, MemoryError):
    """A step does not fit the plan wrap() applied (raised before the step ran: nothing changed)."""


def step_tokens(args, kwargs) -> tuple[int, int] | None:
    """(batch, seq) of a forward's input: input_ids / inputs_embeds / idx / x, else the first tensor
    argument (integer ids: [batch, seq]; embeddings: [batch, seq, hidden]); None when unknown."""
    names = ("input_ids", "inputs_embeds", "hidden_states", "idx", "x")
    cand = [kwargs.get(k) for k in names] + list(args)
    for t in cand:
        if not isinstance(t, torch.Tensor):
            continue
        if t.is_floating_point() and t.dim() >= 3 or not t.is_floating_point() and t.dim() >= 2:
            return int(t.shape[0]), int(t.shape[1])
        if not t.is_floating_point() and t.dim() == 1:
            return 1, int(t.shape[0])
    return None


class StepCheck:
    """The pre-hook: `shape` and `profile` are what the plan was made on, `fixed` the plan options
    that pin the applied placement (param_offload, activation_checkpointing as block lists)."""

    def __init__(self, shape, profile, fixed: dict, log, history: list, strict: bool = True) -> None:
        self.shape, self.profile, self.fixed, self.log, self.history = shape, profile, fixed, log, history
        # strict=False (activation paging asked for: the plan's model of paged recomputed blocks is
        # coarse) warns and lets the step run instead of refusing it
        self.strict = strict
        self.fits_up_to = shape.tokens  # the largest step known to fit
        self.refused: dict = {}

    def __call__(self, module, args, kwargs):
        bs = step_tokens(args, kwargs)
        if bs is None or bs[0] * bs[1] <= self.fits_up_to or not torch.is_grad_enabled():
            return None
        if bs in self.refused:
            raise PlanOutOfMemoryError(self.refused[bs])
        shape = self.shape.with_tokens(batch=bs[0], seq=bs[1])
        try:
            plan = plan_training(shape, self.profile, quantize="none", _suggest=False, **self.fixed)
        except PlanError as e:
            msg = (
                f"ramstream: this step's batch {bs[0]} x seq {bs[1]} does not fit the plan wrap() applied "
                f"(made for batch {self.shape.batch} x seq {self.shape.seq}; nothing ran, nothing changed):\n"
                f"{e}\nre-wrap with wrap(..., batch={bs[0]}, seq={bs[1]}) so that the plan streams and "
                "recomputes what this step needs, or use a smaller step"
            )
            if not self.strict:
                self.fits_up_to = bs[0] * bs[1]
                self.log("plan (not enforced with activation paging): " + msg.replace("ramstream: ", "", 1))
                self.history.append({"step_tokens": bs[0] * bs[1], "change": "warned: may not fit the plan"})
                warnings.warn(msg, RuntimeWarning, stacklevel=3)
                return None
            self.refused[bs] = msg
            self.history.append({"step_tokens": bs[0] * bs[1], "change": "refused: does not fit the plan"})
            raise PlanOutOfMemoryError(msg) from None
        self.fits_up_to = bs[0] * bs[1]
        vram = plan.memory["vram"]
        self.log(
            f"plan: a step of batch {bs[0]} x seq {bs[1]} fits the applied plan (VRAM "
            f"{vram['total'] / _GIB:.2f} of {vram['budget'] / _GIB:.2f} GiB predicted)"
        )
        self.history.append(
            {"step_tokens": bs[0] * bs[1], "change": "checked: fits", "predicted_vram_bytes": vram["total"]}
        )
        return None
