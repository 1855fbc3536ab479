"""CUDA kernels (ramstream.ops.cuda): NF4/int8 dequantization and squared norms against the host
kernels, float64 and the spec references, and the argument checks and no-GPU behaviour of every
kernel (AdamW on the GPU: test_cuda_adamw.py). GPU tests are @pytest.mark.cuda; the argument checks
and the no-GPU behaviour run everywhere."""

from __future__ import annotations

import re

import numpy as np
import pytest
import torch

from ramstream._native import lib
from ramstream.ops import _checks
from ramstream.ops import cuda as rc

import _spec_reference as ref

# dev is a fixture: pytest finds it here once imported
from _cuda_helpers import (
    DTYPES,
    HYPER,
    _host,
    _same,
    dev,  # noqa: F401
)

# around the vector widths (8 NF4 / 16 int8 elements per unit, 4 AdamW elements) and a large odd one
SIZES = [1, 2, 3, 7, 8, 9, 15, 16, 17, 31, 33, 63, 64, 65, 127, 128, 129, 100_003]


def _gpu_usable() -> bool:
    c = lib()
    return bool(c.built_with_cuda()) and c.cuda_device_count() > 0 and torch.cuda.is_available()


# ---- everywhere: no GPU, argument checks ------------------------------------------------------
def test_without_gpu_every_function_raises_runtime_error():
    if _gpu_usable():
        pytest.skip("a GPU is usable here")
    reason = lib().cuda_unavailable_reason()
    assert reason
    calls = [
        lambda: rc.dequantize_nf4(torch.zeros(2, dtype=torch.uint8), torch.ones(1), (4,)),
        lambda: rc.dequantize_int8(torch.zeros(4, dtype=torch.int8), torch.ones(1), (4,)),
        lambda: rc.adamw_(torch.zeros(4), torch.zeros(4), torch.zeros(4), torch.zeros(4), step=1, lr=1e-3),
        lambda: rc.sq_norm(torch.zeros(4)),
    ]
    for call in calls:
        with pytest.raises(RuntimeError, match="CUDA is not usable") as e:
            call()
        assert reason in str(e.value)


def test_bindings_reject_host_tensors_before_any_cuda_call():
    c = lib()
    z = torch.zeros(8)
    kw = dict(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0, step=1)
    calls = {
        "packed": lambda: c.cuda_dequantize_nf4(torch.zeros(4, dtype=torch.uint8), torch.ones(1), z, 64),
        "codes": lambda: c.cuda_dequantize_int8(torch.zeros(8, dtype=torch.int8), torch.ones(1), z, 64),
        "grad": lambda: c.cuda_adamw_(z, z, z, z, None, **kw),  # param may be pinned host
        "x": lambda: c.cuda_sq_norm(z, torch.zeros(1, dtype=torch.float64)),
    }
    for arg, call in calls.items():
        if c.built_with_cuda():
            with pytest.raises(ValueError, match=f"{arg}: must be a CUDA tensor"):
                call()
        else:
            with pytest.raises(RuntimeError, match="no CUDA support"):
                call()


@pytest.mark.parametrize(
    "kw, exc, msg",
    [
        (dict(lr=float("nan")), ValueError, "adamw_: lr must be a finite float >= 0, got nan"),
        (dict(lr=-1.0), ValueError, "lr must be a finite float >= 0"),
        (dict(beta1=1.0), ValueError, "beta1 must be a finite float in [0, 1), got 1.0"),
        (dict(beta2=-0.1), ValueError, "beta2"),
        (dict(eps=0.0), ValueError, "eps must be a finite float > 0"),
        (dict(weight_decay=float("inf")), ValueError, "weight_decay"),
        (dict(grad_scale=1e39), ValueError, "grad_scale"),
        (dict(step=0), ValueError, "step must be an int in [1, 2**63), got 0"),
        (dict(step=1.5), TypeError, "step must be an int"),
        (dict(step=True), TypeError, "step must be an int in [1, 2**63), got True (bool)"),
        (dict(seed=-1), ValueError, "seed"),
        (dict(seed=2**64), ValueError, "seed"),
        (dict(offset=-3), ValueError, "offset"),
        (dict(lr="0.1"), TypeError, "lr must be a finite float >= 0, got '0.1' (str)"),
    ],
)
def test_adamw_hyper_parameters_validated_first(kw, exc, msg):
    args = dict(step=1, **HYPER)
    args.update(kw)
    z = torch.zeros(4)
    with pytest.raises(exc, match=re.escape(msg)):
        rc.adamw_(z, z, z, z, **args)


def test_adamw_tensor_checks_before_cuda():
    z = torch.zeros(4)
    with pytest.raises(TypeError, match="param must be float32"):
        rc.adamw_(z.double(), z, z, z, step=1, lr=1e-3)
    with pytest.raises(TypeError, match="exp_avg must be float32/bfloat16"):
        rc.adamw_(z, z, z.half(), z.half(), step=1, lr=1e-3)
    with pytest.raises(TypeError, match="exp_avg_sq must be bfloat16"):
        rc.adamw_(z, z, z.bfloat16(), z, step=1, lr=1e-3)
    with pytest.raises(ValueError, match="grad has 3 elements, param has 4"):
        rc.adamw_(z, z[:3], z, z, step=1, lr=1e-3)
    with pytest.raises(ValueError, match="exp_avg must be contiguous"):
        rc.adamw_(z, z, torch.zeros(8)[::2], z, step=1, lr=1e-3)


