"""Tests of the pinned host arena: tensors, reuse, fallback bookkeeping, registration,
concurrency (the budget: test_memory_budget.py; GPU copies: test_memory_cuda.py)."""

from __future__ import annotations

import gc
import random
import threading
import warnings

import pytest
import torch

import ramstream
from ramstream import functional as F
from ramstream._native import lib
from ramstream.ops import memory as mem

# restore_budget is a fixture: pytest finds it here once imported
from _memory_helpers import (
    ALL_DTYPES,
    MiB,
    pinning,
    random_like,
    restore_budget,  # noqa: F401
    stats,
)

# 0, 1, around the 4 KiB minimum block, between size classes, around the 16 MiB slab-block
# limit (larger blocks are dedicated allocations), a large odd size.
BYTE_SIZES = [0, 1, 4095, 4096, 4097, 5000, 12289, MiB + 1, 16 * MiB - 1, 16 * MiB + 1, 40 * MiB + 3]


# ---- API surface -------------------------------------------------------------------------------


def test_exports():
    for name in [
        "pinned_empty",
        "memory_stats",
        "set_pin_budget",
        "pin_budget",
        "empty_cache",
        "reset_peak_memory_stats",
        "register_host_memory",
        "unregister_host_memory",
    ]:
        assert getattr(ramstream, name) is getattr(mem, name)
        assert getattr(F, name) is getattr(mem, name)
        assert name in F.__all__ and name in ramstream.__all__


def test_stats_keys_and_types():
    s = stats()
    ints = [
        "bytes_pinned",
        "bytes_in_use",
        "bytes_requested",
        "bytes_cached",
        "peak_bytes_in_use",
        "bytes_registered",
        "fallback_allocations",
        "fallback_bytes_in_use",
        "pin_calls",
        "unpin_calls",
        "budget",
        "allocations",
        "reuse_hits",
        "slabs",
        "dedicated_blocks",
        "physical_memory",
    ]
    for k in ints:
        assert isinstance(s[k], int) and s[k] >= 0, k
    for k in ["fallback_reason", "budget_source", "budget_error"]:
        assert isinstance(s[k], str), k
    assert isinstance(s["pinning_available"], bool)
    assert s["bytes_cached"] == s["bytes_pinned"] - (s["bytes_in_use"] - s["fallback_bytes_in_use"])
    assert s["physical_memory"] > 0
    assert s["pinning_available"] == (lib().built_with_cuda() and lib().cuda_device_count() > 0)


# ---- tensors behave like CPU tensors ---------------------------------------------------------


@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=str)
def test_dtype_shape_and_arithmetic(dtype):
    gen = torch.Generator().manual_seed(1)
    shape = (7, 33)
    t = ramstream.pinned_empty(shape, dtype)
    assert t.shape == shape and t.dtype == dtype and t.device.type == "cpu"
    assert t.is_contiguous() and not t.requires_grad
    assert t.data_ptr() % 4096 == 0
    ref = random_like(shape, dtype, gen)
    t.copy_(ref)
    assert torch.equal(t, ref)
    if dtype == torch.bool:
        assert torch.equal(t & ~t, ref & ~ref)
    else:
        assert torch.equal(t * 3 + 1, ref * 3 + 1)
        assert torch.equal(t.sum(dim=1), ref.sum(dim=1))
        t.mul_(2)
        assert torch.equal(t, ref * 2)
    assert torch.equal(t.clone(), t)


def test_float_ops_match_torch():
    gen = torch.Generator().manual_seed(2)
    a = ramstream.pinned_empty((64, 48))
    b = ramstream.pinned_empty([48, 32])
    ra, rb = torch.randn(64, 48, generator=gen), torch.randn(48, 32, generator=gen)
    a.copy_(ra)
    b.copy_(rb)
    torch.testing.assert_close(a @ b, ra @ rb, rtol=0, atol=0)
    assert torch.equal(torch.nn.functional.gelu(a), torch.nn.functional.gelu(ra))
    assert torch.equal(a.view(-1)[5:100].clone(), ra.view(-1)[5:100])


