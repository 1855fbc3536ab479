"""offload="auto" refinement: the share of the optimizer state kept in VRAM and updated there.

After the first steps the peak is measured. When the whole state does not fit (no resident
switch, resident.py) the VRAM left under the cap still holds part of it: the first buckets in
forward order (their weights are needed first in the next forward) move to the "device"
placement (layout.relocate: moments, and a low-precision model's fp32 master, in VRAM; the CUDA
AdamW kernel updates them as gradients arrive, nothing crosses PCIe). The rest is split again
between the GPU over PCIe ("mapped") and the host threads where both finish together
(split.choose_mapped_fraction). Every bucket's values are carried over unchanged.
"""

from __future__ import annotations

import torch

from ..planner.rules import (
    MARGIN_BYTES,  # kept free beyond vram_headroom: allocator slack, a larger last batch
)
from .layout import relocate


def device_bytes(b) -> int:
    """What a bucket's state adds to VRAM in the "device" placement."""
    per = 2 * b.exp_avg.element_size() + (4 if b.dtype != torch.float32 else 0)
    return b.numel * per


def choose_placements(buckets, room: int, mapped_fraction_of) -> tuple[list[str], dict]:
    """Placements in bucket order: "device" for the first movable buckets whose state fits in
    `room` bytes, then "mapped" for the first mapped_fraction_of(rest numel) of the remaining
    numel, "host" for the others. Streamed buckets and those without state (another rank's)
    keep their placement. Returns (placements, numbers)."""
    movable = [
        b for b in buckets if not b.streamed and getattr(b, "disk", None) is None and b.exp_avg is not None
    ]
    used, device_numel = 0, 0
    chosen: dict[int, str] = {}
    for b in movable:
        need = device_bytes(b)
        if used + need > room:
            break
        used += need
        device_numel += b.numel
        chosen[b.index] = "device"
    rest = [b for b in movable if b.index not in chosen]
    rest_numel = sum(b.numel for b in rest)
    f = mapped_fraction_of(rest_numel) if rest_numel else 0.0
    mapped = 0
    for b in rest:
        use_gpu = f > 0 and mapped + b.numel / 2 <= f * rest_numel
        chosen[b.index] = "mapped" if use_gpu else "host"
        mapped += b.numel if use_gpu else 0
    out = [chosen.get(b.index, b.placement) for b in buckets]
    info = {
        "device_numel": device_numel,
        "device_bytes": used,
        "mapped_numel": mapped,
        "host_numel": rest_numel - mapped,
        "mapped_fraction_of_rest": f,
    }
    return out, info


def maybe_share(opt, after_steps: int) -> None:
    """After a declined resident switch: moves the share of the state that fits in the VRAM left
    (with vram_headroom and MARGIN_BYTES to spare) to the device; logs the decision and appends
    it to opt.plan_history. Does nothing on the CPU, with data parallel, for mode "cpu", without
    CUDA kernels, or for a low-precision model with gradient accumulation."""
    from .. import hardware
    from .resident import device_memory

    engine = opt._engine
    mem = device_memory(engine.device)
    if mem is None or engine.dp is not None or opt.mode == "cpu" or hardware.kernels_problem():
        return
    if engine.accumulation_steps > 1 and any(b.dtype != torch.float32 for b in engine.buckets):
        return  # the GPU update would take gradients summed in bf16/fp16 (split.mapped_fraction_for)
    room = int(mem["usable"] * (1 - opt.vram_headroom)) - mem["peak"] - MARGIN_BYTES

    def mapped_fraction_of(numel: int) -> float:
        if opt.mode == "gpu":
            return 1.0
        from .split import choose_mapped_fraction, measure

        rates = measure(engine.device)
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
        opt.plan_history.append(entry)
        return
    targets, info = choose_placements(engine.buckets, room, mapped_fraction_of)
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
    opt.plan_history.append(entry)
    total = max(1, sum(got.values()))
    opt._log(
        f"offload=auto after {after_steps} steps: {room / 2**30:.2f} GiB of VRAM to spare (cap "
        f"{mem['usable'] / 2**30:.2f} GiB x (1 - {opt.vram_headroom:g}) - peak {mem['peak'] / 2**30:.2f} "
        f"- margin {MARGIN_BYTES / 2**30:.2f}): optimizer state of {got['device'] / total:.0%} of the "
        f"parameters now in VRAM, {got['mapped'] / total:.0%} updated over PCIe, "
        f"{got['host'] / total:.0%} on the host ({moved} buckets moved)"
    )
