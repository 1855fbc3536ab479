"""wrap()'s delayed_update split, from the plan (planner/delayed_split.py): the optimizer's first
mapped share and the host share that delayed_update keeps side buffers for."""

from __future__ import annotations


def planned_mapped(plan, opts) -> float | None:
    """With delayed_update and optimizer_mode="auto": the plan's VRAM and mapped shares, mapped at
    first (the plan balances the mapped one for the delay; after step 2 the VRAM share moves the
    front of it to the device: optimizer_split.maybe_share); None otherwise (no plan, or a
    resident plan)."""
    if (
        opts.delayed_update is False
        or opts.optimizer_mode != "auto"
        or plan is None
        or plan.mode != "offload"
    ):
        return None
    split = plan.optimizer.get("split") or {}
    return float(split.get("mapped", 0.0) + split.get("device", 0.0))


def host_share(plan, opts) -> bool | float:
    """The share of the trained elements delayed_update keeps side buffers for (host_fit.py): the
    plan's host share when the plan's split applies (planned_mapped), all of them otherwise (True);
    False without delayed_update."""
    if opts.delayed_update is False:
        return False
    if planned_mapped(plan, opts) is None:
        return True
    return float((plan.optimizer.get("split") or {}).get("host", 1.0))