@pytest.mark.parametrize("nbytes", BYTE_SIZES)
def test_sizes_write_read(nbytes):
    t = ramstream.pinned_empty(nbytes, torch.uint8)
    assert t.shape == (nbytes,)
    if nbytes:
        assert t.data_ptr() % 4096 == 0
    pattern = (torch.arange(nbytes, dtype=torch.int64) * 7 + 3).remainder(251).to(torch.uint8)
    t.copy_(pattern)
    assert torch.equal(t, pattern)


def test_live_blocks_do_not_overlap():
    sizes = [1, 4096, 4097, 5000, 9000, 70000, MiB + 1, 3 * MiB]
    blocks = []
    for i, n in enumerate(sizes * 3):
        t = ramstream.pinned_empty(n, torch.uint8)
        t.fill_(i % 256)
        blocks.append((i, t))
    spans = sorted((t.data_ptr(), t.data_ptr() + t.numel()) for _, t in blocks)
    for (_, end), (start, _) in zip(spans, spans[1:]):
        assert end <= start
    for i, t in blocks:
        assert bool((t == i % 256).all())


@pytest.mark.parametrize("shape", [5, (5,), [2, 3], torch.Size([2, 0, 4]), (), 0, [0]])
def test_shape_forms(shape):
    t = ramstream.pinned_empty(shape, torch.float16)
    want = (shape,) if isinstance(shape, int) else tuple(shape)
    assert tuple(t.shape) == want


@pytest.mark.parametrize("shape", [-1, (2, -3), "abc", (2.0,), None, (True,), 3.5])
def test_bad_shape(shape):
    with pytest.raises(ValueError, match="pinned_empty: shape"):
        ramstream.pinned_empty(shape)


@pytest.mark.parametrize("dtype", [torch.complex64, "float32", None, torch.float8_e4m3fn])
def test_bad_dtype(dtype):
    with pytest.raises(TypeError, match="float32, bfloat16, float16, uint8, int8.*int32"):
        ramstream.pinned_empty(4, dtype)


@pytest.mark.parametrize(
    "code,dtype",
    [(0, torch.float32), (1, torch.bfloat16), (2, torch.float16), (3, torch.uint8), (4, torch.int8)],
)
def test_binding_dtype_codes(code, dtype):
    """The raw binding takes the core's dtype codes (cpp/include/ramstream/dtype.h)."""
    t = lib().pinned_empty([3, 0, 2] if code == 4 else [3, 5], code)
    assert t.dtype == dtype and t.device.type == "cpu" and t.is_contiguous()
    assert tuple(t.shape) == ((3, 0, 2) if code == 4 else (3, 5))
    assert t._base is None


def test_binding_rejects_bad_arguments():
    with pytest.raises(ValueError, match="dtype_code must be 0..4"):
        lib().pinned_empty([4], 5)
    with pytest.raises(ValueError, match="non-negative"):
        lib().pinned_empty([4, -1], 0)
    with pytest.raises(ValueError, match="overflows"):
        lib().pinned_empty([1 << 40, 1 << 40], 0)
    with pytest.raises(ValueError, match="unsupported DLPack dtype"):
        lib().pinned_empty_dlpack([4], 5, 32)
    with pytest.raises(ValueError, match="unsupported DLPack dtype"):
        lib().pinned_empty_dlpack([4], 2, 12)
    with pytest.raises(ValueError, match="device must be >= -1"):
        lib().set_pin_device(-2)
    lib().set_pin_device(-1)  # the default: the runtime's current device


def test_absurd_size_is_memory_error():
    with pytest.raises(MemoryError, match="more than any host has"):
        ramstream.pinned_empty(1 << 52, torch.uint8)


def test_unsatisfiable_allocation_reports_arithmetic():
    try:
        with open("/proc/sys/vm/overcommit_memory") as f:
            if f.read().strip() == "1":
                pytest.skip("overcommit_memory=1: a 32 TiB malloc may succeed")
    except OSError:
        pass
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        with pytest.raises(MemoryError, match=r"failed too; arena in use .* budget .* physical RAM"):
            ramstream.pinned_empty(1 << 45, torch.uint8)


