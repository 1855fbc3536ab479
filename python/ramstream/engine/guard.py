"""guard_params: a read of a parameter whose update is still in flight waits for it.

Parameters of a wrapped model get the class GuardedParameter (same object, same storage;
only the class changes). Its __torch_function__ costs one global check while no update is
pending; while one is, an op that reads a pending parameter first waits for that parameter's
bucket. Metadata (shape, dtype, device, .grad, requires_grad, ...) never waits.
"""

from __future__ import annotations

import torch

# Number of buckets with an update in flight, over all engines (a cheap global fast path).
_pending = [0]

_METADATA_NAMES = (
    "shape",
    "dtype",
    "device",
    "grad",
    "requires_grad",
    "is_leaf",
    "ndim",
    "layout",
    "is_cuda",
    "is_cpu",
    "is_sparse",
    "is_quantized",
    "is_meta",
    "names",
    "name",
    "_base",
    "grad_fn",
    "_version",
    "data_ptr",
    "untyped_storage",
    "storage_offset",
    "size",
    "dim",
    "numel",
    "stride",
    "element_size",
    "nelement",
    "is_contiguous",
    "get_device",
    "__len__",
    "requires_grad_",
    "retain_grad",
    "register_hook",
    "register_post_accumulate_grad_hook",
    "is_floating_point",
    "is_complex",
    "itemsize",
    "nbytes",
    "_is_view",
    "__hash__",
    "__eq__",
    "_backward_hooks",
    "_post_accumulate_grad_hooks",
    "__reduce_ex__",
    "__deepcopy__",
)


def _metadata_funcs() -> frozenset:
    out = set()
    for name in _METADATA_NAMES:
        attr = getattr(torch.Tensor, name, None)
        if attr is None:
            continue
        out.add(attr)
        for acc in ("__get__", "__set__", "fget", "fset"):
            f = getattr(attr, acc, None)
            if f is not None:
                out.add(f)
    return frozenset(out)


_METADATA = _metadata_funcs()


def _wait_args(args, kwargs) -> None:
    for a in args:
        if isinstance(a, GuardedParameter):
            slot = getattr(a, "_ramstream_slot", None)
            if slot is not None and slot.bucket is not None and slot.bucket.pending:
                slot.engine_wait(slot.bucket)
        elif isinstance(a, (list, tuple)):
            _wait_args(a, None)
    if kwargs:
        _wait_args(tuple(kwargs.values()), None)


class GuardedParameter(torch.nn.Parameter):
    """An nn.Parameter whose reads wait for its in-flight update (see module docstring)."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        if _pending[0] and func not in _METADATA:
            _wait_args(args, kwargs)
        with torch._C.DisableTorchFunctionSubclass():
            return func(*args, **(kwargs or {}))

    def __reduce_ex__(self, proto):  # pickles / deep-copies as a plain Parameter
        with torch._C.DisableTorchFunctionSubclass():
            return torch.nn.Parameter(self.data, self.requires_grad).__reduce_ex__(proto)

    def __deepcopy__(self, memo):
        with torch._C.DisableTorchFunctionSubclass():
            out = torch.nn.Parameter(self.data.clone(memory_format=torch.preserve_format), self.requires_grad)
        memo[id(self)] = out
        return out

    def __repr__(self) -> str:
        with torch._C.DisableTorchFunctionSubclass():
            return "Parameter containing:\n" + torch.Tensor.__repr__(self.data)


def guard(param: torch.nn.Parameter) -> None:
    if type(param) is torch.nn.Parameter:
        param.__class__ = GuardedParameter


def unguard(param: torch.nn.Parameter) -> None:
    if type(param) is GuardedParameter:
        param.__class__ = torch.nn.Parameter
