"""``prefer="speed"``: one autograd node for a peft LoRA layer over a quantized base.

peft's ``lora.Linear`` runs the base layer and the adapter as separate ops: the input is cast to
the adapter's dtype (fp32) and back (autocast), the adapter's output is scaled and added, and the
backward mirrors each of these; per layer that is about ten kernels and as many autograd nodes in
each direction, most of them elementwise passes over [tokens, features] tensors. For a 14B base
they cost more than the NF4 expansions. :class:`FusedQuantLoraFn` computes the same function in
three GEMMs and an expansion:

    y  = x W^T (+ b) + s (x A^T) B^T          forward: h = x A^T saved ([tokens, r]), y by addmm
    dx = g W + (s g B) A                      backward: W expanded again, no elementwise pass on x
    dA = (s g B)^T x,  dB = (s g)^T h

It is not bit-identical to peft's path: the adapter's product is added inside the GEMM's fp32
accumulation (one rounding) where peft rounds the base output, the adapter output and the scaled
adapter output to the compute dtype before adding them. That is why ``prefer="exact"`` (the
default) leaves peft's forward alone. A call the fused node does not cover (dropout, several
active adapters, a variant such as DoRA, a LoRA bias, merged or disabled adapters, extra forward
arguments, mixed dtypes without autocast) takes peft's own forward, unchanged.
"""

from __future__ import annotations

import threading
import weakref

import torch
import torch.nn as nn

from .packed import EXPAND, LAST_READ, expand_weight, is_quantized

__all__ = ["FusedQuantLoraFn", "fuse_lora_", "unfuse_lora_", "is_fused"]

_FLAG = "_ramstream_fused_lora"


class _Stash:
    """A forward that runs inside backward (a recomputed block) keeps the weight it expanded for
    that layer's backward, which then does not expand it once more. Kept per base module: the
    backward that runs is the original forward's node (non-reentrant checkpointing recomputes
    only the saved tensors), and the expanded weight depends on the module alone. At most
    ``limit`` bytes are held (beyond it the backward expands again, as in plain training); a kept
    tensor gives its bytes back when it is freed, whatever frees it."""

    _KEY = "_ramstream_expanded"

    def __init__(self, limit: int) -> None:
        self.limit, self.held = limit, 0
        self.lock = threading.Lock()

    def put(self, base: nn.Module, cd: torch.dtype) -> torch.Tensor | None:
        """Expands base's weight into a tensor of its own and keeps it; None over the limit."""
        nbytes = torch.Size(base.quant_shape).numel() * cd.itemsize
        with self.lock:
            if base.__dict__.get(self._KEY) is not None or self.held + nbytes > self.limit:
                return None
            self.held += nbytes
        w = expand_weight(base, reuse=False)
        w = w if w.dtype == cd else w.to(cd)
        weakref.finalize(w, self._give_back, nbytes)
        base.__dict__[self._KEY] = w
        return w

    def pop(self, base: nn.Module) -> torch.Tensor | None:
        return base.__dict__.pop(self._KEY, None)

    def _give_back(self, nbytes: int) -> None:
        with self.lock:
            self.held -= nbytes


STASH = _Stash(1 << 30)


def _in_backward() -> bool:
    return torch._C._current_graph_task_id() != -1


