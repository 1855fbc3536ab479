"""The host AdamW rate and the pinned PCIe bandwidth, measured once per process (about 0.1 s) or
seeded from the hardware profile: what the optimizer split (runtime/optimizer_split.py) and the
activation policy (runtime/activation_policy.py) weigh their choices with."""

from __future__ import annotations

import time

import torch

_MEASURED: dict = {}


def seed(device: torch.device, host_params_per_s: float, pcie_bytes_per_s: float) -> None:
    """Uses the hardware profile's rates (planner.profile_hardware, cached on disk) instead of
    measuring them again in this process."""
    if host_params_per_s > 0 and pcie_bytes_per_s > 0:
        _MEASURED[str(device)] = {
            "host_params_per_s": host_params_per_s,
            "pcie_bytes_per_s": pcie_bytes_per_s,
        }


def measured_rates(device: torch.device) -> dict:
    """Host AdamW rate (params/s) and one-way pinned PCIe bandwidth (bytes/s), measured once
    per process (about 0.1 s)."""
    key = str(device)
    if key in _MEASURED:
        return _MEASURED[key]
    from ..ops import _raw

    n = 1 << 24
    p, g = torch.randn(n), torch.randn(n)
    m, v = torch.zeros(n), torch.zeros(n)
    best = float("inf")
    for step in range(1, 4):
        t0 = time.perf_counter()
        _raw.adamw_ptr(
            param=p.data_ptr(),
            grad=g.data_ptr(),
            grad_dtype=g.dtype,
            exp_avg=m.data_ptr(),
            exp_avg_sq=v.data_ptr(),
            moment_dtype=m.dtype,
            n=n,
            step=step,
            lr=1e-3,
            beta1=0.9,
            beta2=0.999,
            eps=1e-8,
            weight_decay=0.0,
        )
        best = min(best, time.perf_counter() - t0)
    out = {"host_params_per_s": n / best}
    if device.type == "cuda":
        from ..ops.memory import pinned_empty

        host = pinned_empty(1 << 26, torch.uint8)
        dev = torch.empty(1 << 26, dtype=torch.uint8, device=device)
        dev.copy_(host, non_blocking=True)
        torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        for _ in range(3):
            dev.copy_(host, non_blocking=True)
        torch.cuda.synchronize(device)
        out["pcie_bytes_per_s"] = 3 * (1 << 26) / (time.perf_counter() - t0)
    _MEASURED[key] = out
    return out
