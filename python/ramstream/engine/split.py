"""How much of the update the GPU does over PCIe ("mapped") and how much the host threads do.

Host share: per parameter the host streams ~32 bytes through RAM (AdamW) and PCIe carries the
gradient down and the new weight up (working dtype, each direction). Mapped share: the GPU
kernel reads and writes the moments (and a low-precision model's fp32 master) over PCIe, the
host CPU does nothing. With fraction f mapped, the step's optimizer work takes about
max(host(1-f), pcie(f)); both are linear in f, so the best f is where they cross.
"""

from __future__ import annotations

import time

import torch

_MEASURED: dict = {}


def choose_mapped_fraction(
    *,
    numel: int,
    host_params_per_s: float,
    pcie_bytes_per_s: float,
    working_bytes: int,
    moment_bytes: int,
    master_on_host: bool,
) -> tuple[float, dict]:
    """The mapped fraction f in [0, 1] minimising max(host time, PCIe time), with the arithmetic."""
    host_pcie = working_bytes  # per direction, host share
    mapped_pcie = 2 * moment_bytes + (4 if master_on_host else 0)
    t_host_all = numel / host_params_per_s
    t_pcie = lambda f: numel * (f * mapped_pcie + (1 - f) * host_pcie) / pcie_bytes_per_s  # noqa: E731
    t_host = lambda f: (1 - f) * t_host_all  # noqa: E731
    # t_host(f) = t_pcie(f)  ->  f = (t_host_all - t_pcie(0)) / (t_host_all + t_pcie(1) - t_pcie(0))
    denom = t_host_all + t_pcie(1.0) - t_pcie(0.0)
    f = 0.0 if denom <= 0 else min(1.0, max(0.0, (t_host_all - t_pcie(0.0)) / denom))
    info = {
        "fraction": f,
        "host_params_per_s": host_params_per_s,
        "pcie_bytes_per_s": pcie_bytes_per_s,
        "pcie_bytes_per_param_host": host_pcie,
        "pcie_bytes_per_param_mapped": mapped_pcie,
        "t_host_only_s": t_host_all,
        "t_pcie_host_only_s": t_pcie(0.0),
        "t_estimate_s": max(t_host(f), t_pcie(f)),
    }
    return f, info


def seed(device: torch.device, host_params_per_s: float, pcie_bytes_per_s: float) -> None:
    """Uses the hardware profile's rates (planner.profile_hardware, cached on disk) instead of
    measuring them again in this process."""
    if host_params_per_s > 0 and pcie_bytes_per_s > 0:
        _MEASURED[str(device)] = {
            "host_params_per_s": host_params_per_s,
            "pcie_bytes_per_s": pcie_bytes_per_s,
        }


def measure(device: torch.device) -> dict:
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

    rates = measure(device)
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