# ---- lifetime and bookkeeping ---------------------------------------------------------------


def test_block_returns_when_tensor_and_views_die():
    gc.collect()
    start = stats()
    t = ramstream.pinned_empty((1000,), torch.int32)
    v = t[10:20]
    s1 = stats()
    assert s1["bytes_in_use"] == start["bytes_in_use"] + 4096
    assert s1["bytes_requested"] == start["bytes_requested"] + 4000
    assert s1["allocations"] == start["allocations"] + 1
    del t
    gc.collect()
    assert stats()["bytes_in_use"] == s1["bytes_in_use"]  # the view keeps it alive
    v.fill_(5)
    del v
    gc.collect()
    assert stats()["bytes_in_use"] == start["bytes_in_use"]


def test_fallback_bookkeeping():
    if pinning():
        pytest.skip("pinned memory is available: see the cuda tests")
    gc.collect()
    ramstream.reset_peak_memory_stats()
    s0 = stats()
    assert s0["peak_bytes_in_use"] == s0["bytes_in_use"]
    a = ramstream.pinned_empty(3 * MiB + 5, torch.uint8)
    b = ramstream.pinned_empty((10, 10), torch.float32)
    s1 = stats()
    assert s1["fallback_allocations"] == s0["fallback_allocations"] + 2
    assert s1["allocations"] == s0["allocations"] + 2
    want = (3 * MiB + 4096) + 4096  # rounded up to 4096
    assert s1["fallback_bytes_in_use"] == s0["fallback_bytes_in_use"] + want
    assert s1["bytes_in_use"] == s0["bytes_in_use"] + want
    assert s1["peak_bytes_in_use"] == s1["bytes_in_use"]
    assert s1["bytes_pinned"] == 0 and s1["pin_calls"] == 0 and s1["reuse_hits"] == 0
    assert "CUDA" in s1["fallback_reason"]
    assert not lib().is_arena_pinned(a.data_ptr())
    assert not a.is_pinned()
    del a, b
    gc.collect()
    s2 = stats()
    assert s2["bytes_in_use"] == s0["bytes_in_use"]
    assert s2["fallback_bytes_in_use"] == s0["fallback_bytes_in_use"]
    assert s2["peak_bytes_in_use"] == s1["peak_bytes_in_use"]  # peak remembers
    ramstream.reset_peak_memory_stats()
    assert stats()["peak_bytes_in_use"] == s2["bytes_in_use"]
    ramstream.empty_cache()  # nothing pinned: a no-op, no error
    assert stats()["unpin_calls"] == s0["unpin_calls"]


def test_reuse_bookkeeping():
    """Allocate, free, allocate the same size: with a driver the second one is a reuse hit."""
    gc.collect()
    n = 2 * MiB + 777
    t = ramstream.pinned_empty(n, torch.uint8)
    ptr = t.data_ptr()
    del t
    s0 = stats()
    t = ramstream.pinned_empty(n, torch.uint8)
    s1 = stats()
    assert s1["allocations"] == s0["allocations"] + 1
    assert s1["pin_calls"] == s0["pin_calls"]
    if s1["pinning_available"]:
        assert s1["reuse_hits"] == s0["reuse_hits"] + 1
        assert t.data_ptr() == ptr
    else:
        assert s1["reuse_hits"] == s0["reuse_hits"]
        assert s1["fallback_allocations"] == s0["fallback_allocations"] + 1


def test_raw_alloc_free():
    gc.collect()
    s0 = stats()
    ptr, pinned = lib().arena_alloc(10000)
    assert ptr % 4096 == 0 and isinstance(pinned, bool)
    assert lib().is_arena_pinned(ptr) == pinned == s0["pinning_available"]
    assert stats()["bytes_in_use"] == s0["bytes_in_use"] + 12288
    lib().arena_free(ptr)
    assert stats()["bytes_in_use"] == s0["bytes_in_use"]
    with pytest.raises(ValueError, match="not allocated by the host arena or was already released"):
        lib().arena_free(ptr)
    with pytest.raises(ValueError, match="not allocated by the host arena"):
        lib().arena_free(12345)
    lib().arena_free(0)  # like free(NULL)


