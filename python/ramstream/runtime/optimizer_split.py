"""The optimizer state's placement, applied: how much of the update the GPU does over PCIe
("mapped") at the start (mapped_fraction_for, from rates measured once per process or the hardware
profile's), and after SWITCH_AFTER_STEPS the resident switch or the VRAM share (maybe_switch,
maybe_share). The decisions are the planner's: the first split is choose_mapped_fraction
(planner/inflight.py); the switch and the share are asked through planner/revise.py
revise_training with a ResidentCheck / ShareCheck (planner/training.py: numbers only), answered by
inflight.decide_resident (resident_fits) and decide_share (share_room, choose_placements). This
module measures, asks, applies through the engine (engine/resident.py Resident, engine/layout.py
relocate) and returns the history entry; the optimizer's session records it (runtime/session.py
TrainingSession).
"""

from __future__ import annotations

import warnings

import torch

from ..engine.rates import measured_rates
from ..planner.inflight import choose_mapped_fraction
from ..planner.revise import revise_training
from ..planner.training import ResidentCheck, ShareCheck
from . import measure as _measure


def mapped_fraction_for(opt, mode: str, device: torch.device) -> float:
    """OffloadAdamW's mapped fraction for `mode` ("cpu", "gpu", "auto") on `device`, logged and
    recorded in opt.split_info."""
    if mode == "cpu" or opt._distributed:
        return 0.0
    if device.type != "cuda":
        if mode == "gpu":
            raise ValueError(
                "OffloadAdamW: mode='gpu' needs a CUDA device (the GPU updates "
                "state kept in pinned host memory)"
            )
        return 0.0
    from .. import hardware

    problem = hardware.kernels_problem()
    if problem and mode == "gpu":
        raise RuntimeError(f"OffloadAdamW: mode='gpu' needs ramstream's CUDA kernels, but {problem}")
    if problem:  # "auto": the host threads update everything, and the log says why
        opt._log(f"optimizer_mode=auto: the host updates every parameter ({problem})")
        opt.split_info = {"fraction": 0.0, "reason": problem}
        return 0.0
    params = [p for g in opt.param_groups for p in g["params"]]
    if mode == "auto" and opt._accumulation_steps > 1 and params[0].dtype != torch.float32:
        # the GPU update takes the gradient autograd summed in .grad: in bf16/fp16 here
        opt._log(
            "optimizer_mode=auto: the host updates every parameter (accumulation of a "
            f"{str(params[0].dtype).replace('torch.', '')} model sums its gradients in fp32 on the host)"
        )
        opt.split_info = {"fraction": 0.0, "reason": "low-precision gradients accumulated"}
        return 0.0
    if mode == "gpu":
        return 1.0
    planned = getattr(opt, "_planned_mapped", None)
    if planned is not None:  # delayed_update under wrap(): the plan's delay-aware split (plan.py)
        f = min(1.0, max(0.0, float(planned)))
        opt.split_info = {"fraction": f, "reason": "delayed_update: the plan's split"}
        opt._log(
            f"optimizer_mode=auto with delayed_update: {f:.0%} of the parameters updated by the GPU "
            "over PCIe without delay, the rest by the host delayed (the plan's split: the GPU lane "
            "against the host AdamW beside the next step)"
        )
        return f

    rates = measured_rates(device)
    f, info = choose_mapped_fraction(
        numel=sum(p.numel() for p in params),
        host_params_per_s=rates["host_params_per_s"],
        pcie_bytes_per_s=rates["pcie_bytes_per_s"],
        working_bytes=params[0].element_size(),
        moment_bytes=opt._moment_dtype.itemsize,
        master_on_host=params[0].dtype != torch.float32,
    )
    opt.split_info = info
    opt._log(
        f"optimizer_mode=auto: {f:.0%} of the parameters updated by the GPU over PCIe "
        f"(host {info['host_params_per_s'] / 1e9:.2f} G params/s, PCIe "
        f"{info['pcie_bytes_per_s'] / 1e9:.1f} GB/s; estimated optimizer time "
        f"{info['t_estimate_s'] * 1e3:.0f} ms instead of "
        f"{info['t_host_only_s'] * 1e3:.0f} ms)"
    )
    return f


