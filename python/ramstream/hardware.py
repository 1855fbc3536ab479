"""What the machine offers: host RAM, CPU ISA and threads, NVIDIA driver, GPUs (free memory under
any cap), and why a CUDA device cannot be used, in words that say what to do."""

from __future__ import annotations

import ctypes
import functools
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
    return {
        "total": total,
        "cap": cap,
        "free": max(0, usable),
        "reserved": reserved,
        "allocated": torch.cuda.memory_allocated(device),
    }


def allocatable(mem: dict) -> int:
    """Bytes the process may still allocate (gpu_memory's dict): its "free" plus what the caching
    allocator has reserved but not handed out, under the cap. The plan (runtime/inspect.py) and
    wrap()'s weight check count the same."""
    return max(0, int(mem["free"] + mem["reserved"] - mem.get("allocated", mem["reserved"])))


def _version(v: int) -> str:
    """CUDA's integer versions (12080) as text ("12.8")."""
    return f"{v // 1000}.{v % 1000 // 10}"


@functools.cache
def nvidia_driver() -> dict:
    """{"found": bool, "cuda": "13.0" or None}: whether the NVIDIA driver library (libcuda.so.1)
    loads, and the newest CUDA version it supports. Never raises."""
    try:
        cuda = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return {"found": False, "cuda": None}
    v = ctypes.c_int(0)
    try:
        ok = cuda.cuDriverGetVersion(ctypes.byref(v)) == 0
    except AttributeError:
        ok = False
    return {"found": True, "cuda": _version(v.value) if ok and v.value else None}


NO_DRIVER = (
    "no NVIDIA driver or GPU was found (libcuda.so.1 does not load); ramstream runs "
    "on the CPU with device='cpu'"
)


def torch_cuda_problem(device: torch.device | str = "cuda") -> str | None:
    """Why torch cannot use `device` (a CUDA device), with what to do; None when it can."""
    device = torch.device(device)
    if not nvidia_driver()["found"]:
        return NO_DRIVER
    if torch.version.cuda is None:
        return (
            f"this torch ({torch.__version__}) is a CPU-only build: install a CUDA build of "
            "torch (https://pytorch.org/get-started/locally) or use device='cpu'"
        )
    if not torch.cuda.is_available() or torch.cuda.device_count() == 0:
        drv = nvidia_driver()["cuda"]
        return (
            f"torch (CUDA {torch.version.cuda}) sees no GPU with this NVIDIA driver "
            f"(supports CUDA {drv or '?'}): check nvidia-smi and CUDA_VISIBLE_DEVICES, or "
            "use device='cpu'"
        )
    n = torch.cuda.device_count()
    if device.index is not None and device.index >= n:
        return f"{device} does not exist: this machine has {n} GPU(s), cuda:0 to cuda:{n - 1}"
    return None


def kernels_problem() -> str | None:
    """Why ramstream's own CUDA kernels (optimizer_mode='gpu', the CUDA functional ops) cannot
    run, with what to do; None when they can."""
    from ._native import lib

    C = lib()
    if not C.built_with_cuda():
        return (
            "this build of ramstream has no CUDA kernels (compiled without a CUDA toolkit "
            "or with RAMSTREAM_CUDA=OFF): reinstall with nvcc on PATH "
            "(RAMSTREAM_CUDA=ON pip install .) or use optimizer_mode='cpu'"
        )
    if C.cuda_device_count() > 0:
        return None
    drv = nvidia_driver()
    if not drv["found"]:
        return NO_DRIVER
    rt = _version(C.cuda_runtime_version())
    return (
        f"the NVIDIA driver (supports CUDA {drv['cuda'] or '?'}) cannot run this build's "
        f"CUDA runtime {rt} ({C.cuda_unavailable_reason()}): update the driver, or check "
        "nvidia-smi and CUDA_VISIBLE_DEVICES"
    )


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
        "cuda_unavailable_reason": kernels_problem() or "",
        "driver": nvidia_driver(),
        "torch": torch.__version__,
        "torch_cuda": torch.cuda.is_available(),
        "gpus": [],
    }
    if torch.cuda.is_available():
        for i in range(torch.cuda.device_count()):
            d = torch.device("cuda", i)
            out["gpus"].append({"name": torch.cuda.get_device_name(i), **gpu_memory(d)})
    return out
