"""wrap()'s default decisions as arithmetic on a ModelShape, so that the plan predicts what wrap()
does: the streamed blocks and recompute of every block (wrap_rules.py's rules on the shape's
numbers; without a plan, runtime/inspect.py asks the same rules on the live model's), the resident switch (inflight.py resident_peak) and
the optimizer state's split between VRAM, the GPU over PCIe and the host (inflight.py
choose_mapped_fraction; runtime/optimizer_split.py applies it) and where the measured refinement
after steps 4 and 6 moves it (inflight.py choose_refined, which runtime/refiner.py applies, on the
rates the step-time model says the run measures: refinement_rounds). Pure functions.
"""

from __future__ import annotations

import math

from . import wrap_rules
from .inflight import BucketFacts, choose_mapped_fraction, choose_refined, host_trial_fits

HOST_STATE_BYTES = 28  # split.seed: host params/s = profile adamw_gbps / 28 B
BUCKET_BYTES = 32 << 20  # OffloadAdamW bucket_bytes default: the refinement moves whole buckets


def auto_recompute(shape, usable: int, weight_of, opt_mode: str) -> tuple[bool, str]:
    """activation_checkpointing="auto" on a ModelShape: (every block recomputes, why), by
    wrap_rules.auto_recompute (LoRA-like: the block weights exceed a quarter of `usable`; full
    fine-tuning, optimizer_mode not "cpu": weights + trained params x (8 + gradient bytes) exceed
    90 % of it), on the numbers the shape gives (`weight_of`: a part's bytes on the device)."""
    r = wrap_rules.auto_recompute(
        n_blocks=len(shape.blocks),
        trained=sum(b.trained_numel for b in shape.blocks),
        total=sum(b.trained_numel + b.frozen_numel for b in shape.blocks),
        block_bytes=sum(weight_of(b) for b in shape.blocks),
        weights=sum(weight_of(p) for p in shape.parts),
        state=wrap_rules.moments_and_gradients(shape.trained_numel, shape.elem_bytes),
        usable=usable,
        optimizer_mode=opt_mode,
    )
    return r.on, r.why()


def auto_streamed(
    shape, usable: int, headroom: float, weight_of, recompute_all: bool = False
) -> tuple[int, float]:
    """param_offload="auto": (the number of front blocks streamed, the room in bytes): the fewest
    whose streaming brings the resident weights under wrap_rules.weight_share of usable x
    (1 - headroom) (70 % for LoRA-like blocks or when every block recomputes, else 50 %)."""
    trained = sum(b.trained_numel for b in shape.blocks)
    total = sum(b.trained_numel + b.frozen_numel for b in shape.blocks)
    room = usable * (1 - headroom) * wrap_rules.weight_share(trained, total, recompute_all)
    resident = sum(weight_of(p) for p in shape.parts)
    return wrap_rules.front_blocks_to_stream(resident, [weight_of(b) for b in shape.blocks], room), room


def grad_inflight_bytes(prof) -> int:
    """The engine's default max_inflight_bytes (wrap_rules.grad_inflight_bytes, which OffloadAdamW
    takes on gpu_memory()["cap"]) on the profile's vram_free: that cap before the model is on the
    device (profile_hardware's gpu_memory: min(free + reserved, cap) - reserved), the device's total
    memory less the context without a cap. (vram_total // 10 counted 1 GiB under a 4 GiB cap, where
    the engine holds 0.4: row F of tests/test_planner_h200.py.)"""
    return wrap_rules.grad_inflight_bytes(prof.vram_free)


