"""The single changes that make a plan that does not fit fit, for PlanError's message."""

from __future__ import annotations

from .result import Plan, PlanError
from .rules import DISK_FREE_SHARE
from .shape import ModelShape

_GIB = 2**30
NOTHING_FITS = "none of bf16 moments, int8/nf4, a disk (nvme_dir=), a smaller batch or seq"


def suggestions(
    shape, profile, po, ao, om, moment, quant, headroom, slow, nvme="auto", *, plan_fn, fixed=None
) -> list[str]:
    """The single changes that make the plan fit, each with its predicted step. plan_fn: plan.py's
    plan_training, passed in so that this module does not import plan.py (which imports it);
    fixed: further plan_training options every try keeps (accumulation_steps, delayed_update)."""

    def tryit(sh, **kw) -> Plan | None:
        args = dict(param_offload=po, activation_offload=ao, optimizer_mode=om, moment_dtype=moment, quantize=quant,
                    vram_headroom=headroom, max_activation_slowdown=slow, nvme_offload=nvme, **(fixed or {}))  # fmt: skip
        args.update(kw)
        try:
            return plan_fn(sh, profile, _suggest=False, **args)
        except PlanError:
            return None

    out = []

    def add(text, plan):
        if plan is not None:
            out.append(f"{text} (step ~{plan.predicted['step_s'] * 1e3:.0f} ms)")

    if moment != "bfloat16":
        add("moment_dtype='bfloat16'", tryit(shape, moment_dtype="bfloat16"))
    if shape.frozen_numel and any(b.frozen_matrix_numel for b in shape.blocks):
        for q in ("int8", "nf4"):
            if quant == "none" or (quant == "int8" and q == "nf4"):
                add(f"quantize={q!r}", tryit(shape, quantize=q))
    if shape.loss == "dense":
        add("a chunked loss (ramstream.chunked_cross_entropy)", tryit(_with_loss(shape, "chunked")))
    if po is False:
        add("param_offload='auto'", tryit(shape, param_offload="auto"))
    if ao is not True:  # every block's saved activations (a recomputed block's: its input) paged
        add("activation_offload=True (saved activations paged to host RAM, bit for bit)",
            tryit(shape, activation_offload=True))  # fmt: skip
    if nvme is not False and nvme != 0:  # a disk, or one with more free space (disk.py)
        plan = tryit(shape, _assume_disk=True)
        d = plan.memory.get("disk") if plan is not None else None
        if d:
            known = profile.disk_read_gbps and profile.disk_write_gbps
            free = (
                f" (this one: {profile.disk_free / _GIB:.2f} GiB)"
                if known and profile.disk_free is not None
                else ""
            )
            out.append(
                f"nvme_dir= on a disk with {d['total'] / DISK_FREE_SHARE / _GIB:.2f} GiB free{free} for {plan.optimizer['nvme_share']:.1%} "
                f"of the host optimizer state, {d['written_per_step'] / 1e9:.1f} GB read and written per step "
                + (f"(step ~{plan.predicted['step_s'] * 1e3:.0f} ms)" if known else
                   f"(step ~{plan.predicted['step_s'] * 1e3:.0f} ms + the disk's time for them)")
            )  # fmt: skip
    for name in ("batch", "seq"):
        v = getattr(shape, name) // 2
        while v >= 1:
            plan = tryit(shape.with_tokens(**{name: v}))
            if plan is not None:
                add(f"{name}={v}", plan)
                break
            v //= 2
    return out


def _with_loss(shape: ModelShape, loss: str) -> ModelShape:
    from dataclasses import replace

    return replace(shape, loss=loss)
