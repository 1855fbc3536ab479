"""A dense loss that runs out of memory in a step the plan fit only by assuming a chunked loss (issue
24): wrap() cannot see the loss, so the step check (runtime/tokens.py) may plan a step as if its loss
were chunked (planner/revise.py loss_open; the session's loss source is then "assumed"). When the
user's loss is dense after all and torch runs out of memory, the error says why and what to do.

Where it is caught, and why there:
- In the wrapped model's own call. A model that computes its loss in forward (Hugging Face's
  model(x, labels=y), a GPT whose forward takes targets) builds the dense logits inside that call,
  after every block. guard_forward puts a thin wrapper on the model instance's ``forward`` (as
  activations/recompute.py does for recomputed blocks, and accelerate's hooks do): a
  torch.OutOfMemoryError raised in it during an assumed step becomes PlanOutOfMemoryError (a
  torch.OutOfMemoryError too, chained to torch's) with the arithmetic. Not a forward hook: torch's
  ``always_call`` hooks see the error but may not replace it; not torch's allocator or autograd:
  nothing of torch is patched. A forward updates nothing, so weights and optimizer state are as
  before the step (the "nothing is lost" contract of tests/test_wrap_oom.py: drop the step with
  optimizer.zero_grad() and go on).
- Anywhere else (a loss computed outside the model on the logits it returned, a loss's backward):
  no frame of ramstream's is on the stack, so the error cannot be changed. The next forward's step
  check reads the allocator's count of out-of-memory errors (runtime/measure.py oom_count: CUDA's
  "num_ooms"), and when it grew during the last assumed step, it logs the explanation, records it in
  the plan history (memory_report(model)["plan"]["history"]) and warns. The CPU engine keeps no count.

Nothing changes when the loss was given (wrap(loss=...): no wrapper) or a chunked loss was seen on
the model's head (runtime/heads.py): the wrapper lets every error through as it is."""

from __future__ import annotations

import functools
import types
import weakref
from dataclasses import dataclass

import torch

from ..planner.shape import LOSS_CHUNK

_GIB = 2**30


@dataclass(frozen=True)
class AssumedStep:
    """A step planned as if its loss were chunked: its batch x seq, the vocabulary, the bytes per
    logit the dense loss needs (the logits in the activation dtype, their fp32 copy and gradient:
    planner/shape.py logits_bytes), and the allocator's out-of-memory count when it began (None:
    not counted)."""

    batch: int
    seq: int
    vocab: int
    elem_bytes: int
    ooms: int | None = None

    @property
    def tokens(self) -> int:
        return self.batch * self.seq

    @property
    def per_logit(self) -> int:
        return self.elem_bytes + 8

    @property
    def dense_bytes(self) -> int:
        return self.tokens * self.vocab * self.per_logit

    @property
    def counted_tokens(self) -> int:
        return min(self.tokens, LOSS_CHUNK)

    @property
    def counted_bytes(self) -> int:
        return self.counted_tokens * self.vocab * self.per_logit

    def fields(self) -> dict:
        """The numbers, for PlanOutOfMemoryError.assumed and the plan history."""
        return {
            "batch": self.batch, "seq": self.seq, "tokens": self.tokens, "vocab": self.vocab,
            "bytes_per_logit": self.per_logit, "dense_logits_bytes": self.dense_bytes,
            "counted_logits_bytes": self.counted_bytes,
        }  # fmt: skip


def assumed_step(shape, bs: tuple[int, int], ooms: int | None) -> AssumedStep:
    """The AssumedStep of batch x seq `bs` for the session's shape (planner/shape.py ModelShape)."""
    return AssumedStep(bs[0], bs[1], int(shape.vocab), int(shape.act_elem_bytes), ooms)


def explain(step: AssumedStep, where: str, *, unchanged: bool) -> str:
    """The explanation: what the plan assumed, the dense logits as arithmetic, what to do.
    where: where the error was raised; unchanged: whether weights and optimizer state are known to
    be as before the step."""
    state = (
        "Weights and optimizer state are unchanged (nothing was updated: drop the step with "
        "optimizer.zero_grad() and go on)."
        if unchanged
        else "A step that failed before optimizer.step() updated nothing: drop it with optimizer.zero_grad()."
    )
    return (
        f"ramstream: out of memory {where}. The plan for this batch {step.batch} x seq {step.seq} assumed "
        "a chunked loss because the dense logits do not fit: "
        f"{step.tokens} tokens x {step.vocab} vocab x {step.per_logit} bytes (the logits at "
        f"{step.elem_bytes} bytes, their fp32 copy and gradient at 8) = {step.dense_bytes} bytes = "
        f"{step.dense_bytes / _GIB:.2f} GiB, where the plan counted one chunk of {step.counted_tokens} tokens "
        f"({step.counted_bytes / _GIB:.2f} GiB); a dense loss (F.cross_entropy on the full logits, or "
        f"model(..., labels=...)) needs them all. {state} Compute the loss chunked: "
        "ramstream.chunked_cross_entropy(hidden, head.weight, targets) or ramstream.causal_lm_loss "
        "(wrap_hf: model.ramstream_loss(input_ids=..., labels=...); OffloadTrainer: "
        "ramstream={'chunked_loss': True}, its default), and pass wrap(..., loss='chunked') so that the "
        "plan counts it from the start; or use a smaller batch (docs/planning.md)."
    )


def guard_forward(model: torch.nn.Module, check):
    """Puts the wrapper on model.forward (see the module docstring); check.dense_oom(error) says
    what to raise instead (None: raise it as it is). Returns a handle whose remove() takes it off.
    The wrapper is bound to the model and wraps the class's forward function (``__wrapped__``), as
    a plain forward is: inspect.signature (Hugging Face's Trainer reads it) sees the model's own
    arguments, and accelerate's autocast wrapper and its unwrapping (which rebinds the innermost
    function) work as on an unwrapped model."""
    had = model.__dict__.get("forward")  # an instance forward already there (None: the class's)
    inner = model.forward
    ref = weakref.ref(check)

    def guarded(run, *args, **kwargs):
        try:
            return run(*args, **kwargs)
        except torch.OutOfMemoryError as e:
            c = ref()
            err = c.dense_oom(e) if c is not None else None
            if err is None:
                raise
            raise err from e

    func = getattr(inner, "__func__", None)
    if func is None:  # an instance forward that is a plain function: wrap it as it is
        forward = functools.wraps(inner)(functools.partial(guarded, inner))
    else:

        def method(self, *args, **kwargs):
            # `self`, not the model captured here: copy.deepcopy(model) rebinds the method to the
            # copy, whose forward must then run on the copy
            return guarded(func, self, *args, **kwargs)

        forward = types.MethodType(functools.wraps(func)(method), model)
    model.__dict__["forward"] = forward
    return _Unguard(model, forward, had)


class _Unguard:
    def __init__(self, model, forward, had) -> None:
        self.model, self.forward, self.had = model, forward, had

    def remove(self) -> None:
        d = self.model.__dict__
        if d.get("forward") is not self.forward:  # replaced since: leave it
            return
        if self.had is None:
            del d["forward"]
        else:
            d["forward"] = self.had
