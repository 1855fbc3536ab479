"""HardwareProfile and profile_hardware(): what this machine offers the planner, its measured rates
cached on disk as JSON.

Cache: one file per (hostname, GPU name, driver, torch, ramstream, device) under
``$RAMSTREAM_CACHE_DIR`` (default ``~/.cache/ramstream``), named ``profile-<sha256 prefix>.json``,
written to a temporary name and renamed (atomic on POSIX). Only the rates are cached; free VRAM
and available RAM are read again on every call. A missing, unreadable, corrupt or mismatching file
is measured again and rewritten; failing to write it is not an error.
"""

from __future__ import annotations

import hashlib
import json
import os
import socket
import tempfile
from dataclasses import asdict, dataclass, field, fields

import torch

from .. import env
from . import measure
from .trainstream_names import TrainStreamProfileNames

# The rates profile_hardware() measures (and caches); everything else is read on each call.
RATE_FIELDS = ("h2d_gbps", "d2h_gbps", "duplex_gbps", "adamw_gbps", "matmul_tflops")
_CACHE_FORMAT = 1


@dataclass
class HardwareProfile(TrainStreamProfileNames):
    """What one process may use on this machine, for plan_training(). TrainStream 0.4.1's field
    names and derived quantities are read-only properties (trainstream_names.py).

    Bytes are bytes; rates are GB/s (1e9 bytes/s) and TFLOP/s (1e12 flop/s).

    - vram_total, vram_free: the device's memory and what this process may still allocate (under
      torch.cuda.set_per_process_memory_fraction); 0 on the CPU.
    - ram_total, ram_available: the machine's RAM, and min(MemAvailable, cgroup limit - usage).
    - pin_budget: bytes the pinned arena may page-lock (ramstream.pin_budget()).
    - h2d_gbps, d2h_gbps: pinned copies one way at a time; duplex_gbps: each way while both run
      (on the CPU all three are host memcpy rates).
    - adamw_gbps: host AdamW state traffic, ``params/s x 28 B`` (fp32 master read+write 8 B, fp32
      gradient read 4 B, two fp32 moments read+written 16 B), measured with fp32 moments.
    - matmul_tflops: dense bf16 GEMM rate on the GPU; None on the CPU.
    - local_world_size: processes on this machine (LOCAL_WORLD_SIZE); they share RAM and the pin
      budget, so the planner uses ram_per_rank and pin_per_rank.
    - disk_dir, disk_read_gbps, disk_write_gbps, disk_free: the disk tier's folder (nvme_dir), its
      read and write rates through ramstream's DiskStore (GB/s) and its free bytes; None when no
      disk was asked for (profile_hardware(nvme_dir=...)) or the number is unknown. Profiles
      saved before these fields existed load with None.
    """

    device: str = "cpu"
    gpu_name: str | None = None
    vram_total: int = 0
    vram_free: int = 0
    ram_total: int = 0
    ram_available: int = 0
    pin_budget: int = 0
    h2d_gbps: float = 0.0
    d2h_gbps: float = 0.0
    duplex_gbps: float = 0.0
    adamw_gbps: float = 0.0
    matmul_tflops: float | None = None
    local_world_size: int = 1
    cpu_threads: int = 1
    isa: str = "scalar"
    versions: dict = field(default_factory=dict)
    source: str = "measured"  # "measured", "cache" (rates read from the cache file) or "given"
    disk_dir: str | None = None
    disk_read_gbps: float | None = None
    disk_write_gbps: float | None = None
    disk_free: int | None = None

    @property
    def ram_per_rank(self) -> int:
        """Available RAM this process may plan for: rules.HOST_RAM_SHARE (90 %) of ram_available /
        local_world_size, the share wrap()'s host arithmetic (planner/host_fit.py) allows, so that a plan
        the planner accepts is never refused there."""
        from .rules import HOST_RAM_SHARE

        return int(self.ram_available * HOST_RAM_SHARE) // max(1, self.local_world_size)

    @property
    def pin_per_rank(self) -> int:
        """Page-lock budget this process may plan for: pin_budget / local_world_size."""
        return self.pin_budget // max(1, self.local_world_size)

    def to_dict(self) -> dict:
        """A JSON-able dict of every field."""
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "HardwareProfile":
        """The profile a to_dict() produced (unknown keys rejected: ValueError naming them)."""
        if not isinstance(d, dict):
            raise TypeError(f"HardwareProfile.from_dict: expected a dict, got {type(d).__name__}")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ValueError(
                f"HardwareProfile.from_dict: unknown key(s) {', '.join(unknown)}; accepted: "
                f"{', '.join(sorted(known))}"
            )
        return cls(**d)


