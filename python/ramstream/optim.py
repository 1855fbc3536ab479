"""OffloadAdamW: AdamW whose state lives in host RAM and whose update runs on host threads.

A torch.optim.Optimizer, so LR schedulers, param groups and state dicts work as with
torch.optim.AdamW; numerics equal torch's fused CPU AdamW (fp32 master weights on the host).
"""
from __future__ import annotations

import math
from typing import Any

import torch

from .options import (parse_accumulation_steps, parse_max_grad_norm, parse_moment_dtype,
                      parse_threads)

_GROUP_EXTRAS = dict(amsgrad=False, maximize=False, foreach=None, capturable=False,
                     differentiable=False, fused=None)


def _check_hyper(lr, betas, eps, weight_decay) -> None:
    def bad(name, value, accepted):
        return ValueError(f"OffloadAdamW: {name}={value!r} is invalid; accepted: {accepted}")

    if isinstance(lr, bool) or not isinstance(lr, (int, float)) or not math.isfinite(lr) or lr < 0:
        raise bad("lr", lr, "a finite float >= 0")
    if (not isinstance(betas, (tuple, list)) or len(betas) != 2
            or not all(isinstance(b, (int, float)) and math.isfinite(b) and 0 <= b < 1 for b in betas)):
        raise bad("betas", betas, "a pair of floats in [0, 1)")
    if not isinstance(eps, (int, float)) or not math.isfinite(eps) or eps <= 0:
        raise bad("eps", eps, "a finite float > 0")
    if not isinstance(weight_decay, (int, float)) or not math.isfinite(weight_decay) or weight_decay < 0:
        raise bad("weight_decay", weight_decay, "a finite float >= 0")


