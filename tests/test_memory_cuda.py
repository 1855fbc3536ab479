"""Tests of the pinned host arena on a GPU: pinned tensors, reuse without new pin calls,
empty_cache, budget exhaustion, bit-exact copies (large ones against torch's pinned
memory), registration. Bandwidth is measured in bench/bench_copy.py, not asserted here."""

from __future__ import annotations

import gc

import pytest
import torch

import ramstream
from ramstream._native import lib
from ramstream.ops import memory as mem

# restore_budget is a fixture: pytest finds it here once imported
from _memory_helpers import (
    ALL_DTYPES,
    MiB,
    restore_budget,  # noqa: F401
    stats,
)

# ---- GPU (run by the lead: pytest -m cuda) -----------------------------------------------------


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=str)
def test_cuda_pinned_empty_is_pinned(dtype):
    t = ramstream.pinned_empty((129, 5), dtype)
    assert stats()["pinning_available"]
    assert t.is_pinned()
    assert lib().is_arena_pinned(t.data_ptr())
    big = ramstream.pinned_empty(20 * MiB + 1, torch.uint8)  # a dedicated block
    assert big.is_pinned() and lib().is_arena_pinned(big.data_ptr())
    assert lib().host_device_pointer(t.data_ptr()) != 0


@pytest.mark.cuda
@pytest.mark.parametrize("nbytes", [5000, 3 * MiB + 123, 40 * MiB + 7])
def test_cuda_reuse_without_new_pin_calls(nbytes):
    t = ramstream.pinned_empty(nbytes, torch.uint8)
    ptr = t.data_ptr()
    del t
    s0 = stats()
    for _ in range(3):
        t = ramstream.pinned_empty(nbytes, torch.uint8)
        assert t.is_pinned() and t.data_ptr() == ptr
        del t
    s1 = stats()
    assert s1["pin_calls"] == s0["pin_calls"]
    assert s1["reuse_hits"] == s0["reuse_hits"] + 3
    assert s1["fallback_allocations"] == s0["fallback_allocations"]
    assert s1["bytes_pinned"] == s0["bytes_pinned"]


@pytest.mark.cuda
def test_cuda_empty_cache_unpins():
    t = ramstream.pinned_empty(40 * MiB, torch.uint8)  # dedicated block
    del t
    s0 = stats()
    assert s0["bytes_cached"] >= 40 * MiB
    ramstream.empty_cache()
    s1 = stats()
    assert s1["unpin_calls"] > s0["unpin_calls"]
    assert s1["bytes_pinned"] <= s0["bytes_pinned"] - 40 * MiB
    assert s1["bytes_cached"] == s1["bytes_pinned"] - (s1["bytes_in_use"] - s1["fallback_bytes_in_use"])


@pytest.mark.cuda
def test_cuda_budget_exhaustion_falls_back(restore_budget, monkeypatch):
    gc.collect()
    ramstream.empty_cache()
    s0 = stats()
    if s0["bytes_pinned"] != 0:
        pytest.skip("pinned blocks still in use elsewhere in the process")
    ramstream.set_pin_budget(s0["bytes_registered"] + 6 * MiB)
    monkeypatch.setattr(mem._State, "fallback_warned", False)
    a = ramstream.pinned_empty(5 * MiB, torch.uint8)  # a 6 MiB slab: the whole headroom
    assert a.is_pinned()
    s1 = stats()
    assert s1["pin_calls"] == s0["pin_calls"] + 1 and s1["bytes_pinned"] == 6 * MiB
    with pytest.warns(RuntimeWarning, match="budget"):
        b = ramstream.pinned_empty(5 * MiB, torch.uint8)
    assert not b.is_pinned()
    s2 = stats()
    assert s2["fallback_allocations"] == s1["fallback_allocations"] + 1
    assert s2["fallback_bytes_in_use"] == s1["fallback_bytes_in_use"] + 5 * MiB
    assert "budget" in s2["fallback_reason"]
    assert s2["bytes_pinned"] + s2["bytes_registered"] <= s2["budget"]
    b.fill_(7)  # still a working tensor
    assert torch.equal(b.cuda().cpu(), b)
    big = torch.empty(8 * MiB, dtype=torch.uint8)
    with pytest.raises(MemoryError, match="page-lock budget"):
        ramstream.register_host_memory(big)
    del a, b


