"""offload="auto": when the optimizer state fits in device memory with room to spare, run the
update on the device with torch's fused AdamW instead of offloading.

The switch keeps the precision the offloaded run had: fp32 masters (a low-precision model keeps
an fp32 master copy on the device) and the moments' dtype (bf16 moments are updated by
ramstream's CUDA kernel, which keeps their stochastic rounding; fp32 ones by torch's fused
kernel). Hyper-parameters are read from the OffloadAdamW's param_groups at every step, so LR
schedulers keep working.
"""
from __future__ import annotations

import torch

from .layout import master_flat


def device_memory(device: torch.device) -> dict | None:
    """{"usable": bytes the process may hold, "peak": bytes it held at most} or None when the
    device has no separate memory to save (the CPU engine never switches)."""
    if device.type != "cuda":
        return None
    from ..hardware import gpu_memory

    m = gpu_memory(device)
    return {"usable": m["cap"], "peak": torch.cuda.max_memory_allocated(device)}


def resident_bytes(engine) -> int:
    """Device bytes the resident update needs beyond what the offloaded run holds: moments,
    gradients kept on the device, and fp32 masters of low-precision buckets."""
    total = 0
    for b in engine.buckets:
        total += 2 * b.numel * b.exp_avg.element_size() + b.numel * b.dtype.itemsize
        if b.dtype != torch.float32:
            total += b.numel * 4 * 2            # fp32 master + its fp32 gradient
    return total


class Resident:
    """The device-side optimizer that replaces the engine after the switch."""

    def __init__(self, engine, param_groups: list[dict]) -> None:
        engine.synchronize()
        self.param_groups = param_groups
        self.device = engine.device
        self.slots = list(engine.slots)
        self.max_grad_norm = engine.max_grad_norm
        self.seed = engine.seed
        self.by_index = {s.index: s for s in self.slots}
        self.masters: dict[int, torch.Tensor] = {}
        self.state: dict[int, dict] = {}
        for s in self.slots:
            b = s.bucket
            sl = slice(s.offset, s.offset + s.numel)
            if s.param.dtype == torch.float32:
                master = s.param            # the fp32 weights are their own master
            else:
                master = master_flat(b)[sl].to(self.device, copy=True).view(s.param.shape)
            self.masters[s.index] = master
            self.state[s.index] = {
                "step": torch.tensor(float(s.step), dtype=torch.float32, device=self.device),
                "exp_avg": b.exp_avg[sl].to(self.device, copy=True).view(s.param.shape),
                "exp_avg_sq": b.exp_avg_sq[sl].to(self.device, copy=True).view(s.param.shape),
                "offset": b.state_offset + s.offset,
            }
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def step(self) -> None:
        for s in self.slots:
            if s.param.device != self.device:
                raise RuntimeError(
                    f"ramstream: parameter of shape {tuple(s.param.shape)} is on {s.param.device} "
                    f"but the optimizer runs on {self.device}; move the model back with "
                    f"model.to('{self.device}')")
        grads = {s.index: s.param.grad for s in self.slots if s.param.grad is not None}
        if not grads:
            return
        if self.max_grad_norm is not None:
            torch.nn.utils.clip_grad_norm_([s.param for s in self.slots if s.index in grads],
                                           self.max_grad_norm)
        for gi, group in enumerate(self.param_groups):
            idx = [s.index for s in self.slots if s.group == gi and s.index in grads]
            if idx:
                self._update_group(group, idx, grads)
        for s in self.slots:
            s.param.grad = None

    @torch.no_grad()
    def _update_group(self, group: dict, idx: list[int], grads: dict) -> None:
        b1, b2 = group["betas"]
        lr = group["lr"]
        lr = float(lr.item() if torch.is_tensor(lr) else lr)
        st = [self.state[i] for i in idx]
        for x in st:
            x["step"] += 1
        if st[0]["exp_avg"].dtype == torch.float32:
            params = [self.masters[i] for i in idx]
            gs = [grads[i] if grads[i].dtype == torch.float32 else grads[i].float() for i in idx]
            torch._fused_adamw_(params, gs, [x["exp_avg"] for x in st],
                                [x["exp_avg_sq"] for x in st], [], [x["step"] for x in st],
                                lr=lr, beta1=b1, beta2=b2, weight_decay=group["weight_decay"],
                                eps=group["eps"], amsgrad=False, maximize=False)
        else:   # bf16 moments: ramstream's kernel (stochastic rounding), on the device's side
            from .._native import lib
            from .host_jobs import dtype_code

            C = lib()
            for i, x in zip(idx, st):
                g, m = grads[i].contiguous(), self.masters[i]
                args = (m.data_ptr(), g.data_ptr(), dtype_code(g.dtype), x["exp_avg"].data_ptr(),
                        x["exp_avg_sq"].data_ptr(), 1, 0, 0, m.numel(), x["offset"], lr, b1, b2,
                        group["eps"], group["weight_decay"], int(x["step"].item()), 1.0, self.seed)
                if self.device.type == "cuda":
                    C.cuda_adamw_ptr(*args, torch.cuda.current_stream(self.device).cuda_stream,
                                     self.device.index)
                else:
                    C.adamw_ptr(*args)
        for i in idx:
            s = self.by_index[i]
            if self.masters[i] is not s.param:
                s.param.copy_(self.masters[i])

    def step_counts(self) -> dict[int, int]:
        return {i: int(x["step"].item()) for i, x in self.state.items()}

    def before_apply(self) -> None:
        """A conversion must not round a master that is the parameter itself: detach it."""
        for s in self.slots:
            if self.masters[s.index] is s.param:
                self.masters[s.index] = s.param.detach().clone()

    def after_apply(self) -> None:
        for s in self.slots:
            if s.param.device != self.device:
                continue            # step() reports the misplaced parameter
            m = self.masters[s.index]
            with torch.no_grad():
                s.param.copy_(m)
            if s.param.dtype == torch.float32:
                self.masters[s.index] = s.param

    def resync_masters(self) -> None:
        """After weights were loaded into the model: separate masters take the loaded values
        when the working copy no longer equals master.to(working dtype)."""
        for s in self.slots:
            m = self.masters[s.index]
            if m is not s.param and not torch.equal(s.param.detach(), m.to(s.param.dtype)):
                with torch.no_grad():
                    m.copy_(s.param)
