"""Pinned host memory: arena-backed tensors, the page-lock budget, statistics and registration."""

from __future__ import annotations

import math
import numbers
import operator
import threading
import warnings
from collections.abc import Sequence

import torch

from .. import env
from .._native import lib

__all__ = [
    "pinned_empty",
    "memory_stats",
    "set_pin_budget",
    "pin_budget",
    "empty_cache",
    "reset_peak_memory_stats",
    "register_host_memory",
    "unregister_host_memory",
]

# torch dtype -> (DLPack type code, bits) of the arena tensor (codes: 0 int, 1 uint, 2 float,
# 4 bfloat, 6 bool). float32/bfloat16/float16/uint8/int8 are the core's own dtypes (dtype.h).
_DLPACK = {
    torch.float32: (2, 32),
    torch.bfloat16: (4, 16),
    torch.float16: (2, 16),
    torch.uint8: (1, 8),
    torch.int8: (0, 8),
    torch.float64: (2, 64),
    torch.int16: (0, 16),
    torch.int32: (0, 32),
    torch.int64: (0, 64),
    torch.bool: (6, 8),
}
_ACCEPTED = ", ".join(str(d).replace("torch.", "") for d in _DLPACK)


class _State:
    lock = threading.Lock()
    gpu: bool | None = None  # torch.cuda.is_available(), asked once
    fallback_warned = False
    budget_error_checked = False
    device_set = False


def _gpu() -> bool:
    if _State.gpu is None:
        _State.gpu = bool(torch.cuda.is_available())
    return _State.gpu


def _first_use() -> None:
    """Once per process: report a bad RAMSTREAM_PIN_BUDGET."""
    if _State.budget_error_checked:
        return
    with _State.lock:
        if _State.budget_error_checked:
            return
        _State.budget_error_checked = True
    env.get("RAMSTREAM_PIN_BUDGET", stacklevel=3)  # warns once per value (import ramstream did)


def _before_pinning() -> None:
    """Makes the arena pin through the device torch uses (no stray context on GPU 0)."""
    _first_use()
    if _State.device_set:
        return
    if not _gpu():
        _State.device_set = True  # nothing to choose
    elif torch.cuda.is_initialized():
        lib().set_pin_device(torch.cuda.current_device())
        _State.device_set = True


def _after_allocation(ptr: int) -> None:
    if _State.fallback_warned or not _gpu() or lib().is_arena_pinned(ptr):
        return
    with _State.lock:
        if _State.fallback_warned:
            return
        _State.fallback_warned = True
    reason = lib().memory_stats()["fallback_reason"]
    warnings.warn(
        "ramstream: pinned host memory unavailable, using ordinary pageable memory (copies to and "
        f"from the GPU are slower and not asynchronous): {reason}. Later fallbacks are counted in "
        "ramstream.memory_stats()['fallback_allocations'] without a warning.",
        RuntimeWarning,
        stacklevel=3,
    )


def _shape_of(shape) -> tuple[int, ...]:
    """An int or a sequence of non-negative ints (numpy ints and 1-element int tensors too, via
    ``__index__``; bool, float and str rejected) -> a tuple; ValueError naming shape otherwise."""
    bad = ValueError(f"pinned_empty: shape must be an int or a sequence of non-negative ints, got {shape!r}")
    if isinstance(shape, (bool, float, str, bytes)):
        raise bad
    if isinstance(shape, Sequence):
        items = tuple(shape)
    else:
        items = (shape,)
    dims = []
    for d in items:
        if isinstance(d, (bool, float)):
            raise bad
        try:
            d = operator.index(d)
        except TypeError:
            raise bad from None
        if d < 0:
            raise bad
        dims.append(d)
    return tuple(dims)


def _too_large(dims: tuple[int, ...], dtype: torch.dtype, itemsize: int, why: str) -> MemoryError:
    n = math.prod(dims)
    return MemoryError(
        f"pinned_empty: shape {dims} of {str(dtype).replace('torch.', '')} needs {n} elements x "
        f"{itemsize} bytes = {n * itemsize} bytes: {why}"
    )


def pinned_empty(shape, dtype: torch.dtype = torch.float32, *, own_pages: bool = False) -> torch.Tensor:
    """An uninitialised, C-contiguous CPU tensor whose memory comes from the pinned host arena.

    Args:
        shape: an int or a sequence of non-negative ints (0 allowed).
        dtype: float32, bfloat16, float16, uint8, int8, float64, int16, int32, int64 or bool.
        own_pages: give the tensor its own page-locked allocation (rounded up to 4 KiB) instead of
            a block of a shared 64 MiB slab, so that ``empty_cache()`` returns it to the driver as
            soon as it is freed (a slab stays page-locked while any block in it lives). For pools
            whose size follows the batch; costs one driver call when no cached block fits.

    Returns a CPU tensor usable like any other. With a CUDA driver and GPU its memory is
    page-locked (``is_pinned()`` is True, ``.to("cuda", non_blocking=True)`` is asynchronous);
    otherwise, or above the page-lock budget, it is ordinary memory: counted in
    ``memory_stats()["fallback_allocations"]`` and, on a machine with a GPU, reported by one
    RuntimeWarning per process. When the tensor and its views die the block returns to the
    arena's cache and is reused without pinning again. Thread-safe.

    Asynchronous copies: unlike ``torch.empty(pin_memory=True)``, the arena does not track streams.
    Keep the tensor alive until every ``non_blocking`` copy from or to it has completed (e.g.
    synchronise the stream or wait for an event), otherwise its memory may be reused under the copy.
    """
    dims = _shape_of(shape)
    if not isinstance(own_pages, bool):
        raise TypeError(f"pinned_empty: own_pages must be True or False, got {own_pages!r}")
    dl = _DLPACK.get(dtype) if isinstance(dtype, torch.dtype) else None
    if dl is None:
        raise TypeError(f"pinned_empty: dtype must be one of {_ACCEPTED}, got {dtype!r}")
    itemsize = dl[1] // 8
    if math.prod(dims) * itemsize >= 1 << 63:
        raise _too_large(dims, dtype, itemsize, "more than any host has")
    if not _State.device_set:
        _before_pinning()
    try:
        t = lib().pinned_empty_dlpack(list(dims), dl[0], dl[1], bool(own_pages))
    except MemoryError as e:
        raise _too_large(dims, dtype, itemsize, str(e)) from None
    # torch reports data_ptr() == 0 for empty tensors: nothing to check there.
    if not _State.fallback_warned and _gpu() and t.numel() > 0:
        _after_allocation(t.data_ptr())
    return t