def state_starts_on_device(
    plan, opts, device: torch.device, use_dp: bool, low_precision: bool
) -> tuple[bool, str]:
    """(start, why): whether wrap() lays the optimizer state out in VRAM from the start (every
    bucket "device": engine/layout.py), as the plan says a resident run fits (plan.mode
    "resident", its placement "device"), so that no host state is pinned that the resident switch
    would drop. It applies the plan when the mechanism can run it: offload="auto" on a CUDA device
    with ramstream's CUDA kernels (which update the state until the switch), one process, no
    delayed_update, no disk tier, and no gradient accumulation of a low-precision model (the GPU
    update would take gradients summed in bf16/fp16). why: the reason it does not (or "")."""
    if plan is None or plan.mode != "resident" or plan.optimizer.get("placement") != "device":
        return False, ""
    if device.type != "cuda" or opts.offload != "auto" or opts.optimizer_mode != "auto":
        return False, "offload='auto' and optimizer_mode='auto' on a CUDA device are needed"
    if use_dp or opts.delayed_update is not False or plan.optimizer.get("nvme_share", 0.0) > 0:
        return (
            False,
            "data parallel, delayed_update (nothing to delay if resident) and the disk tier keep the state offloaded",
        )
    if opts.accumulation_steps > 1 and low_precision:
        return False, "gradient accumulation of a low-precision model sums its gradients on the host"
    from .. import hardware

    problem = hardware.kernels_problem()
    if problem:
        return False, problem
    return True, ""


def fit_state_to(opt, plan) -> dict | None:
    """A step re-planned before it ran (runtime/tokens.py): when the state started in VRAM
    (state_starts_on_device) and the revised plan is not resident, the device buckets move to
    pinned host memory that the GPU updates over PCIe ("mapped": the same kernel, bit for bit),
    as a plan that offloads has them; the switch and the share decide again after
    SWITCH_AFTER_STEPS. Returns the history entry (None: nothing moved). A MemoryError (pinned
    memory refused) leaves each bucket that did not move as it was."""
    from ..engine.layout import relocate

    engine = opt._engine
    if opt._resident is not None or plan.mode == "resident":
        return None
    on_device = [b for b in engine.buckets if b.placement == "device" and b.exp_avg is not None]
    if not on_device:
        return None
    opt.synchronize()
    try:
        for b in on_device:
            relocate(engine, b, "mapped")
    finally:  # also after a refused allocation: the buckets that moved count as mapped
        engine.mapped_numel = sum(b.numel for b in engine.buckets if b.placement == "mapped")
    if engine.device.type == "cuda":
        torch.cuda.empty_cache()
    n = sum(b.numel for b in on_device)
    opt._log(
        f"plan: the revised plan offloads the optimizer: the state of {n:,} parameters left VRAM for "
        "pinned host memory the GPU updates over PCIe"
    )
    return {"change": "optimizer state: device -> mapped (the revised plan offloads it)", "numel": n}


def maybe_switch(opt, after_steps: int):
    """offload="auto" after `after_steps` steps: (resident, entry). resident: the engine's Resident
    that replaces opt's engine when the planner says a resident run fits (ResidentCheck) and its
    state could be built, else None; entry: the decision and its numbers for the plan history (None
    when nothing was decided); the decision goes to opt's log."""
    from ..engine.resident import Resident, resident_split

    engine = opt._engine
    mem = _measure.device_memory(engine.device)
    if mem is None:
        return None, None
    if engine.dp is not None:
        opt._log("offload=auto: data parallel keeps offloading (no resident switch)")
        return None, None
    if engine.streamed:
        opt._log("offload=auto: streamed weights keep the optimizer offloaded (no resident switch)")
        return None, None
    if getattr(opt, "_delayed_update", None) is not None:  # resident, nothing would be delayed
        opt._log("offload=auto: delayed_update keeps the optimizer offloaded (no resident switch)")
        return None, None
    if engine.disk is not None:  # OffloadAdamW sets offload=True with it: a second guard
        opt._log(
            "offload=auto: optimizer state on disk (nvme_offload) keeps it offloaded (no resident switch)"
        )
        return None, None
    upcast = bool(getattr(opt, "_moments_for_ram", False)) and any(
        b.exp_avg.dtype != torch.float32 for b in engine.buckets
    )
    persistent, grads = resident_split(engine, upcast)
    d = revise_training(
        ResidentCheck(
            step=after_steps, usable=mem["usable"], peak=mem["peak"], now=mem["now"],
            persistent_bytes=persistent, grad_bytes=grads, headroom=opt.vram_headroom,
        )
    )  # fmt: skip
    verdict, n = d.act, d.numbers
    entry = {
        "step": after_steps,
        "change": d.change,
        "measured_peak_bytes": mem["peak"],
        "predicted_resident_peak_bytes": n["predicted_peak"],
        "room_bytes": n["room"],
    }
    if upcast:
        entry["moments"] = "bfloat16 -> float32 (chosen for host RAM; resident on the device)"
    opt._log(
        f"offload=auto after {after_steps} steps: a resident run would peak at {n['text']}; "
        f"usable {mem['usable'] / 2**30:.2f} GiB x (1 - {opt.vram_headroom:g}) = "
        f"{n['room'] / 2**30:.2f} GiB -> "
        + ("switching to fused AdamW on the device" if verdict else "keep offloading")
    )
    if not verdict:
        return None, entry
    try:
        resident = Resident(engine, opt.param_groups, upcast_moments=upcast)
        if upcast:
            opt._moment_dtype = torch.float32
            opt._log(
                "offload=auto: the moments were bfloat16 only because host RAM was short "
                "(moment_dtype='auto'); on the device they are float32 again (an exact upcast)"
            )
        return resident, entry
    except torch.OutOfMemoryError as exc:  # the step itself is done: keep offloading
        msg = (
            f"offload=auto: the device ran out of memory building the resident state "
            f"({exc}); the partial copies are freed and the optimizer keeps offloading"
        )
        opt._log(msg)
        warnings.warn("ramstream: " + msg, RuntimeWarning, stacklevel=4)
        return None, entry


