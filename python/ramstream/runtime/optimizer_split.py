"""The optimizer state's placement, applied: how much of the update the GPU does over PCIe
("mapped") at the start (mapped_fraction_for, from rates measured once per process or the hardware
profile's), and after SWITCH_AFTER_STEPS the resident switch or the VRAM share (maybe_switch,
maybe_share). The decisions are the planner's (planner/inflight.py: choose_mapped_fraction,
resident_fits, share_room, choose_placements); this module measures, asks, applies through the
engine (engine/resident.py Resident, engine/layout.py relocate) and records in the plan history.
"""

from __future__ import annotations

import warnings

import torch

from ..engine.rates import measured_rates
from ..planner.inflight import choose_mapped_fraction
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


def maybe_switch(opt, after_steps: int):
    """offload="auto" after `after_steps` steps: the engine's Resident that replaces opt's engine when
    the planner's resident_fits says a resident run fits and its state could be built, else None;
    the decision and its numbers go to opt's log and plan history."""
    from ..engine.resident import Resident, resident_split
    from ..planner.inflight import resident_fits

    engine = opt._engine
    mem = _measure.device_memory(engine.device)
    if mem is None:
        return None
    if engine.dp is not None:
        opt._log("offload=auto: data parallel keeps offloading (no resident switch)")
        return None
    if engine.streamed:
        opt._log("offload=auto: streamed weights keep the optimizer offloaded (no resident switch)")
        return None
    if engine.disk is not None:  # OffloadAdamW sets offload=True with it: a second guard
        opt._log(
            "offload=auto: optimizer state on disk (nvme_offload) keeps it offloaded (no resident switch)"
        )
        return None
    upcast = bool(getattr(opt, "_moments_for_ram", False)) and any(
        b.exp_avg.dtype != torch.float32 for b in engine.buckets
    )
    persistent, grads = resident_split(engine, upcast)
    verdict, n = resident_fits(
        usable=mem["usable"], peak=mem["peak"], now=mem["now"], persistent=persistent, grads=grads,
        headroom=opt.vram_headroom,
    )  # fmt: skip
    opt.plan_history.record(
        {
            "step": after_steps,
            "change": "resident" if verdict else "keep offloading",
            "measured_peak_bytes": mem["peak"],
            "predicted_resident_peak_bytes": n["predicted_peak"],
            "room_bytes": n["room"],
            **(
                {"moments": "bfloat16 -> float32 (chosen for host RAM; resident on the device)"}
                if upcast
                else {}
            ),
        }
    )
    opt._log(
        f"offload=auto after {after_steps} steps: a resident run would peak at {n['text']}; "
        f"usable {mem['usable'] / 2**30:.2f} GiB x (1 - {opt.vram_headroom:g}) = "
        f"{n['room'] / 2**30:.2f} GiB -> "
        + ("switching to fused AdamW on the device" if verdict else "keep offloading")
    )
    if not verdict:
        return None
    try:
        resident = Resident(engine, opt.param_groups, upcast_moments=upcast)
        if upcast:
            opt._moment_dtype = torch.float32
            opt._log(
                "offload=auto: the moments were bfloat16 only because host RAM was short "
                "(moment_dtype='auto'); on the device they are float32 again (an exact upcast)"
            )
        return resident
    except torch.OutOfMemoryError as exc:  # the step itself is done: keep offloading
        msg = (
            f"offload=auto: the device ran out of memory building the resident state "
            f"({exc}); the partial copies are freed and the optimizer keeps offloading"
        )
        opt._log(msg)
        warnings.warn("ramstream: " + msg, RuntimeWarning, stacklevel=4)
        return None


def maybe_share(opt, after_steps: int) -> None:
    """After a declined resident switch: moves the share of the state that fits in the VRAM left
    (planner/inflight.py share_room, choose_placements) to the device; logs the decision and records
    it in the plan history. Does nothing on the CPU, with data parallel, for mode "cpu", without
    CUDA kernels, or for a low-precision model with gradient accumulation."""
    from .. import hardware
    from ..engine.layout import relocate
    from ..planner.inflight import choose_placements, share_room
    from ..planner.rules import MARGIN_BYTES

    engine = opt._engine
    mem = _measure.device_memory(engine.device)
    if mem is None or engine.dp is not None or opt.mode == "cpu" or hardware.kernels_problem():
        return
    if engine.accumulation_steps > 1 and any(b.dtype != torch.float32 for b in engine.buckets):
        return  # the GPU update would take gradients summed in bf16/fp16 (mapped_fraction_for)
    room = share_room(usable=mem["usable"], peak=mem["peak"], headroom=opt.vram_headroom)

    def mapped_fraction_of(numel: int) -> float:
        if opt.mode == "gpu":
            return 1.0
        rates = measured_rates(engine.device)
        b = engine.buckets[0]
        f, _ = choose_mapped_fraction(
            numel=numel,
            host_params_per_s=rates["host_params_per_s"],
            pcie_bytes_per_s=rates["pcie_bytes_per_s"],
            working_bytes=b.dtype.itemsize,
            moment_bytes=engine.moment_dtype.itemsize,
            master_on_host=b.dtype != torch.float32,
        )
        return f

    entry = {"step": after_steps, "change": "optimizer state share", "room_bytes": max(0, room)}
    if room <= 0:
        entry.update(change="keep optimizer placement", measured_peak_bytes=mem["peak"])
        opt.plan_history.record(entry)
        return
    targets, info = choose_placements(_measure.bucket_facts(engine.buckets), room, mapped_fraction_of)
    opt.synchronize()
    moved = 0
    try:
        for b, where in zip(engine.buckets, targets):
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
    opt.plan_history.record(entry)
    total = max(1, sum(got.values()))
    opt._log(
        f"offload=auto after {after_steps} steps: {room / 2**30:.2f} GiB of VRAM to spare (cap "
        f"{mem['usable'] / 2**30:.2f} GiB x (1 - {opt.vram_headroom:g}) - peak {mem['peak'] / 2**30:.2f} "
        f"- margin {MARGIN_BYTES / 2**30:.2f}): optimizer state of {got['device'] / total:.0%} of the "
        f"parameters now in VRAM, {got['mapped'] / total:.0%} updated over PCIe, "
        f"{got['host'] / total:.0%} on the host ({moved} buckets moved)"
    )