def test_dequant_checks_before_cuda():
    with pytest.raises(TypeError, match="packed must be uint8"):
        rc.dequantize_nf4(torch.zeros(2, dtype=torch.int8), torch.ones(1), (4,))
    with pytest.raises(ValueError, match="block_size must be an even int >= 2"):
        rc.dequantize_nf4(torch.zeros(2, dtype=torch.uint8), torch.ones(1), (4,), block_size=3)
    with pytest.raises(ValueError, match=r"packed has 2 elements, shape \(5,\) needs 3"):
        rc.dequantize_nf4(torch.zeros(2, dtype=torch.uint8), torch.ones(1), (5,))
    with pytest.raises(ValueError, match="absmax has 1 elements"):
        rc.dequantize_int8(torch.zeros(130, dtype=torch.int8), torch.ones(1), (130,))
    with pytest.raises(TypeError, match="dtype must be"):
        rc.dequantize_int8(torch.zeros(4, dtype=torch.int8), torch.ones(1), (4,), torch.int32)


def test_checks_helpers():
    assert _checks.check_float("f", "x", 2) == 2.0
    assert _checks.check_int("f", "n", np.int64(5), ge=0) == 5
    with pytest.raises(ValueError, match="f: x must be a finite float > 0, got 0.0"):
        _checks.check_float("f", "x", 0.0, gt=0)
    with pytest.raises(TypeError, match="f: x must be a float, got bool"):
        _checks.check_float("f", "x", True)
    hp = _checks.check_adamw_hyper("g", step=3, lr=1, beta1=0.5, beta2=0.5, eps=1, weight_decay=0)
    assert hp["lr"] == 1.0 and isinstance(hp["lr"], float) and hp["step"] == 3