def cache_dir() -> str:
    """$RAMSTREAM_CACHE_DIR, or ~/.cache/ramstream (also when it names something that is not a
    folder: a RuntimeWarning says so, env.py)."""
    return env.get("RAMSTREAM_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "ramstream")


def local_world_size() -> int:
    """LOCAL_WORLD_SIZE (torchrun) or SLURM_NTASKS_PER_NODE as an int >= 1; 1 when unset or not a
    positive integer."""
    for name in ("LOCAL_WORLD_SIZE", "SLURM_NTASKS_PER_NODE"):
        raw = os.environ.get(name, "").strip()
        if raw.isdigit() and int(raw) >= 1:
            return int(raw)
    return 1


def available_ram(cgroup_root: str | None = None) -> dict:
    """{"total", "available", "cgroup_limit", "cgroup_usage"}: MemAvailable, lowered to the
    cgroup's limit - usage when a limit is set (`cgroup_root` as in measure.cgroup_memory)."""
    from ..hardware import host_memory

    ram = host_memory()
    cg = measure.cgroup_memory(cgroup_root)
    avail = ram["available"]
    if cg["limit"] is not None:
        avail = min(avail, max(0, cg["limit"] - (cg["usage"] or 0)))
    return {
        "total": ram["total"],
        "available": avail,
        "cgroup_limit": cg["limit"],
        "cgroup_usage": cg["usage"],
    }


def _versions() -> dict:
    import ramstream

    from ..hardware import nvidia_driver

    return {"torch": torch.__version__, "ramstream": ramstream.__version__, "driver": nvidia_driver()["cuda"]}


def _cache_path(device: str, gpu_name: str | None, versions: dict) -> tuple[str, dict]:
    key = {
        "format": _CACHE_FORMAT,
        "host": socket.gethostname(),
        "gpu": gpu_name,
        "device": device,
        **versions,
    }
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:20]
    return os.path.join(cache_dir(), f"profile-{digest}.json"), key


def _read_cache(path: str, key: dict) -> dict | None:
    """The cached rates, or None when the file is missing, unreadable, corrupt or for another key."""
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, ValueError, UnicodeDecodeError):
        return None
    if not isinstance(data, dict) or data.get("key") != key or not isinstance(data.get("rates"), dict):
        return None
    rates = data["rates"]
    for name in RATE_FIELDS:
        v = rates.get(name)
        if name == "matmul_tflops" and v is None:
            continue
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not v > 0:
            return None
    return {name: rates[name] for name in RATE_FIELDS}


def _write_cache(path: str, key: dict, rates: dict) -> None:
    """Writes the file atomically (temp file in the same folder, then os.replace); never raises."""
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=".profile-", suffix=".tmp", dir=os.path.dirname(path))
        try:
            with os.fdopen(fd, "w", encoding="utf-8") as f:
                json.dump({"key": key, "rates": rates}, f, indent=1)
            os.replace(tmp, path)
        except BaseException:
            os.unlink(tmp)
            raise
    except OSError:
        pass


def measure_rates(device: str, quick: bool = True) -> dict:
    """The rates of RATE_FIELDS, measured now on `device` ("cpu" or "cuda:N"). quick: 64 MiB copies
    (about a second or two); otherwise 256 MiB. The host AdamW runs on 16M parameters either way
    (448 MB of state, beyond any cache, ~4 ms a step at 110 GB/s): with 2M, the 16-core GPU
    machine measured 55-104 GB/s in three sessions where its training steps ran at 97-136 GB/s
    (bench/RESULTS.md, fifth session), which put the planner's optimizer time off by up to 1.5x."""
    nbytes, n = (64 << 20, 16_000_000) if quick else (256 << 20, 16_000_000)
    copies = measure.copy_rates(nbytes, device)
    return {
        "h2d_gbps": copies["h2d_gbps"],
        "d2h_gbps": copies["d2h_gbps"],
        "duplex_gbps": copies["duplex_gbps"],
        "adamw_gbps": measure.host_adamw_gbps(n),
        "matmul_tflops": measure.matmul_tflops(device, n=4096 if quick else 8192),
    }