def memory_stats() -> dict:
    """A snapshot of the pinned host arena's counters.

    Keys (bytes unless noted): ``bytes_pinned`` (page-locked memory held from the driver),
    ``bytes_in_use`` (blocks handed out, pinned or fallback, rounded to their size class),
    ``bytes_requested``, ``bytes_cached`` (pinned but free), ``peak_bytes_in_use``,
    ``bytes_registered`` (register_host_memory), ``fallback_allocations`` (count, cumulative),
    ``fallback_bytes_in_use``, ``pin_calls`` / ``unpin_calls`` (driver calls: reuse adds none),
    ``budget``, ``allocations`` and ``reuse_hits`` (counts), ``slabs``, ``dedicated_blocks``,
    ``physical_memory``, ``pinning_available`` (bool), ``fallback_reason``, ``budget_source``,
    ``budget_error`` (str).
    """
    _first_use()
    return dict(lib().memory_stats())


def pin_budget() -> int:
    """The page-lock budget in bytes (default: half of physical RAM; RAMSTREAM_PIN_BUDGET)."""
    return int(lib().pin_budget())


_BUDGET_ACCEPTED = "an int (bytes), a float fraction of physical RAM in [0, 1] or a str ('8G', '512M', '60%')"


def set_pin_budget(bytes_or_fraction) -> int:
    """Sets the page-lock budget and returns it in bytes.

    ``bytes_or_fraction``: an int (bytes, >= 0; 0 disables pinning), a float in [0, 1] (a fraction
    of physical RAM) or a string as RAMSTREAM_PIN_BUDGET takes it ("8G", "512M", "60%").
    Memory pinned above a lowered budget is unpinned when cached; blocks in use are kept, and
    later allocations fall back to ordinary memory until usage fits.
    """
    v = bytes_or_fraction
    if isinstance(v, bool):
        raise TypeError(f"set_pin_budget: bytes_or_fraction must be {_BUDGET_ACCEPTED}, got bool")
    if isinstance(v, numbers.Integral):
        n = int(v)
        if not 0 <= n < 1 << 63:
            raise ValueError(f"set_pin_budget: bytes must be an int in [0, 2**63), got {n}")
    elif isinstance(v, numbers.Real):
        v = float(v)
        if not (0.0 <= v <= 1.0):
            raise ValueError(
                f"set_pin_budget: a float is a fraction of physical RAM in [0, 1], got {v} "
                "(pass bytes as an int)"
            )
        ram = int(lib().physical_memory_bytes())
        if ram == 0:
            raise ValueError("set_pin_budget: physical RAM is unknown; pass bytes as an int")
        n = int(ram * v)
    elif isinstance(v, str):
        try:
            n = int(lib().parse_pin_budget(v))
        except ValueError as e:
            raise ValueError(f"set_pin_budget: bytes_or_fraction: {e}") from None
    else:
        raise TypeError(
            f"set_pin_budget: bytes_or_fraction must be {_BUDGET_ACCEPTED}, got {type(v).__name__}"
        )
    lib().set_pin_budget(n)
    return n


def empty_cache() -> None:
    """Gives fully free pinned slabs and cached dedicated blocks (large or ``own_pages``) back to
    the driver (cudaFreeHost).

    Blocks in use are untouched. cudaFreeHost synchronises the device: call it between steps.
    """
    lib().empty_cache()


def reset_peak_memory_stats() -> None:
    """Sets ``memory_stats()["peak_bytes_in_use"]`` to the current ``bytes_in_use``."""
    lib().reset_peak_memory_stats()


def _check_host_tensor(name: str, t) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor for t, got {type(t).__name__}")
    if t.device.type != "cpu":
        raise ValueError(f"{name}: t must be on the CPU, got device {t.device}")
    if not t.is_contiguous():
        raise ValueError(f"{name}: t must be contiguous (call .contiguous() first)")
    if t.numel() == 0:
        raise ValueError(f"{name}: t has no elements")


def register_host_memory(t: torch.Tensor) -> None:
    """Page-locks a contiguous CPU tensor's memory in place (cudaHostRegister, counted in the budget).

    Afterwards ``t.is_pinned()`` is True. Undo with ``unregister_host_memory(t)`` before the
    tensor's memory is freed. Raises RuntimeError without a CUDA driver/GPU, MemoryError above the
    page-lock budget, ValueError for a non-CPU or non-contiguous tensor.
    """
    _check_host_tensor("register_host_memory", t)
    _before_pinning()
    lib().register_host_memory(t.detach())


def unregister_host_memory(t: torch.Tensor) -> None:
    """Undoes ``register_host_memory(t)`` (the same tensor, or one starting at the same address)."""
    _check_host_tensor("unregister_host_memory", t)
    try:
        lib().unregister_host_memory(t.detach())
    except ValueError as e:  # not registered, or unregistered already
        raise ValueError(f"unregister_host_memory: t: {e}") from None