class FusedQuantLoraFn(torch.autograd.Function):
    """y = x W^T + b + s (x A^T) B^T with W expanded from ``base``'s packed codes (see the module
    docstring); x, A and B are cast to the compute dtype ``cd``. Saves x, h = x A^T and the cast
    adapters; a recomputed forward also keeps its expanded W for the backward (``STASH``)."""

    @staticmethod
    def forward(ctx, x, a_weight, b_weight, bias, base, scaling, cd):  # noqa: D102
        ctx.base, ctx.scaling, ctx.x_dtype = base, scaling, x.dtype
        LAST_READ.drop()
        ctx.a_dtype, ctx.b_dtype = a_weight.dtype, b_weight.dtype
        x2 = x.reshape(-1, x.shape[-1]).to(cd)
        a, b = a_weight.to(cd), b_weight.to(cd)
        h = x2.mm(a.t())
        kept = STASH.put(base, cd) if _in_backward() else None
        with EXPAND.lock:
            if kept is not None:
                w = kept
            else:
                w = expand_weight(base, reuse=True)
                w = w if w.dtype == cd else w.to(cd)
            y = torch.addmm(bias.to(cd), x2, w.t()) if bias is not None else x2.mm(w.t())
        y.addmm_(h, b.t(), alpha=scaling)
        del w, kept
        ctx.save_for_backward(x2, h, a, b)
        return y.view(x.shape[:-1] + (y.shape[-1],))

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad):  # noqa: D102
        x2, h, a, b = ctx.saved_tensors
        stashed = STASH.pop(ctx.base)
        stashed = stashed if stashed is not None and stashed.dtype == x2.dtype else None
        cd, s = x2.dtype, ctx.scaling
        g2 = grad.reshape(-1, grad.shape[-1]).to(cd)
        need_x, need_a, need_b, need_bias = ctx.needs_input_grad[:4]
        gx = ga = gb = gbias = None
        if need_b:  # the scale goes on the [out, r] and [tokens, r] products, not on g
            gb = g2.t().mm(h).mul_(s).to(ctx.b_dtype)
        if need_x or need_a:
            gh = g2.mm(b).mul_(s)
            if need_a:
                ga = gh.t().mm(x2).to(ctx.a_dtype)
            if need_x:
                if stashed is not None:
                    gx = g2.mm(stashed)
                else:
                    with EXPAND.lock:
                        w = expand_weight(ctx.base, reuse=True)
                        gx = g2.mm(w if w.dtype == cd else w.to(cd))
                gx.addmm_(gh, a)
                gx = gx.view(grad.shape[:-1] + (gx.shape[-1],)).to(ctx.x_dtype)
        if need_bias:
            gbias = g2.sum(0)
        return gx, ga, gb, gbias, None, None, None


def _is_lora_linear(m: nn.Module) -> bool:
    try:
        from peft.tuners.lora.layer import Linear as LoraLinear  # noqa: PLC0415
    except ImportError:  # peft is optional: without it there is nothing to fuse
        return False
    return isinstance(m, LoraLinear)


def _plain_dropout(d: nn.Module) -> bool:
    return isinstance(d, nn.Identity) or (isinstance(d, nn.Dropout) and d.p == 0.0)


def _fused_forward(self, x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
    """The instance forward installed by :func:`fuse_lora_`: the fused node when the call is the
    plain case, peft's own forward otherwise."""
    plain = type(self).forward
    if args or kwargs or self.disable_adapters or self.merged:
        return plain(self, x, *args, **kwargs)
    active = [n for n in self.active_adapters if n in self.lora_A]
    if len(active) != 1:
        return plain(self, x, *args, **kwargs)
    name = active[0]
    lora_a, lora_b = self.lora_A[name], self.lora_B[name]
    if (
        name in self.lora_variant
        or lora_a.bias is not None
        or lora_b.bias is not None
        or not _plain_dropout(self.lora_dropout[name])
    ):
        return plain(self, x, *args, **kwargs)
    base = self.base_layer
    dev = x.device.type
    if torch.is_autocast_enabled(dev):
        cd = torch.get_autocast_dtype(dev)
    elif x.dtype == lora_a.weight.dtype == lora_b.weight.dtype == base.quant_dtype:
        cd = x.dtype
    else:  # peft would cast x to the adapter's dtype: its semantics, its path
        return plain(self, x, *args, **kwargs)
    scaling = float(self.scaling[name])
    return FusedQuantLoraFn.apply(x, lora_a.weight, lora_b.weight, base.bias, base, scaling, cd)


def fuse_lora_(model: nn.Module) -> int:
    """Installs the fused forward on every peft ``lora.Linear`` of ``model`` whose base layer is
    quantized (and not transposed: Conv1D bases keep peft's path). Returns how many."""
    n = 0
    for m in model.modules():
        if _is_lora_linear(m) and is_quantized(m.base_layer) and not m.base_layer.quant_transposed:
            if not getattr(m, "fan_in_fan_out", False) and not is_fused(m):
                m.forward = _fused_forward.__get__(m)
                setattr(m, _FLAG, True)
                n += 1
    return n


def unfuse_lora_(model: nn.Module) -> int:
    """Removes what :func:`fuse_lora_` installed (``unwrap()``); returns how many."""
    n = 0
    for m in model.modules():
        if is_fused(m):
            del m.forward
            delattr(m, _FLAG)
            n += 1
    return n


def is_fused(m: nn.Module) -> bool:
    return bool(m.__dict__.get(_FLAG, False))