def _profile_device(device) -> torch.device | None:
    """The CUDA device to profile, or None for the CPU; TypeError/ValueError for a bad value,
    RuntimeError (with what to do) for a CUDA device torch cannot use."""
    from ..hardware import torch_cuda_problem

    accepted = "None, 'cpu', 'cuda', 'cuda:N' or a torch.device"
    if device is None:
        return measure.gpu_device(None)
    if not isinstance(device, (str, torch.device)):
        raise TypeError(f"profile_hardware: device must be {accepted}, got {device!r}")
    try:
        d = torch.device(device)
    except (RuntimeError, ValueError):
        raise ValueError(
            f"profile_hardware: device={device!r} is not accepted; accepted: {accepted}"
        ) from None
    if d.type == "cpu":
        return None
    if d.type != "cuda":
        raise ValueError(f"profile_hardware: device={device!r} is not accepted; accepted: {accepted}")
    problem = torch_cuda_problem(d)
    if problem:
        raise RuntimeError(f"profile_hardware: device={device!r}: {problem}")
    return measure.gpu_device(d)


def cached_profile(device=None) -> HardwareProfile | None:
    """profile_hardware(device) when the cache has this machine's rates, else None (measures
    nothing)."""
    return profile_hardware(device, _cache_only=True)


def profile_hardware(
    device=None, quick: bool = True, force: bool = False, *, nvme_dir=None, _cache_only: bool = False
) -> HardwareProfile:
    """Measures (or reads from the cache) what this machine offers and returns a HardwareProfile.

    Args:
        device: None (the current CUDA device, else the CPU), "cpu", "cuda", "cuda:N" or a
            torch.device.
        quick: shorter measurements (a few seconds in all) when the cache has none.
        force: measure the rates again even when the cache has them (and rewrite it).
        nvme_dir: a folder for the disk tier (wrap()'s nvme_dir), or None. When given, its read and
            write rates and free space are measured on every call (measure.disk_rates: a scratch
            file of 2 x 256 MiB written and read, removed after) and fill the profile's disk_*
            fields; they are not cached (free space changes, and so may the folder's disk).

    Free VRAM, available RAM, the pin budget and LOCAL_WORLD_SIZE are read on every call. Not
    thread-safe against a concurrent set_per_process_memory_fraction; uses the default stream of
    `device` for its copies and synchronises it.
    """
    from .._native import lib
    from ..hardware import gpu_memory
    from ..ops.memory import pin_budget

    for name, v in (("quick", quick), ("force", force)):
        if not isinstance(v, bool):
            raise TypeError(f"profile_hardware: {name} must be True or False, got {v!r}")
    if nvme_dir is not None and not isinstance(nvme_dir, (str, os.PathLike)):
        raise TypeError(f"profile_hardware: nvme_dir must be None or a folder path, got {nvme_dir!r}")
    dev = _profile_device(device)
    name = "cpu" if dev is None else str(dev)
    gpu_name = None if dev is None else torch.cuda.get_device_name(dev)
    versions = _versions()
    vram = gpu_memory(dev) if dev is not None else {"total": 0, "free": 0}
    ram = available_ram()
    C = lib()
    path, key = _cache_path(name, gpu_name, versions)
    rates = None if force else _read_cache(path, key)
    source = "cache"
    if rates is None:
        if _cache_only:
            return None
        rates = measure_rates(name, quick)
        source = "measured"
        _write_cache(path, key, rates)
    disk = measure.disk_rates(nvme_dir, quick) if nvme_dir is not None else {}
    return HardwareProfile(
        device=name,
        gpu_name=gpu_name,
        vram_total=int(vram["total"]),
        vram_free=int(vram["free"]),
        ram_total=int(ram["total"]),
        ram_available=int(ram["available"]),
        pin_budget=int(pin_budget()),
        local_world_size=local_world_size(),
        cpu_threads=int(C.num_threads()),
        isa=str(C.active_isa()),
        versions=versions,
        source=source,
        **rates,
        **disk,
    )
