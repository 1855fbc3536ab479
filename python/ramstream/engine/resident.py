"""offload="auto": when the optimizer state fits in device memory with room to spare, run the
update on the device with torch's fused AdamW instead of offloading.

The switch keeps the precision the optimizer asked for: fp32 masters (a low-precision model keeps
an fp32 master copy on the device) and the moments' dtype (bf16 moments are updated by
ramstream's CUDA kernel, which keeps their stochastic rounding; fp32 ones by torch's fused
kernel). Moments that are bf16 only because host RAM was short (moment_dtype="auto" chose them)
become fp32 again on the device, where host RAM no longer limits them: the upcast is exact, and
the log and plan history say so. Hyper-parameters are read from the OffloadAdamW's param_groups at every step, so LR
schedulers keep working.

Gradients are taken from the parameters as autograd accumulates them, as the offloaded engine
does: summed over micro-batches in fp32 (a low-precision model's included), clipped by their
norm accumulated in double, and dropped with their accumulation window when a backward pass
raises (docs/guide/wrap.md, "When a backward pass raises").
"""

from __future__ import annotations

import math

import torch

from .._faults import fault_point
from .intake import _grad_hook, _weak_method, track_pass
from .layout import master_flat, replaced_params
from .nonfinite import NonFiniteGradientError, describe, find_nonfinite, slot_name, warn_caller
from .updater import clip_coefficient


def resident_split(engine, upcast: bool = False) -> tuple[int, int]:
    """(persistent, gradients): device bytes the resident update adds for good (moments, fp32
    masters of low-precision buckets; none for a bucket whose state is in VRAM already, unless its
    moments are upcast) and the gradients it keeps on the device during backward (with their fp32
    copies for low-precision buckets). upcast: the moments become fp32."""
    persistent = grads = 0
    for b in engine.buckets:
        # a bucket whose state started in VRAM (a resident plan) hands it over as it is
        on_device = b.placement == "device"
        moment = 4 if upcast else b.exp_avg.element_size()
        if not on_device or moment != b.exp_avg.element_size():
            persistent += 2 * b.numel * moment
        grads += b.numel * b.dtype.itemsize
        if b.dtype != torch.float32:
            persistent += 0 if on_device else b.numel * 4
            grads += b.numel * 4
    return persistent, grads


