"""Tests of the pinned host arena: tensors, reuse, budget, fallback bookkeeping, registration, GPU copies."""
from __future__ import annotations

import gc
import json
import os
import random
import subprocess
import sys
import threading
import warnings

import pytest
import torch

import ramstream
from ramstream import functional as F
from ramstream._native import lib
from ramstream.ops import memory as mem

MiB = 1 << 20
ALL_DTYPES = [
    torch.float32, torch.bfloat16, torch.float16, torch.uint8, torch.int8,
    torch.int16, torch.int32, torch.int64, torch.float64, torch.bool,
]
# 0, 1, around the 4 KiB minimum block, between size classes, around the 16 MiB slab-block
# limit (larger blocks are dedicated allocations), a large odd size.
BYTE_SIZES = [0, 1, 4095, 4096, 4097, 5000, 12289, MiB + 1, 16 * MiB - 1, 16 * MiB + 1, 40 * MiB + 3]


def stats() -> dict:
    return ramstream.memory_stats()


def pinning() -> bool:
    return bool(stats()["pinning_available"])


def random_like(shape, dtype, gen) -> torch.Tensor:
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=gen).bool()
    if dtype.is_floating_point:
        return torch.randn(shape, generator=gen).to(dtype)
    info = torch.iinfo(dtype)
    return torch.randint(max(info.min, -1000), min(info.max, 1000), shape, generator=gen).to(dtype)


@pytest.fixture
def restore_budget():
    before = ramstream.pin_budget()
    yield before
    ramstream.set_pin_budget(before)


# ---- API surface -------------------------------------------------------------------------------


def test_exports():
    for name in ["pinned_empty", "memory_stats", "set_pin_budget", "pin_budget", "empty_cache",
                 "reset_peak_memory_stats", "register_host_memory", "unregister_host_memory"]:
        assert getattr(ramstream, name) is getattr(mem, name)
        assert getattr(F, name) is getattr(mem, name)
        assert name in F.__all__ and name in ramstream.__all__


def test_stats_keys_and_types():
    s = stats()
    ints = ["bytes_pinned", "bytes_in_use", "bytes_requested", "bytes_cached", "peak_bytes_in_use",
            "bytes_registered", "fallback_allocations", "fallback_bytes_in_use", "pin_calls",
            "unpin_calls", "budget", "allocations", "reuse_hits", "slabs", "dedicated_blocks",
            "physical_memory"]
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


@pytest.mark.parametrize("code,dtype", [(0, torch.float32), (1, torch.bfloat16), (2, torch.float16),
                                        (3, torch.uint8), (4, torch.int8)])
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


# ---- budget ----------------------------------------------------------------------------------