@pytest.mark.cuda
@pytest.mark.parametrize(
    "dtype", [torch.float32, torch.bfloat16, torch.float16, torch.uint8, torch.int8, torch.int32], ids=str
)
@pytest.mark.parametrize("numel", [0, 1, 1023, 1025, 777_777, 12 * MiB + 3])
def test_cuda_copies_bit_exact(dtype, numel):
    src = ramstream.pinned_empty(numel, dtype)
    src.view(torch.uint8).copy_(torch.randint(0, 256, (numel * dtype.itemsize,), dtype=torch.uint8))
    dev = src.to("cuda", non_blocking=True)
    back = ramstream.pinned_empty(numel, dtype)
    back.copy_(dev, non_blocking=True)
    torch.cuda.synchronize()
    assert torch.equal(back.view(torch.uint8), src.view(torch.uint8))
    assert torch.equal(dev.cpu().view(torch.uint8), src.view(torch.uint8))


@pytest.mark.cuda
def test_cuda_register(restore_budget):
    t = torch.arange(MiB, dtype=torch.float32)
    assert not t.is_pinned()
    s0 = stats()
    ramstream.register_host_memory(t)
    try:
        assert t.is_pinned()
        assert lib().is_arena_pinned(t.data_ptr())
        assert stats()["bytes_registered"] == s0["bytes_registered"] + 4 * MiB
        assert lib().host_device_pointer(t.data_ptr()) != 0
        with pytest.raises(ValueError, match="overlaps"):
            ramstream.register_host_memory(t)
        d = t.to("cuda", non_blocking=True)
        torch.cuda.synchronize()
        assert torch.equal(d.cpu(), t)
    finally:
        ramstream.unregister_host_memory(t)
    assert not t.is_pinned()
    assert stats()["bytes_registered"] == s0["bytes_registered"]
    with pytest.raises(ValueError, match="not the start of memory registered"):
        ramstream.unregister_host_memory(t)


@pytest.mark.cuda
@pytest.mark.parametrize("chunks", [1, 3])
def test_cuda_large_copies_match_torch_pinned(chunks):
    """A 256 MiB arena buffer crosses PCIe (whole, or in unaligned chunks on two streams) with the
    same bytes as torch's own pinned buffer. The bandwidth ratio against torch's pinned memory is
    a benchmark, not a test: bench/bench_copy.py::test_copy_bandwidth_arena_vs_torch_pinned."""
    n = 256 * MiB + 13
    arena = ramstream.pinned_empty(n, torch.uint8)
    assert arena.is_pinned() and lib().is_arena_pinned(arena.data_ptr())
    ref = torch.empty(n, dtype=torch.uint8, pin_memory=True)
    ref.copy_(torch.randint(0, 256, (n,), dtype=torch.uint8, generator=torch.Generator().manual_seed(1)))
    arena.copy_(ref)
    from_arena = torch.empty(n, dtype=torch.uint8, device="cuda")
    from_ref = torch.empty(n, dtype=torch.uint8, device="cuda")
    streams = [torch.cuda.Stream(), torch.cuda.Stream()]
    bounds = [n * k // chunks for k in range(chunks + 1)]
    for k in range(chunks):
        a, b = bounds[k], bounds[k + 1]
        with torch.cuda.stream(streams[k % 2]):
            from_arena[a:b].copy_(arena[a:b], non_blocking=True)
    from_ref.copy_(ref, non_blocking=True)
    torch.cuda.synchronize()
    assert torch.equal(from_arena, from_ref)
    back = ramstream.pinned_empty(n, torch.uint8)
    back.zero_()
    for k in range(chunks):
        a, b = bounds[k], bounds[k + 1]
        with torch.cuda.stream(streams[k % 2]):
            back[a:b].copy_(from_arena[a:b], non_blocking=True)
    torch.cuda.synchronize()
    assert torch.equal(back, ref)