class Resident:
    """The device-side optimizer that replaces the engine after the switch."""

    def __init__(self, engine, param_groups: list[dict], upcast_moments: bool = False) -> None:
        engine.synchronize()
        moment = {"dtype": torch.float32} if upcast_moments else {}
        self.engine = engine  # closed after the switch; its names and frozen list stay
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
            # state that started in VRAM (placement "device") is taken over as it is, not copied
            copy = b.placement != "device"
            if s.param.dtype == torch.float32:
                master = s.param  # the fp32 weights are their own master
            else:
                master = master_flat(b)[sl].to(self.device, copy=copy).view(s.param.shape)
            self.masters[s.index] = master
            self.state[s.index] = {
                "step": torch.tensor(float(s.step), dtype=torch.float32, device=self.device),
                "exp_avg": b.exp_avg[sl].to(self.device, copy=copy, **moment).view(s.param.shape),
                "exp_avg_sq": b.exp_avg_sq[sl].to(self.device, copy=copy, **moment).view(s.param.shape),
                "offset": b.state_offset + s.offset,
            }
            fault_point("resident.switch")
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.grads: dict[int, torch.Tensor] = {}  # summed since the last step (fp32)
        self._clip_now, self._clip_stale = None, False  # clip_grad_norm_: (max_norm, norm)
        self._in_backward, self._task = False, -1
        self._on_grad_weak = _weak_method(self, "_on_grad")
        self._hooks = {s.index: self._hook(s) for s in self.slots}
        self._frozen_hooks = [
            _grad_hook(p, _weak_method(engine.intake, "on_frozen_grad")) for p in engine.frozen
        ]

    # ---- backward -----------------------------------------------------------------------------
    def _hook(self, s):
        on_grad = self._on_grad_weak  # hooks live in C++: they must not hold self
        return _grad_hook(s.param, lambda p, i=s.index: on_grad(p, i))

    def _on_grad(self, p: torch.nn.Parameter, i: int) -> None:
        """p's gradient of this pass joins the sum since the last step (as fp32) and leaves .grad,
        so that a pass that raises can be dropped whole."""
        track_pass(self)
        g, p.grad = p.grad, None
        if g is None:
            return
        acc = self.grads.get(i)
        if acc is None:
            self.grads[i] = g if g.dtype == torch.float32 else g.float()
        else:
            acc.add_(g)

    def _begin_backward(self) -> None:
        self._in_backward = True
        self._clip_stale = self._clip_now is not None
        torch.autograd.Variable._execution_engine.queue_callback(self._end_backward)

    def _end_backward(self) -> None:
        self._in_backward = False

    def recover_if_abandoned(self) -> None:
        """Outside a backward pass, a pass still marked as running raised before its end."""
        if self._in_backward and torch._C._current_graph_task_id() == -1:
            self._abandon_backward()

    def discard_if_gathered(self) -> None:
        """zero_grad() between backward and step(): the gradients summed since the last step are
        dropped, as torch drops them."""
        self._clip_now = None
        if not self._in_backward and self.grads:
            dropped = len(self.grads)
            self.grads = {}
            self.engine.log(
                f"zero_grad() after backward, before step(): the gradients of "
                f"{dropped} parameters gathered since the last step were discarded"
            )

    def _abandon_backward(self) -> None:
        """Updates run only in step(): dropping the gradients gathered since the last step leaves
        weights and optimizer state as they were before the failed pass."""
        dropped = len(self.grads)
        self.grads, self._clip_now = {}, None
        self._in_backward, self._task = False, -1
        self.engine.log(
            f"a backward pass raised before its end: the gradients of {dropped} "
            "parameters gathered since the last step were discarded"
        )
        for fn in self.engine.on_abandon:
            fn()

    # ---- update -------------------------------------------------------------------------------
    def step(self) -> bool:
        """Updates what the step's backward passes gathered; False when skipped (non-finite)."""
        self.recover_if_abandoned()
        fault_point("resident.step")
        if self._in_backward:
            raise RuntimeError("ramstream: optimizer.step() called during backward")
        for s in self.slots:
            if s.param.device != self.device:
                raise RuntimeError(
                    f"ramstream: parameter of shape {tuple(s.param.shape)} is on {s.param.device} "
                    f"but the optimizer runs on {self.device}; move the model back with "
                    f"model.to('{self.device}')"
                )
        clip, self._clip_now = self._clip_now, None
        if clip is not None and self._clip_stale:
            raise RuntimeError(
                "ramstream: a backward pass ran after clip_grad_norm_ and before "
                "step(); call clip_grad_norm_ after the last one"
            )
        grads, self.grads = self.grads, {}
        if not grads:
            return True
        norm = clip[1] if clip is not None else None
        if clip is None and self.max_grad_norm is not None:
            norm = math.sqrt(self._sq_norm(grads.values()))
        if norm is not None and not math.isfinite(norm):  # nothing updated; the gradients dropped
            limit = (
                f"clip_grad_norm_({clip[0]:g})"
                if clip is not None
                else f"max_grad_norm={self.max_grad_norm:g}"
            )
            return self._skip_nonfinite(norm, grads, limit)
        scale = (
            1.0
            if norm is None
            else clip_coefficient(clip[0] if clip is not None else self.max_grad_norm, norm)
        )
        for gi, group in enumerate(self.param_groups):
            idx = [s.index for s in self.slots if s.group == gi and s.index in grads]
            if idx:
                self._update_group(group, idx, grads, scale)
        return True

    def _skip_nonfinite(self, norm: float, grads: dict, limit: str) -> bool:
        """As Engine._skip_nonfinite, for the device-side optimizer (its gradients are in `grads`,
        already taken from the step)."""
        e = self.engine
        bad = find_nonfinite(
            [s for s in self.slots if s.index in grads], lambda s: grads[s.index].reshape(-1)
        )
        names = [slot_name(e.names, s) for s in bad]
        e.stats["skipped_steps"] += 1
        step = e.stats["steps"] + 1
        msg = describe(norm, names, step, limit, e.skip_nonfinite)
        e.log(msg)
        if not e.skip_nonfinite:
            raise NonFiniteGradientError(msg, norm=norm, parameters=names, step=step)
        warn_caller(msg)
        return False

    def _sq_norm(self, grads) -> float:
        """Sum of the squared gradients, accumulated in double as the offloaded engine does."""
        from ..ops import _raw

        if self.device.type != "cuda":
            return sum(_raw.sq_norm(x=g.contiguous()) for g in grads)
        total = torch.zeros(1, dtype=torch.float64, device=self.device)
        stream = torch.cuda.current_stream(self.device).cuda_stream
        for g in grads:
            _raw.cuda_sq_norm(
                x=g.contiguous(), out=total, accumulate=True, stream=stream, device=self.device.index
            )
        return float(total.item())

    @torch.no_grad()
    def _update_group(self, group: dict, idx: list[int], grads: dict, scale: float) -> None:
        b1, b2 = group["betas"]
        lr = group["lr"]
        lr = float(lr.item() if torch.is_tensor(lr) else lr)
        st = [self.state[i] for i in idx]
        for x in st:
            x["step"] += 1
        if st[0]["exp_avg"].dtype == torch.float32:
            params = [self.masters[i] for i in idx]
            gs = [grads[i] if scale == 1.0 else grads[i].mul_(scale) for i in idx]
            torch._fused_adamw_(
                params,
                gs,
                [x["exp_avg"] for x in st],
                [x["exp_avg_sq"] for x in st],
                [],
                [x["step"] for x in st],
                lr=lr,
                beta1=b1,
                beta2=b2,
                weight_decay=group["weight_decay"],
                eps=group["eps"],
                amsgrad=False,
                maximize=False,
            )
        else:  # bf16 moments: ramstream's kernel (stochastic rounding), on the device's side
            from ..ops import _raw

            on_cuda = self.device.type == "cuda"
            kernel = _raw.cuda_adamw_ptr if on_cuda else _raw.adamw_ptr
            where = (
                {"stream": torch.cuda.current_stream(self.device).cuda_stream, "device": self.device.index}
                if on_cuda
                else {}
            )
            for i, x in zip(idx, st):
                g, m = grads[i].contiguous(), self.masters[i]
                kernel(
                    param=m.data_ptr(),
                    grad=g.data_ptr(),
                    grad_dtype=g.dtype,
                    exp_avg=x["exp_avg"].data_ptr(),
                    exp_avg_sq=x["exp_avg_sq"].data_ptr(),
                    moment_dtype=x["exp_avg"].dtype,
                    n=m.numel(),
                    offset=x["offset"],
                    lr=lr,
                    beta1=b1,
                    beta2=b2,
                    eps=group["eps"],
                    weight_decay=group["weight_decay"],
                    step=int(x["step"].item()),
                    grad_scale=scale,
                    seed=self.seed,
                    **where,
                )
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
                continue  # step() reports the misplaced parameter
            m = self.masters[s.index]
            with torch.no_grad():
                s.param.copy_(m)
            if s.param.dtype == torch.float32:
                self.masters[s.index] = s.param

    def resync_masters(self, model: torch.nn.Module | None = None) -> None:
        """After weights were loaded into the model: parameters load_state_dict(assign=True)
        replaced hand over their slots (the loaded values move into the wrapped tensors); a
        separate master takes the fp32 value loaded into its low-precision parameter exactly, and
        elsewhere the loaded weight when the working copy no longer equals master.to(its dtype)
        (as the offloaded engine's layout.resync_masters)."""
        loaded, self.engine._loading = self.engine._loading, {}
        replaced = replaced_params(self.engine, model) if model is not None else {}
        with torch.no_grad():
            for s, p in replaced.items():
                self._adopt(s, p)
            for s in self.slots:
                m = self.masters[s.index]
                if m is s.param:
                    continue  # the fp32 weights are their own master
                v, w = loaded.get(s), s.param.detach()
                if v is not None and torch.equal(w, v.reshape(m.shape).to(w.device, w.dtype)):
                    m.copy_(v.reshape(m.shape))
                elif not torch.equal(w, m.to(w.dtype)):
                    m.copy_(w)

    def _adopt(self, s, p: torch.nn.Parameter) -> None:
        """p replaced s.param in the model: its value moves into the wrapped tensor (the working
        dtype and device stay) and p takes the slot, its hook and its place in param_groups."""
        old = s.param
        value = p.detach().reshape(old.shape)
        m = self.masters[s.index]
        if m is not old:
            m.copy_(value)  # exact when the loaded value is fp32
        old.copy_(value)
        p.data = old.data
        self._hooks[s.index].remove()
        s.param = p
        self._hooks[s.index] = self._hook(s)
        if m is old:
            self.masters[s.index] = p
        for g in self.param_groups:
            g["params"] = [p if q is old else q for q in g["params"]]

    def close(self) -> None:
        """Removes the gradient hooks: the parameters are plain ones again (unwrap())."""
        for h in list(self._hooks.values()) + self._frozen_hooks:
            h.remove()
        self._hooks, self._frozen_hooks, self.grads = {}, [], {}
