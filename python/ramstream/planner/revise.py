"""The planner's answers to what a run measured; pure arithmetic. Two entry points:

revise(): the applied plan, revised for the size of the step about to run. The runtime
(runtime/session.py PlanSession) measures, the planner decides, the session applies the difference.
The measurement is the step's batch x seq (Measured), read from its input before any block ran: a
step with more tokens than the plan's is planned with the placement as applied (which blocks stream,
which recompute, the moments' dtype...). When that does not fit, the levers that can change between
steps are tried, the cheapest first:

1. "recompute": the fewest more blocks recompute their activations in backward, taken from the back
   of the stack (replan.py replan_recompute, order="back"); the weights stay where they are.
2. "stream": where every block recomputing does not fit either, the fewest more blocks stream their
   weights, from the back (replan.py replan_stream), every block recomputing.
3. "page": where that does not fit either and activation paging is off (wrap()'s default
   activation_offload=False), paging on: every block recomputing, its checkpointed input paged to
   host RAM, the blocks streaming as they are or the fewest more from the back.

`first` is the first block that may change: 0 when nothing of the step ran, 1 when the step's first
block is running already (its forward was read before the check; a change of the first block then
applies from the next step). A revision that needs the first block anyway is still returned: the
caller says the step must be re-run.

revise_training(): every decision taken between steps while training. The runtime's deciders
(runtime/optimizer_split.py, refiner.py, watchdog.py, keep.py) measure, fill one of
planner/training.py's records (numbers only) and hand it here; the answer is a Decision, from
planner/inflight.py (the optimizer state's placement) or planner/levers.py (VRAM). The decider
applies it through the mechanisms and returns the history entry; the session records it
(runtime/session.py TrainingSession, the plan history's only writer).

The loss: wrap() does not see it, so a plan counts a dense cross-entropy (rules.PLAN_LOSS: the
[tokens, vocab] logits, their fp32 copy and their gradient) until the run says otherwise. With
``loss_open`` (the loss was not given and no chunked loss was seen yet), a step that no lever fits
with the dense loss but one fits with the chunked loss (loss.py: one chunk of logits at a time) is
revised as if its loss were chunked: the Revision says so (``assumed``) and how many bytes the
dense logits would have needed (``uncounted_bytes``), for the caller to log. When neither fits the
dense refusal stands."""

from __future__ import annotations

from dataclasses import dataclass, replace

from . import inflight, levers
from .plan import plan_training
from .profile import HardwareProfile
from .replan import replan_recompute, replan_stream
from .result import Plan, PlanError
from .shape import ModelShape
from .training import (
    MEASUREMENTS,
    Decision,
    FreeVram,
    HostTrialCheck,
    KeepCheck,
    PeakCheck,
    ResidentCheck,
    ShareCheck,
    SplitWindow,
)

LEVERS = ("recompute", "stream", "page")


@dataclass(frozen=True)
class Measured:
    """What a run measured: the step about to run, as batch x seq tokens."""

    batch: int
    seq: int

    @property
    def tokens(self) -> int:
        return self.batch * self.seq


@dataclass
class Revision:
    """revise()'s answer. ``plan``: the plan for the measured step (the applied placement when
    ``changed`` is False); ``changed``: which options differ from the applied ones
    ({"activation_checkpointing": [...]}, {"param_offload": [...]}, or both)."""

    plan: Plan
    shape: ModelShape
    changed: dict
    # the loss the revision assumed where the applied shape's did not fit ("chunked"), else None;
    # the dense logits' bytes for this step that the revision does not count then
    assumed: str | None = None
    uncounted_bytes: int = 0


class RevisionError(PlanError):
    """No lever fits the measured step. ``tried``: the levers tried (none when none may change),
    ``why``: what was tried, as a phrase for the error message."""

    def __init__(self, error: PlanError, tried: tuple, why: str) -> None:
        super().__init__(str(error), arithmetic=error.arithmetic, options=error.options)
        self.tried, self.why = tried, why


