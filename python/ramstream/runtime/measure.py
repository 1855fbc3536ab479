"""What the runtime reads from the live run for the planner's in-training decisions: the device's
memory figures and the optimizer's buckets as numbers (planner/inflight.py BucketFacts)."""

from __future__ import annotations

import torch

from ..planner.training import BucketFacts


def device_memory(device: torch.device) -> dict | None:
    """{"usable": bytes the process may hold, "peak": bytes it held at most, "now": bytes it holds}
    or None when the device has no separate memory to save (the CPU engine never switches)."""
    if device.type != "cuda":
        return None
    from ..hardware import gpu_memory

    m = gpu_memory(device)
    return {
        "usable": m["cap"],
        "peak": torch.cuda.max_memory_allocated(device),
        "now": torch.cuda.memory_allocated(device),
    }


def host_room() -> int:
    """Bytes of host memory this process may still take now: the RAM available (MemAvailable, or
    the cgroup's limit less its usage) less rules.HOST_RESERVE_SHARE of the machine's RAM (or of
    the cgroup's limit: the reserve the kernel and the rest of the process keep). Negative when
    already inside it."""
    from ..planner.profile import available_ram
    from ..planner.rules import HOST_RESERVE_SHARE

    ram = available_ram()
    total = min(ram["total"], ram["cgroup_limit"] or ram["total"])
    return int(ram["available"]) - int(total * HOST_RESERVE_SHARE)


def bucket_facts(buckets) -> list[BucketFacts]:
    """The engine's buckets (or stand-ins with index, numel, dtype, placement, streamed, exp_avg and
    optionally disk) as the planner's BucketFacts, in bucket order."""
    return [
        BucketFacts(
            index=b.index,
            numel=b.numel,
            placement=b.placement,
            working_bytes=b.dtype.itemsize,
            moment_bytes=b.exp_avg.element_size() if b.exp_avg is not None else 0,
            low_precision=b.dtype != torch.float32,
            streamed=bool(b.streamed),
            on_disk=getattr(b, "disk", None) is not None,
            has_state=b.exp_avg is not None,
        )
        for b in buckets
    ]


def oom_count(device: torch.device) -> int | None:
    """How many times the device's allocator has run out of memory in this process (torch's
    memory_stats "num_ooms", one dict built per call), or None where no count is kept (the CPU)."""
    if device.type != "cuda":
        return None
    return int(torch.cuda.memory_stats(device).get("num_ooms", 0))