def test_no_warning_without_gpu():
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        t = ramstream.pinned_empty(100)
    assert t.numel() == 100


def test_fallback_warns_once_when_a_gpu_exists(monkeypatch, restore_budget):
    """Budget 0 forces a fallback everywhere; pretend torch sees a GPU where it does not."""
    monkeypatch.setattr(mem._State, "gpu", True)
    monkeypatch.setattr(mem._State, "fallback_warned", False)
    monkeypatch.setattr(mem._State, "device_set", True)  # no torch.cuda calls on a CPU machine
    ramstream.set_pin_budget(0)
    n = 48 * MiB + 1  # a dedicated-size block: set_pin_budget(0) unpinned the cached ones
    s0 = stats()
    with pytest.warns(RuntimeWarning, match="pinned host memory unavailable") as rec:
        t = ramstream.pinned_empty(n, torch.uint8)
    assert len([w for w in rec if issubclass(w.category, RuntimeWarning)]) == 1
    assert stats()["fallback_allocations"] == s0["fallback_allocations"] + 1
    if s0["pinning_available"]:
        assert "budget" in stats()["fallback_reason"]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        u = ramstream.pinned_empty(n, torch.uint8)  # counted, not warned again
    assert stats()["fallback_allocations"] == s0["fallback_allocations"] + 2
    del t, u


# ---- registration ----------------------------------------------------------------------------


def test_register_validation():
    with pytest.raises(TypeError, match="register_host_memory: expected a torch.Tensor"):
        ramstream.register_host_memory([1, 2, 3])
    with pytest.raises(ValueError, match="contiguous"):
        ramstream.register_host_memory(torch.zeros(8, 8).t())
    with pytest.raises(ValueError, match="no elements"):
        ramstream.register_host_memory(torch.zeros(0))
    with pytest.raises(ValueError, match="contiguous"):
        ramstream.unregister_host_memory(torch.zeros(8, 8)[:, 1])


def test_register_without_driver_is_runtime_error():
    if pinning():
        pytest.skip("a driver exists: see test_cuda_register")
    t = torch.zeros(1024)
    with pytest.raises(RuntimeError, match="register_memory: page-locking needs CUDA"):
        ramstream.register_host_memory(t)
    with pytest.raises(RuntimeError, match="unregister_memory: page-locking needs CUDA"):
        ramstream.unregister_host_memory(t)
    with pytest.raises(RuntimeError, match="device_pointer: mapped host memory needs CUDA"):
        lib().host_device_pointer(t.data_ptr())
    assert stats()["bytes_registered"] == 0


# ---- concurrency -----------------------------------------------------------------------------


def test_concurrent_alloc_free():
    gc.collect()
    s0 = stats()
    errors: list[str] = []
    n_threads, iters = 4, 150

    def work(seed: int) -> None:
        rng = random.Random(seed)
        held = []
        try:
            for i in range(iters):
                n = rng.choice([1, 100, 4096, 5000, 70000, 300000, 2 * MiB + 3])
                if rng.random() < 0.5:
                    t = ramstream.pinned_empty(n, torch.uint8)
                    t.fill_((seed * 31 + i) % 256)
                    held.append(((seed * 31 + i) % 256, t))
                else:
                    p, _ = lib().arena_alloc(n)
                    lib().arena_free(p)
                if len(held) > 6 or (held and rng.random() < 0.3):
                    v, t = held.pop(rng.randrange(len(held)))
                    if not bool((t == v).all()):
                        errors.append(f"thread {seed}: block overwritten")
            for v, t in held:
                if not bool((t == v).all()):
                    errors.append(f"thread {seed}: block overwritten")
        except Exception as e:  # pragma: no cover - reported below
            errors.append(repr(e))

    threads = [threading.Thread(target=work, args=(k,)) for k in range(n_threads)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    gc.collect()
    assert not errors
    s1 = stats()
    assert s1["bytes_in_use"] == s0["bytes_in_use"]
    assert s1["allocations"] == s0["allocations"] + n_threads * iters