def test_set_pin_budget_forms(restore_budget):
    ram = stats()["physical_memory"]
    assert ramstream.set_pin_budget(123456789) == 123456789
    assert ramstream.pin_budget() == 123456789 == stats()["budget"]
    assert stats()["budget_source"] == "set_budget"
    assert ramstream.set_pin_budget(0.25) == int(ram * 0.25) == ramstream.pin_budget()
    for text, want in [("1M", MiB), ("512k", 512 * 1024), ("1.5G", 3 << 29), ("64MiB", 64 * MiB),
                       (" 2 gb ", 2 << 30), ("1T", 1 << 40), ("4096", 4096), ("100%", ram),
                       ("50%", ram * 50 // 100), ("0", 0)]:
        assert ramstream.set_pin_budget(text) == want, text
        assert ramstream.pin_budget() == want, text


@pytest.mark.parametrize("bad,exc", [(-1, ValueError), (1.5, ValueError), (float("nan"), ValueError),
                                     ("abc", ValueError), ("", ValueError), ("-1G", ValueError),
                                     ("1X", ValueError), ("101%", ValueError), ("1e9", ValueError),
                                     (True, TypeError), (None, TypeError), ([1], TypeError)])
def test_set_pin_budget_bad(bad, exc, restore_budget):
    with pytest.raises(exc, match="set_pin_budget|cannot parse"):
        ramstream.set_pin_budget(bad)
    assert ramstream.pin_budget() == restore_budget


def test_allocation_works_with_zero_budget(restore_budget):
    ramstream.set_pin_budget(0)
    gen = torch.Generator().manual_seed(3)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        t = ramstream.pinned_empty((300, 7), torch.bfloat16)
    ref = random_like((300, 7), torch.bfloat16, gen)
    t.copy_(ref)
    assert torch.equal(t + 1, ref + 1)
    s = stats()
    assert s["bytes_pinned"] + s["bytes_registered"] <= max(s["budget"], s["bytes_pinned"])


def _run_with_env(value: str | None) -> subprocess.Popen:
    code = (
        "import json, warnings\n"
        "warnings.simplefilter('always')\n"
        "with warnings.catch_warnings(record=True) as w:\n"
        "    import ramstream\n"
        "    s = ramstream.memory_stats()\n"
        "print(json.dumps({'budget': s['budget'], 'source': s['budget_source'],\n"
        "                  'error': s['budget_error'], 'ram': s['physical_memory'],\n"
        "                  'warnings': [str(x.message) for x in w\n"
        "                               if issubclass(x.category, RuntimeWarning)]}))\n"
    )
    env = dict(os.environ)
    env.pop("RAMSTREAM_PIN_BUDGET", None)
    if value is not None:
        env["RAMSTREAM_PIN_BUDGET"] = value
    return subprocess.Popen([sys.executable, "-c", code], env=env, cwd="/",
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def test_budget_from_env():
    cases = {"1M": None, "50%": None, "lots": None, None: None, "3.5g": None}
    procs = {k: _run_with_env(k) for k in cases}
    out = {}
    for k, p in procs.items():
        so, se = p.communicate(timeout=120)
        assert p.returncode == 0, se
        out[k] = json.loads(so.strip().splitlines()[-1])
    ram = out[None]["ram"]
    default = int(ram * 0.5)
    assert out[None]["budget"] == default and out[None]["error"] == "" and not out[None]["warnings"]
    assert out["1M"]["budget"] == MiB and out["1M"]["source"] == "RAMSTREAM_PIN_BUDGET=1M"
    assert out["3.5g"]["budget"] == 7 << 29
    assert out["50%"]["budget"] == ram * 50 // 100 and out["50%"]["error"] == ""
    bad = out["lots"]
    assert bad["budget"] == default  # reported, not fatal
    assert "RAMSTREAM_PIN_BUDGET" in bad["error"] and "'lots'" in bad["error"]
    assert len(bad["warnings"]) == 1 and "lots" in bad["warnings"][0]


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
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.uint8,
                                   torch.int8, torch.int32], ids=str)
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


def _median_copy_seconds(dst, src, reps: int = 7) -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    for _ in range(2):
        dst.copy_(src, non_blocking=True)
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start.record()
        dst.copy_(src, non_blocking=True)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return sorted(times)[len(times) // 2]


@pytest.mark.cuda
def test_cuda_bandwidth_matches_torch_pinned():
    n = 256 * MiB
    arena = ramstream.pinned_empty(n, torch.uint8)
    ref = torch.empty(n, dtype=torch.uint8, pin_memory=True)
    arena.fill_(1)
    ref.fill_(1)
    gpu = torch.empty(n, dtype=torch.uint8, device="cuda")
    h2d_arena = n / _median_copy_seconds(gpu, arena)
    h2d_ref = n / _median_copy_seconds(gpu, ref)
    d2h_arena = n / _median_copy_seconds(arena, gpu)
    d2h_ref = n / _median_copy_seconds(ref, gpu)
    msg = (f"H2D {h2d_arena / 1e9:.1f} vs {h2d_ref / 1e9:.1f} GB/s, "
           f"D2H {d2h_arena / 1e9:.1f} vs {d2h_ref / 1e9:.1f} GB/s")
    print(msg)
    assert h2d_arena >= 0.9 * h2d_ref, msg
    assert d2h_arena >= 0.9 * d2h_ref, msg
