"""A step larger than the one wrap() planned for is checked against the plan before it runs: a
forward pre-hook on the wrapped model reads the step's batch x seq, and for a size not seen yet
re-plans with the weights where they are (planner.plan_training with the streamed blocks and the
recomputed ones fixed). When that cannot fit, the plan is revised before any block ran: with
activation_checkpointing="auto", the fewest more blocks recompute, taken from the back of the stack
(planner/replan.py order="back"; the weights stay where they are). The check runs in the first
block's call, whose forward torch read before its pre-hooks (Module._call_impl), so the blocks
after it recompute from this very step: the step goes on under the revised plan (logged, in the
plan history). Only when the first block must recompute too (every block must) does the forward
raise PlanOutOfMemoryError (a torch.OutOfMemoryError and a MemoryError) with replanned=True,
saying what changed: nothing ran, so the same step can be re-run as is (OffloadTrainer does it once
by itself). When nothing can change, replanned=False and the error has the arithmetic: re-wrap with
batch= and seq= (wrap() then streams what that step needs).

The loss: unless wrap(loss=...) named it, the plan counts a dense loss's logits until a chunked loss
(ramstream.chunked_cross_entropy / causal_lm_loss) is computed with the model's head weight
(runtime/heads.py calls learn_loss: later steps are planned with the chunked loss, one history
entry). A step that fits only with the chunked loss is not refused meanwhile: it is planned as if
its loss were chunked (logged with the dense logits' size, in the history), and a dense loss may
then run out of memory in the loss itself: runtime/loss_oom.py turns that error, raised in the model's
call, into PlanOutOfMemoryError (``assumed``: the arithmetic), and notices one raised elsewhere at the
next forward (logged, in the history, a warning)."""

from __future__ import annotations

import warnings

import torch

from ..blocks import ranges_text
from ..planner.plan import plan_training
from ..planner.result import PlanError
from ..planner.revise import Measured, RevisionError
from . import loss_oom
from .session import PlanSession

_GIB = 2**30
# the block the check is the forward pre-hook of (runtime/apply.py check_steps: the first)
HOOKED = 0


class PlanOutOfMemoryError(torch.OutOfMemoryError, MemoryError):
    """A step does not fit the plan wrap() applied (raised before the step ran: weights, optimizer
    state and memory are as before it). A step that more blocks recomputing fit, the first block
    keeping its activations, is not refused: the plan is revised and the step goes on.
    ``replanned``: True when the plan was revised for this step and every block, the first too, now
    recomputes (``change`` says how: {"recompute": blocks now, "was": blocks before}), so that
    re-running the same step fits; False when nothing could change (re-wrap with batch= / seq=, or a
    smaller step). ``assumed``: set when a dense loss ran out of memory in a step that the plan fit
    only by assuming a chunked loss (runtime/loss_oom.py; raised from torch's error, in the model's
    call: nothing was updated): the step's numbers ({"batch", "seq", "tokens", "vocab",
    "bytes_per_logit", "dense_logits_bytes", "counted_logits_bytes"}); None otherwise."""

    def __init__(
        self,
        message: str,
        *,
        replanned: bool = False,
        change: dict | None = None,
        assumed: dict | None = None,
    ) -> None:
        super().__init__(message)
        self.replanned, self.change, self.assumed = replanned, change, assumed

    def __reduce__(self):
        return _rebuild, (self.args[0] if self.args else "", self.replanned, self.change, self.assumed)


def _rebuild(message, replanned, change, assumed=None):
    return PlanOutOfMemoryError(message, replanned=replanned, change=change, assumed=assumed)


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


def _blocks_key(fixed: dict):
    """The recomputed and the streamed blocks of `fixed` as a key (lists of indices, or True / False)."""
    out = []
    for k in ("activation_checkpointing", "param_offload"):
        v = fixed.get(k)
        out.append(tuple(v) if isinstance(v, (list, tuple)) else v)
    return tuple(out)


def _ids_tokens(args, kwargs) -> tuple[int, int] | None:
    """(batch, seq) of a whole model's call: token ids ([batch, seq] integers: input_ids, idx or the
    first tensor argument) or inputs_embeds; None for anything else (an image, say)."""
    e = kwargs.get("inputs_embeds")
    if isinstance(e, torch.Tensor) and e.dim() == 3:
        return int(e.shape[0]), int(e.shape[1])
    for t in [kwargs.get("input_ids"), kwargs.get("idx"), *args[:1]]:
        if isinstance(t, torch.Tensor) and not t.is_floating_point() and t.dim() == 2:
            return int(t.shape[0]), int(t.shape[1])
    return None


