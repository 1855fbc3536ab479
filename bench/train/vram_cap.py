"""The one place a benchmark caps its process's GPU memory (a smaller GPU, emulated)."""

from __future__ import annotations


def cap_vram(device, cap_gib: float | None):
    """`device` as a torch.device with an index (cuda: the current one when none is given); on a
    GPU with a cap (GiB; None or 0: none), this process's allocations there are capped at
    min(cap, the card's memory) with torch.cuda.set_per_process_memory_fraction."""
    import torch

    dev = torch.device(device)
    if dev.type != "cuda":
        return dev
    if dev.index is None:
        dev = torch.device("cuda", torch.cuda.current_device())
    if cap_gib:
        total = torch.cuda.get_device_properties(dev).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, cap_gib * 2**30 / total), dev)
    return dev