def maybe_share(opt, after_steps: int) -> dict | None:
    """After a declined resident switch (with delayed_update: never tried): moves the share of
    the state that fits in the VRAM left to the device, as the planner decides (ShareCheck:
    planner/inflight.py decide_share; with delayed_update the other buckets keep their placement);
    logs the decision and returns its history entry. Does nothing (None) on the CPU, with data parallel, for
    mode "cpu", without CUDA kernels, or for a low-precision model with gradient accumulation."""
    from .. import hardware
    from ..engine.layout import relocate
    from ..planner.rules import MARGIN_BYTES

    engine = opt._engine
    mem = _measure.device_memory(engine.device)
    if mem is None or engine.dp is not None or opt.mode == "cpu" or hardware.kernels_problem():
        return None
    if all(b.placement == "device" for b in engine.buckets if b.exp_avg is not None):
        return {"step": after_steps, "change": "keep optimizer placement", "reason": "the state is in VRAM"}
    if engine.accumulation_steps > 1 and any(b.dtype != torch.float32 for b in engine.buckets):
        return None  # the GPU update would take gradients summed in bf16/fp16 (mapped_fraction_for)
    # the isolated rates the rest's host / mapped split is solved with (measured once per process:
    # mapped_fraction_for measured them for mode "auto" already)
    rates = measured_rates(engine.device) if opt.mode != "gpu" else {}
    d = revise_training(
        ShareCheck(
            step=after_steps, usable=mem["usable"], peak=mem["peak"], headroom=opt.vram_headroom,
            buckets=tuple(_measure.bucket_facts(engine.buckets)), moment_bytes=engine.moment_dtype.itemsize,
            gpu_only=opt.mode == "gpu", host_params_per_s=rates.get("host_params_per_s", 0.0),
            pcie_bytes_per_s=rates.get("pcie_bytes_per_s", 0.0),
            keep_rest=getattr(opt, "_delayed_update", None) is not None,
        )
    )  # fmt: skip
    room = d.numbers["room_bytes"]
    entry = {"step": after_steps, "change": d.change, "room_bytes": room}
    if not d.act:
        entry["measured_peak_bytes"] = mem["peak"]
        return entry
    info = {k: v for k, v in d.numbers.items() if k != "room_bytes"}
    opt.synchronize()
    moved = 0
    try:
        for b, where in zip(engine.buckets, d.placements):
            if where != b.placement:
                relocate(engine, b, where)
                moved += 1
    except torch.OutOfMemoryError as exc:  # the bucket that failed kept its state as it was
        opt._log(
            f"offload=auto: moving optimizer state to the device ran out of memory ({exc}); kept the rest"
        )
        torch.cuda.empty_cache()
    engine.mapped_numel = sum(b.numel for b in engine.buckets if b.placement == "mapped")
    got = {p: sum(b.numel for b in engine.buckets if b.placement == p) for p in ("device", "mapped", "host")}
    entry.update(info, moved_buckets=moved, measured_peak_bytes=mem["peak"], numel=got)
    total = max(1, sum(got.values()))
    opt._log(
        f"offload=auto after {after_steps} steps: {room / 2**30:.2f} GiB of VRAM to spare (cap "
        f"{mem['usable'] / 2**30:.2f} GiB x (1 - {opt.vram_headroom:g}) - peak {mem['peak'] / 2**30:.2f} "
        f"- margin {MARGIN_BYTES / 2**30:.2f}): optimizer state of {got['device'] / total:.0%} of the "
        f"parameters now in VRAM, {got['mapped'] / total:.0%} updated over PCIe, "
        f"{got['host'] / total:.0%} on the host ({moved} buckets moved)"
    )
    return entry
