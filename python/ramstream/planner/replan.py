"""A step larger than the applied plan's (runtime/tokens.py StepCheck): the plan revised between
steps, the weights left where they are; pure arithmetic.

What can change between two steps without moving a weight is which blocks recompute their
activations in backward (a flag on the block's forward: recomputing runs the same forward, bit for
bit). replan_recompute keeps the blocks recomputing now and adds the fewest others that let the
step fit: from the front of the stack by default (as the activation modes and the watchdog's lever
do), or from the back (order="back": StepCheck, whose step is already in the first block's call,
so the blocks after it can still change for this very step). The planner counts each block's kept
activations, and its input when it recomputes, at the peak whatever its place in the stack
(planner/act_modes.py cost), so in a stack of equal blocks the same number fits from either end;
a stack whose blocks differ in size is walked the same way from the chosen end, the fewest that fit
winning.

When even every block recomputing does not fit, replan_stream adds streamed blocks: the weights of
the fewest more blocks, taken from the back of the stack, go to pinned host memory and visit the
device only while their block runs (runtime/apply.py StreamLever; streaming is bit-exact too).
From the back because the first block is where the step check runs (its forward was read already);
the planner's cost of a streamed block does not depend on its place, so in a stack of equal blocks
the same number fits from either end."""

from __future__ import annotations

from .plan import plan_training
from .profile import HardwareProfile
from .result import Plan, PlanError
from .shape import ModelShape


def replan_recompute(
    shape: ModelShape, profile: HardwareProfile, recomputed, *, order: str = "front", **fixed
) -> Plan:
    """The plan for `shape` with the blocks in `recomputed` and the fewest more recomputing.

    order: "front" adds blocks from the start of the stack (0, 1, ...), "back" from its end
    (n-1, n-2, ...); the first block is then added only when every block must recompute.
    fixed: plan_training's other options as the run applied them (param_offload as the streamed
    block indices, moment_dtype, optimizer_mode, ...). Raises PlanError with the arithmetic of every
    block recomputing when even that does not fit (PlanError too when nothing is left to add)."""
    if order not in ("front", "back"):
        raise ValueError(f"replan_recompute: order must be 'front' or 'back', got {order!r}")
    n = len(shape.blocks)
    now = sorted(set(recomputed))
    rest = [i for i in range(n) if i not in set(now)]
    if order == "back":
        rest.reverse()
    kw = dict(quantize="none", _suggest=False, **fixed)
    full = plan_training(
        shape, profile, activation_checkpointing=list(range(n)), **kw
    )  # PlanError: none fits
    if not rest:
        return full
    # one recomputed block more can need more room than none (its rebuilt activations join the
    # others kept): every count is tried, the fewest that fits wins
    for k in range(1, len(rest)):
        try:
            return plan_training(shape, profile, activation_checkpointing=sorted(now + rest[:k]), **kw)
        except PlanError:
            continue
    return full


def replan_stream(shape: ModelShape, profile: HardwareProfile, streamed, *, first: int = 1, **fixed) -> Plan:
    """The plan for `shape` with the blocks in `streamed` and the fewest more streaming their
    weights, taken from the back of the stack (n-1, n-2, ...) and never below block `first` (the
    blocks before it keep where they are: 1 when the first block's forward runs already, 0 when
    nothing ran yet). fixed: plan_training's other options as applied (activation_checkpointing as
    the recomputed block indices, moment_dtype, ...). PlanError with the arithmetic of the most
    blocks streaming when none fits."""
    n = len(shape.blocks)
    now = sorted(set(streamed))
    rest = [i for i in range(n - 1, first - 1, -1) if i not in set(now)]
    kw = dict(quantize="none", _suggest=False, **fixed)
    last = None
    for k in range(1, len(rest) + 1):
        try:
            return plan_training(shape, profile, param_offload=sorted(now + rest[:k]), **kw)
        except PlanError as e:
            last = e
    if last is None:  # nothing left to stream
        return plan_training(shape, profile, param_offload=now, **kw)
    raise last
