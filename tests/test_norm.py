"""Squared norms, gradient accumulation and float casts on the host: against float64 / torch
references, for every dtype, size and ISA; deterministic across ISAs and thread counts."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import ramstream.functional as F
from ramstream._native import lib

# isa, restore_isa and restore_threads are fixtures: pytest finds them here once imported
from _isa import isa, restore_isa, restore_threads, supported_isas  # noqa: F401

C = lib()
SIZES = [0, 1, 15, 16, 17, 31, 32, 33, 65536 + 31, 1000003]
DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def sample(n: int, dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed + n)
    x = torch.randn(n, generator=g) * torch.logspace(-3, 2, max(n, 1))[:n]
    return x.to(dtype)


def bits(t: torch.Tensor) -> np.ndarray:
    return t.contiguous().view(torch.int32 if t.dtype == torch.float32 else torch.int16).numpy()


# ---- sq_norm -----------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", SIZES)
def test_sq_norm_vs_float64(isa, dtype, n):
    x = sample(n, dtype)
    ref = (x.double() ** 2).sum().item()
    got = F.sq_norm(x)
    assert isinstance(got, float)
    assert got == pytest.approx(ref, rel=1e-12, abs=0.0)


def test_sq_norm_shapes_and_views():
    x = sample(3 * 1001, torch.float32).reshape(3, 1001)
    assert F.sq_norm(x) == pytest.approx((x.double() ** 2).sum().item(), rel=1e-12)
    t = x.t()  # non-contiguous: read through a copy
    assert F.sq_norm(t) == pytest.approx((t.double() ** 2).sum().item(), rel=1e-12)
    p = torch.nn.Parameter(x.clone())
    assert F.sq_norm(p) == pytest.approx((x.double() ** 2).sum().item(), rel=1e-12)


def test_sq_norm_specials():
    x = torch.tensor([1.0, float("inf"), 2.0])
    assert F.sq_norm(x) == float("inf")
    assert np.isnan(F.sq_norm(torch.tensor([1.0, float("nan")])))
    big = torch.full((4,), 3.0e38)  # squares overflow float32 but not the double accumulator
    assert F.sq_norm(big) == 4 * big[0].item() ** 2
    tiny = torch.full((5,), 1e-30)
    assert F.sq_norm(tiny) == pytest.approx(5 * tiny[0].item() ** 2, rel=1e-15)


@pytest.mark.parametrize("dtype", DTYPES)
def test_sq_norm_identical_across_isas_and_threads(restore_isa, restore_threads, dtype):
    x = sample(1000003, dtype, seed=5)
    results = set()
    for name in supported_isas():
        C.set_isa(name)
        for threads in (1, 2, 3):
            C.set_num_threads(threads)
            results.add(F.sq_norm(x))
    assert len(results) == 1, results


@pytest.mark.parametrize("dtype", DTYPES)
def test_sq_norm_ptr(dtype):
    x = sample(4099, dtype)
    code = {torch.float32: C.DTYPE_FLOAT32, torch.bfloat16: C.DTYPE_BFLOAT16, torch.float16: C.DTYPE_FLOAT16}[
        dtype
    ]
    assert C.sq_norm_ptr(x.data_ptr(), code, x.numel()) == F.sq_norm(x)
    assert C.sq_norm_ptr(x.data_ptr(), code, 0) == 0.0


# ---- accumulate_ -------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", SIZES)
def test_accumulate_vs_torch(isa, dtype, n):
    dst = sample(n, torch.float32, seed=1)
    src = sample(n, dtype, seed=2)
    ref = dst + src.float()
    F.accumulate_(dst, src)
    np.testing.assert_array_equal(bits(dst), bits(ref))


def test_accumulate_micro_batches_equal_summed_grads():
    grads = [sample(10007, torch.bfloat16, seed=s) for s in range(4)]
    acc = torch.zeros(10007)
    ref = torch.zeros(10007)
    for g in grads:
        F.accumulate_(acc, g)
        ref += g.float()
    np.testing.assert_array_equal(bits(acc), bits(ref))


def test_accumulate_shapes_and_ptr():
    dst = sample(600, torch.float32, seed=3).reshape(20, 30)
    src = (
        sample(600, torch.float16, seed=4).reshape(30, 20).t()
    )  # same numel, non-contiguous: read via a copy
    ref = dst.reshape(-1) + src.contiguous().reshape(-1).float()
    F.accumulate_(dst, src)
    np.testing.assert_array_equal(bits(dst.reshape(-1)), bits(ref))
    a = sample(777, torch.float32)
    b = sample(777, torch.bfloat16)
    ref = a + b.float()
    C.accumulate_ptr(a.data_ptr(), b.data_ptr(), C.DTYPE_BFLOAT16, 777)
    np.testing.assert_array_equal(bits(a), bits(ref))


# ---- cast_to_float_ (binding) -----------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", [0, 1, 15, 16, 17, 100003])
@pytest.mark.parametrize("scale", [1.0, 0.125, 3.3])
def test_cast_to_float(isa, dtype, n, scale):
    src = sample(n, dtype, seed=6)
    if n > 4 and dtype != torch.float32:
        src[:4] = torch.tensor([float("inf"), -float("inf"), 0.0, -0.0]).to(dtype)
    dst = torch.empty(n)
    C.cast_to_float_(dst, src, scale)
    ref = src.float() * torch.tensor(scale, dtype=torch.float32) if scale != 1.0 else src.float()
    np.testing.assert_array_equal(bits(dst), bits(ref))


def test_fp16_subnormals_and_nan_cast():
    # every fp16 bit pattern converts exactly (subnormals included); NaNs stay NaN
    allh = torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16).view(torch.float16)
    dst = torch.empty(allh.numel())
    C.cast_to_float_(dst, allh, 1.0)
    ref = allh.float()
    nan = torch.isnan(ref)
    assert torch.isnan(dst[nan]).all()
    np.testing.assert_array_equal(bits(dst[~nan]), bits(ref[~nan]))


# ---- bad input ---------------------------------------------------------------------------------


def test_bad_inputs():
    with pytest.raises(TypeError, match="tensor must be float32/bfloat16/float16"):
        F.sq_norm(torch.zeros(3, dtype=torch.float64))
    with pytest.raises(TypeError, match="tensor must be a torch.Tensor"):
        F.sq_norm([1.0, 2.0])
    with pytest.raises(ValueError, match="tensor must be a CPU tensor"):
        F.sq_norm(torch.zeros(3, device="meta"))
    with pytest.raises(TypeError, match="dst must be float32"):
        F.accumulate_(torch.zeros(3, dtype=torch.bfloat16), torch.zeros(3))
    with pytest.raises(TypeError, match="src must be float32/bfloat16/float16"):
        F.accumulate_(torch.zeros(3), torch.zeros(3, dtype=torch.int64))
    with pytest.raises(ValueError, match="src must have the same number of elements as dst"):
        F.accumulate_(torch.zeros(3), torch.zeros(4))
    with pytest.raises(ValueError, match="dst must be contiguous"):
        F.accumulate_(torch.zeros(4, 2)[:, 0], torch.zeros(4))
    with pytest.raises(ValueError, match="dst must be a CPU tensor"):
        F.accumulate_(torch.zeros(3, device="meta"), torch.zeros(3))
    # the compiled entry points check on their own
    with pytest.raises(TypeError, match="x: dtype must be"):
        C.sq_norm(torch.zeros(3, dtype=torch.int8))
    with pytest.raises(ValueError, match="x: must be contiguous"):
        C.sq_norm(torch.zeros(4, 2)[:, 0])
    with pytest.raises(ValueError, match="src: has 4 elements"):
        C.accumulate_(torch.zeros(3), torch.zeros(4))
    with pytest.raises(TypeError, match="dst"):
        C.cast_to_float_(torch.zeros(3, dtype=torch.float16), torch.zeros(3), 1.0)
    with pytest.raises(ValueError, match="dtype"):
        C.sq_norm_ptr(0, 9, 0)
    with pytest.raises(ValueError, match="n must be >= 0"):
        C.sq_norm_ptr(0, 0, -1)
    with pytest.raises(ValueError, match="src_dtype"):
        C.accumulate_ptr(0, 0, -1, 0)


# ---- CUDA dispatch (run by the lead on a GPU machine) ------------------------------------------


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", DTYPES)
def test_cuda_sq_norm_and_accumulate(dtype):
    x = sample(1000003, dtype, seed=9)
    assert F.sq_norm(x.cuda()) == pytest.approx(F.sq_norm(x), rel=1e-9)
    dst = sample(1000003, torch.float32, seed=10)
    dev = dst.cuda()
    F.accumulate_(dev, x.cuda())
    F.accumulate_(dst, x)
    np.testing.assert_array_equal(bits(dev.cpu()), bits(dst))
