"""Under torch.autocast, a graph kept for backward (OffloadModel keep_activations=True) would hold
the low-precision cast of every streamed weight it used (matmuls save their weight operand), so
every chunk's cast would stay on the device until its backward. These saved-tensor hooks store
the parameter and the cast's dtype and layout instead, and cast again at unpack: a chunk's
backward runs after the streamer reloaded it, and the same cast gives the same values.

Only casts of trained parameters are recognised (autograd links them to the parameter); a frozen
weight's cast has no grad_fn and is kept as it is.
"""

from __future__ import annotations

import torch


class _Cast:
    __slots__ = ("param", "dtype", "device", "size", "stride", "offset")

    def __init__(self, t: torch.Tensor, param) -> None:
        self.param, self.dtype, self.device = param, t.dtype, t.device
        self.size, self.stride, self.offset = t.size(), t.stride(), t.storage_offset()


class CastSaver:
    """pack/unpack for torch.autograd.graph.saved_tensors_hooks over `params` (streamed ones)."""

    def __init__(self, params) -> None:
        self.ids = {id(p) for p in params}
        self.stats = {"casts_dropped": 0}

    def _param_of(self, t: torch.Tensor):
        """The streamed parameter whose cast t is (or a view of), else None."""
        base = t if t._base is None else t._base
        fn = base.grad_fn
        if fn is None or type(fn).__name__ != "ToCopyBackward0":
            return None
        nxt = fn.next_functions
        if len(nxt) != 1 or nxt[0][0] is None:
            return None
        p = getattr(nxt[0][0], "variable", None)
        if p is None or id(p) not in self.ids or p.shape != base.shape or p.dtype == base.dtype:
            return None
        if not base.is_contiguous() or not p.is_contiguous():
            return None
        return p

    def pack(self, t: torch.Tensor):
        p = self._param_of(t)
        if p is None:
            return t
        self.stats["casts_dropped"] += 1
        return _Cast(t, p)

    @staticmethod
    def unpack(x):
        if not isinstance(x, _Cast):
            return x
        with torch.no_grad():
            cast = x.param.to(device=x.device, dtype=x.dtype)  # loaded by now: no copy
        return cast.as_strided(x.size, x.stride, x.offset)

    def hooks(self):
        return torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack)