class OffloadAdamW(torch.optim.Optimizer):
    """AdamW with fp32 master weights, moments and the update on the host.

    Args:
        params: parameters or param groups (as torch.optim.AdamW), all on one device.
        lr, betas, eps, weight_decay: as torch.optim.AdamW (decoupled weight decay).
        mode: "cpu" (host threads update, state in host RAM), "gpu" (the CUDA kernel updates
            state kept in pinned host memory over PCIe; the host CPU does nothing) or "auto"
            (a share of each, from measured host and PCIe rates; "cpu" on a CPU device).
        max_grad_norm: clip by the global norm like torch.nn.utils.clip_grad_norm_ (None: off).
        accumulation_steps: backward passes summed on the host per step().
        moment_dtype: "float32" or "bfloat16" (stochastic rounding).
        threads: host threads for the update (None: RAMSTREAM_NUM_THREADS or all cores).
        device: the compute device (default: the parameters' device).
    """

    def __init__(self, params, lr: float = 1e-3, betas=(0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 1e-2, *, mode: str = "cpu", max_grad_norm=None,
                 accumulation_steps: int = 1, moment_dtype: Any = "float32", threads=None,
                 device=None, guard_params: bool = True, bucket_bytes: int = 32 << 20,
                 seed: int = 0, _order=None, _log=None) -> None:
        _check_hyper(lr, betas, eps, weight_decay)
        if not isinstance(mode, str) or mode not in ("cpu", "gpu", "auto"):
            raise ValueError(f"OffloadAdamW: mode={mode!r} is not accepted; accepted: 'cpu', "
                             "'gpu', 'auto'")
        self._max_grad_norm = parse_max_grad_norm(max_grad_norm, "OffloadAdamW:")
        self._accumulation_steps = parse_accumulation_steps(accumulation_steps, "OffloadAdamW:")
        md = parse_moment_dtype(moment_dtype, allow_auto=False, where="OffloadAdamW:")
        self._moment_dtype = torch.float32 if md == "float32" else torch.bfloat16
        self._threads = parse_threads(threads, "OffloadAdamW:")
        if not isinstance(guard_params, bool):
            raise ValueError(f"OffloadAdamW: guard_params={guard_params!r}; accepted: True, False")
        self._engine = None
        defaults = dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay, **_GROUP_EXTRAS)
        super().__init__(params, defaults)
        if self._threads is not None:
            from ._native import lib

            lib().set_num_threads(self._threads)
        devices = {p.device for g in self.param_groups for p in g["params"]}
        if device is None:
            if len(devices) != 1:
                raise ValueError(f"OffloadAdamW: parameters are on several devices {devices}; "
                                 "pass device=")
            device = devices.pop()
        self.split_info: dict = {}
        from .engine.core import Engine

        device = torch.device(device)
        self.mode = mode
        fraction = self._mapped_fraction(mode, device, _log)
        self._engine_args = dict(device=device, moment_dtype=self._moment_dtype,
                                 mapped_fraction=fraction,
                                 max_grad_norm=self._max_grad_norm,
                                 accumulation_steps=self._accumulation_steps,
                                 bucket_bytes=bucket_bytes, guard_params=guard_params, seed=seed,
                                 log=_log)
        self._engine = Engine(self.param_groups, order=_order, **self._engine_args)

    def _mapped_fraction(self, mode: str, device: torch.device, log) -> float:
        if mode == "cpu":
            return 0.0
        if device.type != "cuda":
            if mode == "gpu":
                raise ValueError("OffloadAdamW: mode='gpu' needs a CUDA device (the GPU updates "
                                 "state kept in pinned host memory)")
            return 0.0
        if mode == "gpu":
            return 1.0
        from .engine.split import choose_mapped_fraction, measure

        params = [p for g in self.param_groups for p in g["params"]]
        rates = measure(device)
        f, info = choose_mapped_fraction(
            numel=sum(p.numel() for p in params), host_params_per_s=rates["host_params_per_s"],
            pcie_bytes_per_s=rates["pcie_bytes_per_s"], working_bytes=params[0].element_size(),
            moment_bytes=self._moment_dtype.itemsize, master_on_host=params[0].dtype != torch.float32)
        self.split_info = info
        if log is not None:
            log(f"optimizer_mode=auto: {f:.0%} of the parameters updated by the GPU over PCIe "
                f"(host {info['host_params_per_s'] / 1e9:.2f} G params/s, PCIe "
                f"{info['pcie_bytes_per_s'] / 1e9:.1f} GB/s; estimated optimizer time "
                f"{info['t_estimate_s'] * 1e3:.0f} ms instead of {info['t_host_only_s'] * 1e3:.0f} ms)")
        return f

    # ---- torch.optim.Optimizer API --------------------------------------------------------
    def add_param_group(self, param_group: dict) -> None:
        if self._engine is not None:
            raise RuntimeError("OffloadAdamW.add_param_group: param groups are fixed once the "
                               "engine is built; create the optimizer with every group")
        super().add_param_group(param_group)

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._engine.step()
        if not self._engine.forward_waits and not self._engine.guard_params:
            self._engine.synchronize()
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        super().zero_grad(set_to_none=set_to_none)

    def state_dict(self) -> dict:
        from .engine.state import export_state

        return export_state(self._engine, self.param_groups)

    def load_state_dict(self, state_dict: dict) -> None:
        from .engine.state import import_state

        import_state(self._engine, self.param_groups, state_dict)

    # ---- ramstream extras ---------------------------------------------------------------------
    def synchronize(self) -> None:
        """Waits until every queued update has reached the model's weights."""
        self._engine.synchronize()

    def master_weights(self) -> list[torch.Tensor]:
        """Copies of the fp32 master weights, one per parameter in param_groups order (shaped
        like the parameter). For a bf16/fp16 model these hold the precision the model lacks."""
        from .engine.layout import master_flat

        self._engine.synchronize()
        by_index = {s.index: s for s in self._engine.slots}
        out = []
        i = 0
        for g in self.param_groups:
            for p in g["params"]:
                s = by_index.get(i)
                if s is None:
                    out.append(p.detach().float().cpu().clone())
                else:
                    master = master_flat(s.bucket)
                    out.append(master[s.offset:s.offset + s.numel].view(p.shape).to(
                        "cpu", copy=True))
                i += 1
        return out

    def stats(self) -> dict:
        """steps, bytes_d2h, bytes_h2d, host_update_s, host_land_s, wait_s, waits."""
        return dict(self._engine.stats)

    @property
    def resident(self) -> bool:
        """True when the optimizer runs on the device (offload="auto" found that it fits)."""
        return False

    def close(self) -> None:
        if self._engine is not None:
            self._engine.close()