# ---- GPU: dequantization ------------------------------------------------------------------
def _random_nf4(n: int, block: int, gen: torch.Generator):
    packed = torch.randint(0, 256, ((n + 1) // 2,), generator=gen, dtype=torch.int64).to(torch.uint8)
    absmax = torch.rand(-(-n // block), generator=gen) * 8.0
    absmax[::5] = 0.0  # all-zero blocks
    return packed, absmax


def _random_int8(n: int, block: int, gen: torch.Generator):
    codes = torch.randint(-127, 128, (n,), generator=gen, dtype=torch.int64).to(torch.int8)
    absmax = torch.rand(-(-n // block), generator=gen) * 8.0
    absmax[::5] = 0.0
    return codes, absmax


@pytest.mark.cuda
@pytest.mark.parametrize("block", [64, 128, 2, 6])
@pytest.mark.parametrize("n", SIZES)
def test_dequantize_nf4_matches_spec(dev, n, block):
    gen = torch.Generator().manual_seed(n * 1000 + block)
    packed, absmax = _random_nf4(n, block, gen)
    for dtype in DTYPES:
        got = rc.dequantize_nf4(packed.to(dev), absmax.to(dev), (n,), dtype, block)
        assert got.device == dev and got.dtype == dtype and got.shape == (n,)
        _same(got, ref.dequant_nf4(packed, absmax, n, block, dtype))


@pytest.mark.cuda
@pytest.mark.parametrize("block", [64, 128, 1, 3])
@pytest.mark.parametrize("n", SIZES)
def test_dequantize_int8_matches_spec(dev, n, block):
    gen = torch.Generator().manual_seed(n * 1000 + block)
    codes, absmax = _random_int8(n, block, gen)
    for dtype in DTYPES:
        got = rc.dequantize_int8(codes.to(dev), absmax.to(dev), (n,), dtype, block)
        _same(got, ref.dequant_int8(codes, absmax, n, block, dtype))


@pytest.mark.cuda
@pytest.mark.parametrize("block", [64, 128])
@pytest.mark.parametrize("n", [1, 7, 64, 65, 1000, 100_003])
def test_dequantize_bit_identical_to_host_kernels(dev, n, block):
    gen = torch.Generator().manual_seed(n + block)
    x = torch.randn(n, generator=gen) * 3.0
    packed, absmax = _host("quantize_nf4")(x, block_size=block)
    codes, absmax8 = _host("quantize_int8")(x, block_size=block)
    for dtype in DTYPES:
        host = _host("dequantize_nf4")(packed, absmax, (n,), dtype, block_size=block)
        _same(rc.dequantize_nf4(packed.to(dev), absmax.to(dev), (n,), dtype, block), host)
        host8 = _host("dequantize_int8")(codes, absmax8, (n,), dtype, block_size=block)
        _same(rc.dequantize_int8(codes.to(dev), absmax8.to(dev), (n,), dtype, block), host8)


@pytest.mark.cuda
@pytest.mark.parametrize("n", [5, 77, 4099])
def test_dequantize_misaligned_views_use_the_scalar_path(dev, n):
    gen = torch.Generator().manual_seed(n)
    block = 64
    packed, absmax = _random_nf4(n, block, gen)
    codes, absmax8 = _random_int8(n, block, gen)
    pbig = torch.zeros(packed.numel() + 1, dtype=torch.uint8, device=dev)
    pbig[1:] = packed.to(dev)
    cbig = torch.zeros(n + 1, dtype=torch.int8, device=dev)
    cbig[1:] = codes.to(dev)
    for dtype in DTYPES:
        # misaligned input (the wrapper allocates an aligned output)
        _same(
            rc.dequantize_nf4(pbig[1:], absmax.to(dev), (n,), dtype, block),
            ref.dequant_nf4(packed, absmax, n, block, dtype),
        )
        _same(
            rc.dequantize_int8(cbig[1:], absmax8.to(dev), (n,), dtype, block),
            ref.dequant_int8(codes, absmax8, n, block, dtype),
        )
        # misaligned output through the binding
        obig = torch.full((n + 1,), 7.0, dtype=dtype, device=dev)
        lib().cuda_dequantize_nf4(packed.to(dev), absmax.to(dev), obig[1:], block)
        torch.cuda.synchronize()
        _same(obig[1:], ref.dequant_nf4(packed, absmax, n, block, dtype))
        assert obig[0].item() == 7.0
        lib().cuda_dequantize_int8(codes.to(dev), absmax8.to(dev), obig[1:], block)
        torch.cuda.synchronize()
        _same(obig[1:], ref.dequant_int8(codes, absmax8, n, block, dtype))
        assert obig[0].item() == 7.0


@pytest.mark.cuda
def test_dequantize_inf_absmax_and_empty(dev):
    n, block = 256, 64
    gen = torch.Generator().manual_seed(3)
    packed, absmax = _random_nf4(n, block, gen)
    packed[0] = 0x7F  # a 0.0 code times inf -> NaN
    absmax[0] = float("inf")
    codes, absmax8 = _random_int8(n, block, gen)
    absmax8[1] = float("inf")
    for dtype in DTYPES:
        _same(
            rc.dequantize_nf4(packed.to(dev), absmax.to(dev), (n,), dtype, block),
            ref.dequant_nf4(packed, absmax, n, block, dtype),
        )
        _same(
            rc.dequantize_int8(codes.to(dev), absmax8.to(dev), (n,), dtype, block),
            ref.dequant_int8(codes, absmax8, n, block, dtype),
        )
        e = rc.dequantize_nf4(
            torch.empty(0, dtype=torch.uint8, device=dev), torch.empty(0, device=dev), (0, 3), dtype
        )
        assert e.shape == (0, 3) and e.dtype == dtype


@pytest.mark.cuda
def test_dequantize_shape_and_stream(dev):
    gen = torch.Generator().manual_seed(9)
    packed, absmax = _random_nf4(24 * 40, 64, gen)
    s = torch.cuda.Stream(dev)
    with torch.cuda.stream(s):
        p, a = packed.to(dev, non_blocking=False), absmax.to(dev)
        got = rc.dequantize_nf4(p, a, (24, 40), torch.float16, 64)
    s.synchronize()
    assert got.shape == (24, 40)
    _same(got.reshape(-1), ref.dequant_nf4(packed, absmax, 960, 64, torch.float16))


# ---- GPU: squared norm --------------------------------------------------------------------
@pytest.mark.cuda
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", [0, 1, 3, 4, 5, 7, 8, 9, 1_000_003])
def test_sq_norm_matches_float64(dev, dtype, n):
    gen = torch.Generator().manual_seed(n)
    x = (torch.randn(n + 1, generator=gen) * 3).to(dtype)
    xd = x.to(dev)
    for host, device in ((x[:n], xd[:n]), (x[1:], xd[1:])):  # aligned, misaligned
        want = host.double().pow(2).sum().item()
        assert rc.sq_norm(device) == pytest.approx(want, rel=1e-12, abs=0.0)


@pytest.mark.cuda
def test_sq_norm_non_contiguous_and_accumulate(dev):
    gen = torch.Generator().manual_seed(8)
    a = torch.randn(300, 7, generator=gen).to(dev)
    assert rc.sq_norm(a.t()) == pytest.approx(a.double().pow(2).sum().item(), rel=1e-12)
    b = torch.randn(999, generator=gen).to(dev).half()
    out = torch.full((1,), 123.0, dtype=torch.float64, device=dev)
    lib().cuda_sq_norm(a, out)  # zeroes first
    lib().cuda_sq_norm(b, out, accumulate=True)
    torch.cuda.synchronize()
    want = a.double().pow(2).sum().item() + b.double().pow(2).sum().item()
    assert out.item() == pytest.approx(want, rel=1e-12)
    with pytest.raises(TypeError, match="out: expected a 1-element float64"):
        lib().cuda_sq_norm(a, torch.zeros(1, device=dev))
