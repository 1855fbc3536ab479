"""Measurements of what the machine offers: copy bandwidths, the host AdamW rate, the GPU matmul
rate, the cgroup memory limit and a disk tier folder's rates and free space. Shared by `ramstream doctor` and profile_hardware().

Every function runs on the calling thread, holds the GIL only around torch calls, and
synchronises the device it times (no stream is left with pending work).
"""

from __future__ import annotations

import time

import torch

# Host AdamW state traffic per parameter, in bytes (read + written through host RAM in one step):
# master fp32 read+write 8, gradient read 4 (fp32 view), each moment read+write 2 x moment bytes.
#   fp32 moments: 8 + 4 + 2 * 2 * 4 = 28;  bf16 moments: 8 + 4 + 2 * 2 * 2 = 20.
ADAMW_STATE_BYTES = {"float32": 28, "bfloat16": 20}

_CGROUP_V2 = "/sys/fs/cgroup"
_CGROUP_V1 = "/sys/fs/cgroup/memory"


def gpu_device(device: torch.device | str | None = None) -> torch.device | None:
    """The CUDA device to measure (`device`, or the current one when None), or None when it is the
    CPU or torch can use no GPU."""
    from ..hardware import torch_cuda_problem

    if device is not None and torch.device(device).type == "cpu":
        return None
    dev = torch.device(device) if device is not None else torch.device("cuda")
    if torch_cuda_problem(dev) is not None:
        return None
    if dev.index is None:
        dev = torch.device("cuda", torch.cuda.current_device())
    return dev


def best_seconds(fn, repeat: int = 3) -> float:
    """Fastest of `repeat` timed calls of fn() after one warm-up call, in seconds."""
    fn()
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def _read_bytes(path: str) -> int | None:
    """An integer byte count from a cgroup file; None for "max", v1's huge "unlimited", a missing
    or unreadable file, or anything not a number."""
    try:
        with open(path) as f:
            raw = f.read().strip()
    except OSError:
        return None
    if not raw.isdigit() or int(raw) >= 1 << 60:
        return None
    return int(raw)


def cgroup_memory(root: str | None = None) -> dict:
    """{"limit": bytes or None, "usage": bytes or None} of this process's memory cgroup.

    Reads cgroup v2 (``memory.max``, ``memory.current`` under `root`, default /sys/fs/cgroup),
    then v1 (``memory.limit_in_bytes``, ``memory.usage_in_bytes`` under root/memory when root is
    given, else /sys/fs/cgroup/memory). "max" and v1's unlimited value (>= 2**60) give None.
    """
    v2 = root if root is not None else _CGROUP_V2
    v1 = f"{root}/memory" if root is not None else _CGROUP_V1
    for limit_file, usage_file in (
        (f"{v2}/memory.max", f"{v2}/memory.current"),
        (f"{v1}/memory.limit_in_bytes", f"{v1}/memory.usage_in_bytes"),
    ):
        try:
            with open(limit_file):
                pass
        except OSError:
            continue
        return {"limit": _read_bytes(limit_file), "usage": _read_bytes(usage_file)}
    return {"limit": None, "usage": None}


def cgroup_limit(root: str | None = None) -> int | None:
    """The memory limit of this process's cgroup in bytes (v2 or v1), or None when unlimited."""
    return cgroup_memory(root)["limit"]