def revise(
    shape: ModelShape,
    profile: HardwareProfile,
    applied: dict,
    measured: Measured,
    *,
    levers: tuple = LEVERS,
    first: int = 0,
    loss_open: bool = False,
) -> Revision:
    """The plan for the measured step. shape, profile: what the applied plan was made on; applied:
    plan_training's options as applied now (param_offload and activation_checkpointing as block
    lists, moment_dtype, optimizer_mode, ...); levers: which of LEVERS may change (none: only
    checked); loss_open: whether the loss is not known (a dense shape may then be revised as if its
    loss were chunked, see the module docstring). Raises RevisionError when nothing fits."""
    bad = [x for x in levers if x not in LEVERS]
    if bad:
        raise ValueError(f"revise: levers must be among {LEVERS}, got {bad}")
    try:
        return _revise(shape, profile, applied, measured, levers, first)
    except RevisionError:
        if not loss_open or shape.loss != "dense":
            raise
        dense = shape.with_tokens(batch=measured.batch, seq=measured.seq).logits_bytes
        try:
            rev = _revise(replace(shape, loss="chunked"), profile, applied, measured, levers, first)
        except RevisionError:
            pass
        else:
            rev.assumed, rev.uncounted_bytes = "chunked", dense - rev.shape.logits_bytes
            return rev
        raise


def _revise(shape, profile, applied, measured, levers, first) -> Revision:
    step = shape.with_tokens(batch=measured.batch, seq=measured.seq)
    try:
        plan = plan_training(step, profile, quantize="none", _suggest=False, **applied)
        return Revision(plan, step, {})
    except PlanError as e:
        error = e
    if "recompute" not in levers:
        raise RevisionError(error, (), "")
    ckpt = applied.get("activation_checkpointing")
    before = list(ckpt) if isinstance(ckpt, (list, tuple)) else []
    rest = {k: v for k, v in applied.items() if k != "activation_checkpointing"}
    try:
        plan = replan_recompute(step, profile, before, order="back", **rest)
        return Revision(plan, step, {"activation_checkpointing": _recomputed(plan)})
    except PlanError as e:
        error = e
    why = "; not even with every block recomputing its activations"
    n, tried = len(shape.blocks), ("recompute",)
    rest = {k: v for k, v in rest.items() if k != "param_offload"}
    every, streamed = list(range(n)), applied.get("param_offload") or []
    if "stream" in levers:
        tried += ("stream",)
        try:
            plan = replan_stream(step, profile, streamed, first=first, activation_checkpointing=every, **rest)
            changed = {
                "activation_checkpointing": _recomputed(plan),
                "param_offload": list(plan.weights["streamed"]),
            }
            return Revision(plan, step, changed)
        except PlanError as e:
            if (e.arithmetic or {}).get("disk"):  # the blocks it streams tried the disk: its arithmetic
                error = e
        why += " and every block it may stream streaming its weights"
    if "page" in levers and rest.get("activation_offload") is False:
        tried += ("page",)
        paged = {**rest, "activation_offload": True, "activation_checkpointing": every}
        try:
            plan = _paged(step, profile, streamed, first, "stream" in levers, paged)
            changed = {"activation_checkpointing": _recomputed(plan), "param_offload": list(plan.weights["streamed"]),
                       "activation_offload": True}  # fmt: skip
            return Revision(plan, step, changed)
        except PlanError:
            pass
        why += ", nor with their checkpointed inputs paged to host RAM"
    raise RevisionError(error, tried, why)


def _paged(step, profile, streamed, first, stream: bool, fixed) -> Plan:
    """The plan with activation paging on (every block recomputing, its input paged): the blocks
    streaming as they are, else (stream) the fewest more from the back."""
    try:
        return plan_training(step, profile, quantize="none", _suggest=False, param_offload=streamed, **fixed)
    except PlanError:
        if not stream:
            raise
    return replan_stream(step, profile, streamed, first=first, **fixed)


def _recomputed(plan: Plan) -> list[int]:
    return [i for i, m in enumerate(plan.activations) if m == "recompute"]


_DECIDE = {
    ResidentCheck: inflight.decide_resident,
    ShareCheck: inflight.decide_share,
    SplitWindow: inflight.decide_window,
    HostTrialCheck: inflight.decide_host_trial,
    PeakCheck: levers.decide_peak,
    FreeVram: levers.decide_free,
    KeepCheck: levers.decide_keep,
}


def revise_training(measured) -> Decision:
    """The planner's decision for an in-training measurement (one of planner/training.py's records:
    the module docstring of training.py says which decision each asks for). Pure: applies nothing.
    TypeError for anything else."""
    decide = _DECIDE.get(type(measured))
    if decide is None:
        names = ", ".join(t.__name__ for t in MEASUREMENTS)
        raise TypeError(f"revise_training: measured must be one of {names}; got {type(measured).__name__}")
    return decide(measured)
