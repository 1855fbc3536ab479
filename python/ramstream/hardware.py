"""What the machine offers: host RAM, CPU ISA and threads, GPUs (free memory under any cap)."""
from __future__ import annotations

import os

import torch


def host_memory() -> dict:
    """Total and available host RAM in bytes (from /proc/meminfo; sysconf as a fallback)."""
    info = {}
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                key, _, rest = line.partition(":")
                info[key] = int(rest.split()[0]) * 1024
    except OSError:
        pass
    total = info.get("MemTotal") or os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    avail = info.get("MemAvailable", total)
    return {"total": total, "available": avail}


def gpu_memory(device: torch.device) -> dict:
    """Free and total bytes the process may use on `device`, honouring
    torch.cuda.set_per_process_memory_fraction."""
    free, total = torch.cuda.mem_get_info(device)
    frac = getattr(torch.cuda.memory, "get_per_process_memory_fraction", None)
    cap = total
    if frac is not None:
        cap = int(total * frac(device))
    reserved = torch.cuda.memory_reserved(device)
    usable = min(free + reserved, cap) - reserved
    return {"total": total, "cap": cap, "free": max(0, usable), "reserved": reserved,
            "allocated": torch.cuda.memory_allocated(device)}


def describe() -> dict:
    """A summary of what ramstream sees (used by `ramstream info`)."""
    from ._native import lib

    C = lib()
    out = {
        "isa": C.active_isa(),
        "best_isa": C.best_isa(),
        "isa_env_error": C.isa_env_error(),
        "threads": C.num_threads(),
        "ram": host_memory(),
        "built_with_cuda": bool(C.built_with_cuda()),
        "cuda_runtime": C.cuda_runtime_version(),
        "cuda_devices": C.cuda_device_count(),
        "cuda_unavailable_reason": C.cuda_unavailable_reason(),
        "torch": torch.__version__,
        "torch_cuda": torch.cuda.is_available(),
        "gpus": [],
    }
    if torch.cuda.is_available():
        for i in range(torch.cuda.device_count()):
            d = torch.device("cuda", i)
            out["gpus"].append({"name": torch.cuda.get_device_name(i), **gpu_memory(d)})
    return out