def copy_rates(nbytes: int = 64 << 20, device: torch.device | str | None = None, repeat: int = 3) -> dict:
    """GB/s (1e9 bytes/s) of copies of `nbytes`: {"h2d_gbps", "d2h_gbps", "duplex_gbps", "pinned",
    "device"}.

    On a CUDA device: pinned host <-> device copies, each direction alone, and "duplex_gbps" each
    way while both run at once on two streams. Without a usable GPU (or device="cpu"): host
    memcpy rates (all three the same measurement), "pinned" False.
    """
    from ..ops.memory import pinned_empty

    dev = gpu_device(device)
    if dev is None:
        a, b = torch.empty(nbytes, dtype=torch.uint8), torch.empty(nbytes, dtype=torch.uint8)
        rate = nbytes / best_seconds(lambda: b.copy_(a), repeat) / 1e9
        return {"h2d_gbps": rate, "d2h_gbps": rate, "duplex_gbps": rate, "pinned": False, "device": "cpu"}
    host_up = pinned_empty((nbytes,), dtype=torch.uint8)
    host_down = pinned_empty((nbytes,), dtype=torch.uint8)
    d_up = torch.empty(nbytes, dtype=torch.uint8, device=dev)
    d_down = torch.empty(nbytes, dtype=torch.uint8, device=dev)
    s_up, s_down = torch.cuda.Stream(dev), torch.cuda.Stream(dev)

    def h2d():
        d_up.copy_(host_up, non_blocking=True)
        torch.cuda.synchronize(dev)

    def d2h():
        host_down.copy_(d_down, non_blocking=True)
        torch.cuda.synchronize(dev)

    def both():
        with torch.cuda.stream(s_up):
            d_up.copy_(host_up, non_blocking=True)
        with torch.cuda.stream(s_down):
            host_down.copy_(d_down, non_blocking=True)
        torch.cuda.synchronize(dev)

    up = nbytes / best_seconds(h2d, repeat) / 1e9
    down = nbytes / best_seconds(d2h, repeat) / 1e9
    duplex = nbytes / best_seconds(both, repeat) / 1e9  # each way: nbytes crossed in each direction
    return {
        "h2d_gbps": up,
        "d2h_gbps": down,
        "duplex_gbps": duplex,
        "pinned": bool(host_up.is_pinned()),
        "device": str(dev),
    }


def host_adamw_seconds(p, grad, m, v, repeat: int = 3) -> float:
    """Fastest seconds of one ramstream host AdamW step on the given fp32 tensors (updated in
    place; the step counter continues from 2)."""
    from .. import functional as F

    step = [1]

    def run():
        step[0] += 1
        F.adamw_(p, grad, m, v, step=step[0], lr=1e-3)

    return best_seconds(run, repeat)


def host_adamw_gbps(n: int = 2_000_000, repeat: int = 3) -> float:
    """Host AdamW state traffic in GB/s: n fp32 parameters per step x ADAMW_STATE_BYTES["float32"]
    (28 B: master, gradient and both moments, read and written) / the fastest step's seconds."""
    g = torch.Generator().manual_seed(0)
    p, grad = torch.randn(n, generator=g), torch.randn(n, generator=g)
    m, v = torch.zeros(n), torch.zeros(n)
    return n * ADAMW_STATE_BYTES["float32"] / host_adamw_seconds(p, grad, m, v, repeat) / 1e9


def matmul_tflops(device: torch.device | str | None = None, n: int = 4096, repeat: int = 3) -> float | None:
    """Dense bf16 GEMM rate on the GPU in TFLOP/s (2 n^3 flops per n x n product); None without a
    usable GPU."""
    dev = gpu_device(device)
    if dev is None:
        return None
    a = torch.randn(n, n, device=dev, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=dev, dtype=torch.bfloat16)

    def run():
        for _ in range(4):
            torch.mm(a, b)
        torch.cuda.synchronize(dev)

    return 4 * 2 * n**3 / best_seconds(run, repeat) / 1e12


def disk_rates(directory, quick: bool = True) -> dict:
    """{"disk_dir", "disk_read_gbps", "disk_write_gbps", "disk_free"} of the folder `directory`:
    ramstream.disk.measure_disk's rates (DiskStore's own I/O threads, O_DIRECT where the
    filesystem takes it; writes 2 x 256 MiB, 2 x 1 GiB when not quick, in a scratch file it
    removes) and the free bytes after it (shutil.disk_usage). OSError naming the path when the
    folder is missing or not writable."""
    import os
    import shutil

    from ..disk.store import measure_disk

    path = os.fspath(directory)
    r = measure_disk(path, size=(256 << 20) if quick else (1 << 30))
    return {
        "disk_dir": os.path.abspath(path),
        "disk_read_gbps": float(r["read_gbps"]),
        "disk_write_gbps": float(r["write_gbps"]),
        "disk_free": int(shutil.disk_usage(path).free),
    }