class StepCheck:
    """The pre-hook: `shape` and `profile` are what the plan was made on, `fixed` the plan options
    that pin the applied placement (param_offload, activation_checkpointing as block lists).
    `lever` (runtime/apply.py RecomputeLever), when given, is what may change between steps: the
    recomputed blocks; without it nothing is re-planned. `streams` (runtime/apply.py StreamLever), when
    given, may make more blocks stream their weights where every block recomputing does not fit.
    The decision is the planner's (planner/revise.py), the change and its record the session's
    (runtime/session.py PlanSession); this hook reads the step's size and says what happened.
    Installed twice: as the first block's pre-hook (__call__: every step passes there) and as the
    model's (before_blocks: when the model itself is called, before any block ran, so that every
    block, the first too, can change for this very step)."""

    def __init__(
        self, shape, profile, fixed: dict, log, history, strict: bool = True, lever=None, fixed_why="",
        streams=None, on_plan=None, disk=None, loss_given: bool = False, on_loss=None, ooms=None,
        state=None, pages=None,
    ) -> None:  # fmt: skip
        self.session = PlanSession(
            shape, profile, fixed, log, history, recompute=lever, streams=streams, on_plan=on_plan, disk=disk,
            loss_given=loss_given, on_loss=on_loss, pages=pages,
        )  # fmt: skip
        self.log = log
        # strict=False (activation paging asked for: the plan's model of paged recomputed blocks is
        # coarse) warns and lets the step run instead of refusing it
        self.strict = strict
        self.fixed_why = fixed_why  # why the recomputed blocks cannot change (without a lever)
        self.fits_up_to = shape.tokens  # the largest step known to fit
        # refused steps' messages, by (batch, seq, blocks recomputing and streaming then): a change
        # of those blocks (a re-plan, the watchdog) may let a refused step fit
        self.refused: dict = {}
        # a dense loss's out-of-memory error in a step planned as if its loss were chunked
        # (runtime/loss_oom.py): ooms() reads the allocator's count (None: not counted); the most
        # tokens the plan counted the dense logits for; the step under way when it was assumed
        self.ooms = ooms or (lambda: None)
        self.dense_fits = shape.tokens
        self.assumed_now = None
        # state(plan): puts the optimizer state where a re-planned step's plan has it (the state of
        # a resident plan starts in VRAM: runtime/optimizer_split.py fit_state_to); its history entry
        self.state = state

    @property
    def shape(self):
        return self.session.shape

    @property
    def profile(self):
        return self.session.profile

    @property
    def fixed(self) -> dict:
        return self.session.fixed

    @property
    def loss(self) -> str:
        """The loss the plan counts now ("dense" or "chunked")."""
        return self.session.shape.loss

    def learn_loss(self, loss: str) -> None:
        """A loss of kind `loss` ran with this model's head (runtime/heads.py): later steps are
        planned with it (never over a loss wrap() was given; once)."""
        if not self.session.set_loss(loss, "seen"):
            return
        self.refused.clear()  # a refused step may fit now
        self.log(f"plan: a {loss} loss ran with this model's head: later steps are planned with it")
        self.session.record({"change": f"loss: {loss} (seen)", "loss": loss})

    def _now(self) -> dict:
        """The plan options as applied now."""
        return self.session.applied()

    def before_blocks(self, module, args, kwargs):
        """The model's pre-hook: nothing of the step ran yet."""
        self._check(_ids_tokens(args, kwargs), hooked=None)

    def __call__(self, module, args, kwargs):
        """The first block's pre-hook: torch read its forward already."""
        self._check(step_tokens(args, kwargs), hooked=HOOKED)

    def _check(self, bs, hooked):
        last, self.assumed_now = self.assumed_now, None
        if last is not None and last.ooms is not None:
            self._noticed(last)
        self._revise(bs, hooked)
        if bs is None or not torch.is_grad_enabled():
            return
        if self.session.loss_source == "assumed":
            if bs[0] * bs[1] > self.dense_fits:
                self.assumed_now = loss_oom.assumed_step(self.shape, bs, self.ooms())
        elif self.loss == "dense":
            self.dense_fits = max(self.dense_fits, bs[0] * bs[1])

    def dense_oom(self, error):
        """The model's call raised `error` (runtime/loss_oom.py guard_forward): the
        PlanOutOfMemoryError to raise instead when the step was planned as if its loss were chunked
        (logged, in the plan history), else None."""
        step, self.assumed_now = self.assumed_now, None
        if step is None or isinstance(error, PlanOutOfMemoryError):
            return None
        msg = loss_oom.explain(step, "in the model's call (the dense loss)", unchanged=True)
        self.log("plan: " + msg.replace("ramstream: ", "", 1))
        self.session.record({"change": "out of memory: a dense loss in a step planned with a chunked loss",
                             "where": "model call", **step.fields()})  # fmt: skip
        return PlanOutOfMemoryError(msg, assumed=step.fields())

    def _noticed(self, step) -> None:
        """The last step was planned as if its loss were chunked: when the allocator ran out of
        memory since it began, outside the model's call (the loss or its backward), say so."""
        n = self.ooms()
        if n is None or n <= step.ooms:
            return
        msg = loss_oom.explain(
            step,
            "in the previous step, outside ramstream's code (the loss, or its backward)",
            unchanged=False,
        )
        self.log("plan: " + msg.replace("ramstream: ", "", 1))
        self.session.record({"change": "out of memory: a dense loss in a step planned with a chunked loss",
                             "where": "outside the model call", **step.fields()})  # fmt: skip
        warnings.warn(msg, RuntimeWarning, stacklevel=4)

    def _revise(self, bs, hooked):
        if bs is None or bs[0] * bs[1] <= self.fits_up_to or not torch.is_grad_enabled():
            return None
        key = (*bs, _blocks_key(self._now()))
        if key in self.refused:
            raise PlanOutOfMemoryError(self.refused[key])
        tokens = bs[0] * bs[1]
        first = 0 if hooked is None else hooked + 1
        try:
            rev = self.session.revise(Measured(*bs), first=first, check_only=not self.strict)
        except RevisionError as e:
            if not self.strict:
                msg = self._advice(bs, e)
                self.fits_up_to = tokens
                self.log("plan (not enforced with activation paging): " + msg.replace("ramstream: ", "", 1))
                self.session.record({"step_tokens": tokens, "change": "warned: may not fit the plan"})
                warnings.warn(msg, RuntimeWarning, stacklevel=3)
                return None
            why = e.why if e.tried else self.fixed_why
            self._refuse(bs, self._advice(bs, e, why, self._rewrap(bs)), "refused: does not fit the plan")
        vram = rev.plan.memory["vram"]
        note = _assumed_note(rev)
        if self.state is not None:
            try:
                moved = self.state(rev.plan)
            except MemoryError as e:  # pinned memory refused: the buckets not moved stay in VRAM
                msg = (
                    f"ramstream: this step's batch {bs[0]} x seq {bs[1]} needs the optimizer state out of "
                    f"VRAM (the plan for it offloads the optimizer), and pinned host memory for it was refused: {e}"
                )
                self._refuse(bs, msg, "refused: pinned memory for the optimizer state")
            if moved is not None:
                self.session.record({"step_tokens": tokens, **moved})
        if not rev.changed:
            self.fits_up_to = tokens
            if rev.assumed:
                self.session.set_loss(rev.assumed, "assumed")
            self.log(
                f"plan: a step of batch {bs[0]} x seq {bs[1]} fits the applied plan (VRAM "
                f"{vram['total'] / _GIB:.2f} of {vram['budget'] / _GIB:.2f} GiB predicted){note}"
            )
            self.session.record(
                {"step_tokens": tokens, "change": "checked: fits" + (f", loss assumed {rev.assumed}" if rev.assumed else ""),
                 "predicted_vram_bytes": vram["total"], **_assumed_entry(rev)}
            )  # fmt: skip
            return None
        was = (self.shape.batch, self.shape.seq)
        try:
            change = self.session.apply(rev)
        except MemoryError as e:  # pinned memory for the blocks to stream: nothing changed
            msg = f"ramstream: this step's batch {bs[0]} x seq {bs[1]} does not fit the applied plan: {e}"
            self._refuse(bs, msg, "refused: pinned memory for streaming")
        self.fits_up_to = tokens
        self.refused.clear()
        what = f"now recomputing blocks {ranges_text(change['recompute'])} (was {ranges_text(change['was'])})"
        if "streamed" in change:
            what += f", streaming blocks {ranges_text(change['streamed'])} (was {ranges_text(change['streamed_was'])})"
        if change.get("disk_weights"):
            dw = change["disk_weights"]
            store = "a disk store opened" if dw["store"] == "opened" else "the disk store grown"
            what += f", the frozen weights of blocks {ranges_text(dw['blocks'])} on disk ({store})"
        if change.get("activation_offload"):
            what += ", paging the recomputed blocks' inputs to host RAM (activation_offload=True)"
        newly = set(change["recompute"]) - set(change["was"])
        newly |= set(change.get("streamed", ())) - set(change.get("streamed_was", ()))
        # paging turned on attaches hooks to every block: the first one is running already
        goes_on = hooked is None or (hooked not in newly and not change.get("activation_offload"))
        self.session.record(
            {
                "step_tokens": tokens,
                "change": "re-planned: " + what,
                **change,
                "batch": bs[0],
                "seq": bs[1],
                "predicted_vram_bytes": vram["total"],
                **_assumed_entry(rev),
            }
        )
        self.log(
            f"plan: a step of batch {bs[0]} x seq {bs[1]} did not fit the applied plan (made for batch "
            f"{was[0]} x seq {was[1]}); revised before it ran: {what}, VRAM {vram['total'] / _GIB:.2f} of "
            f"{vram['budget'] / _GIB:.2f} GiB predicted{note}" + ("; the step goes on" if goes_on else "")
        )
        if goes_on:
            return None
        raise PlanOutOfMemoryError(
            f"ramstream: this step's batch {bs[0]} x seq {bs[1]} does not fit the plan wrap() applied (made "
            f"for batch {was[0]} x seq {was[1]}), so the plan was revised before anything ran: {what}. "
            + (
                "Activation paging is attached to every block, the first too"
                if change.get("activation_offload")
                else "Every block must recompute, the first too"
            )
            + ", and this forward had entered it already. The "
            f"weights stay where they were (VRAM {vram['total'] / _GIB:.2f} of {vram['budget'] / _GIB:.2f} "
            f"GiB predicted{note}). Weights, optimizer state and memory are as before this step: re-run the "
            "same step as is (OffloadTrainer does it by itself; see docs/planning.md)",
            replanned=True,
            change=change,
        ) from None

    def _refuse(self, bs, msg: str, change: str):
        self.refused[(*bs, _blocks_key(self._now()))] = msg
        self.session.record({"step_tokens": bs[0] * bs[1], "change": change})
        raise PlanOutOfMemoryError(msg) from None

    def _advice(self, bs, e: PlanError, why: str = "", rewrap=None) -> str:
        """The refusal's text; rewrap (_rewrap): what a plan made for this step gives, None when not
        asked."""
        b, s = bs
        again = f"wrap(..., batch={b}, seq={s})"
        if rewrap is None:
            tail = f"re-wrap with {again} so that the plan streams and recomputes what this step needs, or use a smaller step"
        elif isinstance(rewrap, str):
            tail = f"re-wrap with {again}: that plan fits ({rewrap}); or use a smaller step"
        else:
            tail = (
                f"no plan fits this step on this machine with these options, not even re-wrapped with {again}"
            )
            tail += (
                f"; re-wrapped, one of these would: {'; '.join(rewrap)}" if rewrap else ": use a smaller step"
            )
        return (
            f"ramstream: this step's batch {b} x seq {s} does not fit the plan wrap() applied (made for "
            f"batch {self.shape.batch} x seq {self.shape.seq}; nothing ran, nothing changed){why}:\n{e}\n{tail}"
        )

    def _rewrap(self, bs):
        """What a plan made for this step on the same machine streams and recomputes (wrap() chooses
        the streamed blocks then, and the recomputed ones unless they were given), as text; when none
        fits, the single changes that would (PlanError.options, maybe none)."""
        shape = self.shape.with_tokens(batch=bs[0], seq=bs[1])
        kw = {**self._now(), "param_offload": "auto"}
        kw.pop("_disk_applied", None)  # a re-wrap places the frozen weights afresh
        if self.session.recompute_lever is not None:
            kw["activation_checkpointing"] = "auto"
        try:
            plan = plan_training(shape, self.profile, quantize="none", **kw)
        except PlanError as e:
            return list(e.options)
        rc = [i for i, m in enumerate(plan.activations) if m == "recompute"]
        return (
            f"streaming blocks {ranges_text(plan.weights['streamed'])}, recomputing blocks {ranges_text(rc)}"
        )


def _assumed_note(rev) -> str:
    """The log's words for a revision that assumed a chunked loss (planner/revise.py), else ""."""
    if not rev.assumed:
        return ""
    return (
        f"; planned as if the loss were {rev.assumed} (ramstream.chunked_cross_entropy: one chunk of "
        f"logits at a time): this step's dense logits would need {rev.uncounted_bytes / _GIB:.2f} GiB more, "
        "not counted, so a dense loss may run out of memory in the loss; compute the loss with "
        "ramstream.chunked_cross_entropy(hidden, head.weight, targets) and pass wrap(..., loss='chunked'), "
        "or use a smaller batch"
    )


def _assumed_entry(rev) -> dict:
    """The history's fields for a revision that assumed a chunked loss, else none."""
    if not rev.assumed:
        return {}
    return {"loss": rev.assumed, "loss_assumed": True, "uncounted_logits_bytes": rev.uncounted_bytes}