def optimizer_split(
    *, trained: int, streamed_trained: int, room: int, mode: str, wb: int, mb: int, prof
) -> dict:
    """Numel per placement after step 2 (runtime/optimizer_split.py maybe_share): "device" for the first params
    whose state (2 moments + an fp32 master for a low-precision model) fits in `room`; the rest
    "mapped" by choose_mapped_fraction (mode "auto"), all of it (mode "gpu") or none ("cpu"), the
    others "host". Trained params of streamed blocks stay on the host. What the run settles on
    after the measured refinement: refinement_rounds."""
    master = 4 if wb < 4 else 0
    movable = max(0, trained - streamed_trained)
    dev = 0
    if mode != "cpu" and room > 0 and movable:
        dev = min(movable, int(room // (2 * mb + master)))
    rest = movable - dev
    # without room the placement stays wrap()'s (maybe_share: "keep optimizer placement"): the
    # fraction split.mapped_fraction_for chose over every parameter, streamed ones included, of
    # which core.py maps the first non-streamed buckets (row F: 57 % of 1.82G, all 208M movable)
    seen = rest if dev else trained
    f, info = 0.0, {}
    if mode == "gpu":
        f = 1.0
    elif mode == "auto" and rest:
        f, info = choose_mapped_fraction(
            numel=seen,
            host_params_per_s=prof.adamw_gbps * 1e9 / HOST_STATE_BYTES,
            pcie_bytes_per_s=prof.h2d_gbps * 1e9,
            working_bytes=wb,
            moment_bytes=mb,
            master_on_host=wb < 4,
        )
    mapped = min(rest, int(math.floor(f * seen)))
    return {
        "device": dev,
        "mapped": mapped,
        "host": trained - dev - mapped,
        "mapped_fraction_of_rest": f,
        "device_bytes_per_param": 2 * mb + master,
        "split_estimate_s": info.get("t_estimate_s"),
    }


def _stand_ins(split: dict, streamed_trained: int, wb: int, mb: int) -> list[BucketFacts]:
    """The engine's buckets as runtime/refiner.py hands them to choose_refined, in forward order:
    the streamed blocks' (host, not movable), the "device" share (not movable), then the mapped and
    the host share in buckets of BUCKET_BYTES of the working dtype."""
    per = max(1, BUCKET_BYTES // wb)
    parts = [("host", True, streamed_trained), ("device", False, split["device"])]
    for where, numel in (("mapped", split["mapped"]), ("host", split["host"] - streamed_trained)):
        parts += [(where, False, min(per, numel - i)) for i in range(0, numel, per)]
    return [
        BucketFacts(
            index=i, numel=n, placement=w, working_bytes=wb, moment_bytes=mb, low_precision=wb < 4, streamed=s
        )
        for i, (w, s, n) in enumerate(p for p in parts if p[2] > 0)
    ]


def refinement_rounds(
    split: dict, *, streamed_trained: int, wb: int, mb: int, state_bytes: int, prof
) -> list:
    """The splits optimizer_mode="auto" moves to after steps 4 and 6 (runtime/refiner.py, at most
    MAX_REFINEMENTS moves), from `split` (optimizer_split's numel per placement): each round is
    inflight.choose_refined itself, on stand-ins of the buckets, with the rates the run measures
    at the split of that round (timing.refiner_rates). Returns the numel per placement after each
    move ([] when the first round keeps the split); plan.py applies the refiner's revert rule."""
    from .rules import MAX_REFINEMENTS
    from .timing import refiner_rates

    rounds, now = [], split
    for _ in range(MAX_REFINEMENTS):
        host, pcie = refiner_rates(prof, now, wb=wb, mb=mb, state_bytes=state_bytes)
        if host <= 0 or pcie <= 0:
            break
        _, info = choose_refined(
            _stand_ins(now, streamed_trained, wb, mb), host_params_per_s=host, pcie_bytes_per_s=pcie
        )
        if not info["move"]:
            break
        now = {**now, **info["numel"], "refine_rates": {"host_params_per_s": host, "pcie_bytes_per_s": pcie}}
        rounds.append(now)
    return rounds


def host_trial(split: dict, *, streamed_trained: int, wb: int, mb: int, state_bytes: int, prof,
               step_s: float) -> dict | None:  # fmt: skip
    """The all-host split runtime/refiner.py tries when a refinement keeps `split` with a mapped share
    (inflight.host_trial_fits on stand-ins of the buckets, at the host rate timing.refiner_rates says
    the run measures and the predicted step_s), None when it does not try; plan.py keeps it when
    its predicted step is not slower, as the refiner does with the measured one."""
    from .timing import refiner_rates

    host, _ = refiner_rates(prof, split, wb=wb, mb=mb, state_bytes=state_bytes)
    fits, _ = host_trial_fits(
        _stand_ins(split, streamed_trained, wb, mb), host_params_per_s=host, step_s=step_s
    )
    if not fits:
        return None
    base = {k: v for k, v in split.items() if k != "refine_rates"}
    return {**base, "mapped": 0, "host": split["host"] + split["mapped"], "host_trial": True}


def delayed_verdict(delayed, plain) -> str | None:
    """wrap(delayed_update=...)'s check (runtime/apply.py). Only host-updated parameters are
    delayed (engine/delayed.py) and there is no resident switch with it. `delayed` and `plain`:
    the Plans with and without it. Returns the warning's text when the delayed plan updates no
    parameter on the host (nothing to delay: the numbers are those of the run without it), or when
    `plain` predicts a step more than rules.DELAYED_SLOWER shorter (both predictions, their bounds
    and splits); else None."""
    from .rules import DELAYED_SLOWER

    ds = delayed.optimizer.get("split") or {}
    if delayed.predicted.get("step_s") and ds and ds.get("host", 0.0) <= 0.0:
        return (
            "delayed_update has nothing to delay on this machine: the plan updates every parameter on "
            f"the GPU ({ds.get('device', 0.0):.0%} of the state in VRAM, {ds.get('mapped', 0.0):.0%} "
            "over PCIe), where nothing waits for the host; leave delayed_update=False"
        )
    d, p = delayed.predicted["step_s"], plain.predicted["step_s"]
    if not (d and p) or d <= p * (1 + DELAYED_SLOWER):
        return None
    ps = plain.optimizer.get("split") or {}
    return (
        f"delayed_update is predicted slower on this machine: {d:.3f} s/step with it (bound by "
        f"{delayed.predicted['bound']}, host AdamW {delayed.bounds.get('host_adamw_s', 0.0):.3f} s; "
        f"{ds.get('host', 0.0):.0%} of the parameters updated by the host, delayed) vs {p:.3f} s without "
        f"it (bound by {plain.predicted['bound']}, plan {plain.mode}; the state of {ps.get('device', 0.0):.0%} "
        f"in VRAM, {ps.get('mapped', 0.0):.0%} over PCIe, {ps.get('host', 0.0):.0%} on the host); compare "
        "both (docs/guide/delayed_update.md) or leave delayed_update=False"
    )
