"""CUDA kernels (ramstream.ops.cuda): NF4/int8 dequantization, AdamW with device or pinned-host
moments, squared norms, against the host kernels, torch and the spec references. GPU tests are
@pytest.mark.cuda; the argument checks and the no-GPU behaviour run everywhere."""
from __future__ import annotations

import numpy as np
import pytest
import torch

import _spec_reference as ref
import ramstream.functional as F
from ramstream._native import lib
from ramstream.ops import _checks
from ramstream.ops import cuda as rc

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
# around the vector widths (8 NF4 / 16 int8 elements per unit, 4 AdamW elements) and a large odd one
SIZES = [1, 2, 3, 7, 8, 9, 15, 16, 17, 31, 33, 63, 64, 65, 127, 128, 129, 100_003]
HYPER = dict(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=1e-2)


def _gpu_usable() -> bool:
    c = lib()
    return bool(c.built_with_cuda()) and c.cuda_device_count() > 0 and torch.cuda.is_available()


def _host(name: str):
    """A host kernel from ramstream.functional (written by the quant / adamw areas)."""
    fn = getattr(F, name, None)
    if fn is None:
        pytest.fail(f"ramstream.functional.{name} is missing (it comes with the host kernels)")
    return fn


_BITS = {4: torch.int32, 2: torch.int16}


def _same(a: torch.Tensor, b: torch.Tensor) -> None:
    """Bit-identical, except that NaNs only have to sit at the same places (their payloads differ
    between CPU and GPU arithmetic)."""
    a, b = a.detach().cpu().reshape(-1), b.detach().cpu().reshape(-1)
    assert a.dtype == b.dtype and a.shape == b.shape, (a.dtype, b.dtype, a.shape, b.shape)
    nan = torch.isnan(a)
    assert torch.equal(nan, torch.isnan(b)), "NaNs at different places"
    bits = _BITS[a.element_size()]
    diff = torch.nonzero(a[~nan].view(bits) != b[~nan].view(bits))
    if diff.numel():
        i = diff[0].item()
        raise AssertionError(f"{diff.numel()} of {a.numel()} values differ; first at {i}: "
                             f"{a[~nan][i].item()!r} != {b[~nan][i].item()!r}")


@pytest.fixture
def dev():
    return torch.device("cuda", torch.cuda.current_device())


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
        (dict(beta1=1.0), ValueError, "beta1 must be a finite float >= 0 and < 1, got 1.0"),
        (dict(beta2=-0.1), ValueError, "beta2"),
        (dict(eps=0.0), ValueError, "eps must be a finite float > 0"),
        (dict(weight_decay=float("inf")), ValueError, "weight_decay"),
        (dict(grad_scale=1e39), ValueError, "grad_scale"),
        (dict(step=0), ValueError, "step must be an int >= 1"),
        (dict(step=1.5), TypeError, "step must be an int"),
        (dict(step=True), TypeError, "step must be an int, got bool"),
        (dict(seed=-1), ValueError, "seed"),
        (dict(seed=2**64), ValueError, "seed"),
        (dict(offset=-3), ValueError, "offset"),
        (dict(lr="0.1"), TypeError, "lr must be a float"),
    ],
)
def test_adamw_hyper_parameters_validated_first(kw, exc, msg):
    args = dict(step=1, **HYPER)
    args.update(kw)
    z = torch.zeros(4)
    with pytest.raises(exc, match=msg.replace("(", r"\(")):
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
        _same(rc.dequantize_nf4(pbig[1:], absmax.to(dev), (n,), dtype, block),
              ref.dequant_nf4(packed, absmax, n, block, dtype))
        _same(rc.dequantize_int8(cbig[1:], absmax8.to(dev), (n,), dtype, block),
              ref.dequant_int8(codes, absmax8, n, block, dtype))
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
        _same(rc.dequantize_nf4(packed.to(dev), absmax.to(dev), (n,), dtype, block),
              ref.dequant_nf4(packed, absmax, n, block, dtype))
        _same(rc.dequantize_int8(codes.to(dev), absmax8.to(dev), (n,), dtype, block),
              ref.dequant_int8(codes, absmax8, n, block, dtype))
        e = rc.dequantize_nf4(torch.empty(0, dtype=torch.uint8, device=dev),
                              torch.empty(0, device=dev), (0, 3), dtype)
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


# ---- GPU: AdamW ---------------------------------------------------------------------------
def _moments(n: int, dtype, where: str, dev, gen=None, zeros=False):
    if zeros:
        m, v = torch.zeros(n), torch.zeros(n)
    else:
        m = torch.randn(n, generator=gen) * 0.1
        v = torch.rand(n, generator=gen) * 0.01
    m, v = m.to(dtype), v.to(dtype)
    if where == "pinned":
        pm, pv = torch.empty(n, dtype=dtype, pin_memory=True), torch.empty(n, dtype=dtype, pin_memory=True)
        pm.copy_(m)
        pv.copy_(v)
        assert pm.is_pinned() and pv.is_pinned()
        return pm, pv
    return m.to(dev), v.to(dev)


@pytest.mark.cuda
@pytest.mark.parametrize("where", ["pinned", "device"])
def test_adamw_fp32_matches_torch_adamw_after_20_steps(dev, where):
    n = 10_007
    gen = torch.Generator().manual_seed(0)
    p0 = torch.randn(n, generator=gen)
    grads = [torch.randn(n, generator=gen) for _ in range(20)]
    ref_p = p0.to(dev).requires_grad_(True)
    opt = torch.optim.AdamW([ref_p], lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2,
                            foreach=False)
    p = torch.nn.Parameter(p0.to(dev))  # requires_grad: the wrapper must cope
    m, v = _moments(n, torch.float32, where, dev, zeros=True)
    for step, g in enumerate(grads, 1):
        ref_p.grad = g.to(dev)
        opt.step()
        rc.adamw_(p, g.to(dev), m, v, step=step, **HYPER)
    torch.cuda.synchronize()
    st = opt.state[ref_p]
    assert (p.detach() - ref_p.detach()).abs().max().item() <= 1e-6
    assert (m.to(dev) - st["exp_avg"]).abs().max().item() <= 1e-6
    assert (v.to(dev) - st["exp_avg_sq"]).abs().max().item() <= 1e-6


ADAMW_CASES = [
    dict(step=1, **HYPER),
    dict(step=7, lr=3e-2, beta1=0.3, beta2=0.95, eps=1e-6, weight_decay=0.0, grad_scale=0.37),
    dict(step=2, lr=1e-2, beta1=0.0, beta2=0.5, eps=1e-3, weight_decay=0.5, grad_scale=2.0),
]


@pytest.mark.cuda
@pytest.mark.parametrize("case", ADAMW_CASES)
@pytest.mark.parametrize("n", [1, 3, 4, 5, 16, 17, 1023, 4099])
def test_adamw_fp32_bit_identical_to_spec(dev, n, case):
    gen = torch.Generator().manual_seed(n)
    p, g = torch.randn(n, generator=gen), torch.randn(n, generator=gen)
    m, v = _moments(n, torch.float32, "device", "cpu", gen)
    want = ref.adamw_step(p.numpy(), g.numpy(), m.numpy(), v.numpy(), **case)
    dp, dm, dv = (t.to(dev, copy=True) for t in (p, m, v))
    rc.adamw_(dp, g.to(dev), dm, dv, **case)
    for got, exp in zip((dp, dm, dv), want):
        _same(got, torch.from_numpy(exp))


def _run(dev, n, p, g, m, v, out=None, **kw):
    """adamw_ on device copies; returns (param, exp_avg, exp_avg_sq) on the CPU."""
    dp, dm, dv = (t.to(dev, copy=True) for t in (p, m, v))
    rc.adamw_(dp, g.to(dev), dm, dv, out=out, **kw)
    return dp.cpu(), dm.cpu(), dv.cpu()


@pytest.mark.cuda
@pytest.mark.parametrize("n", [1, 5, 16, 4099, 65_536])
def test_adamw_bf16_moments_are_fp32_update_plus_stochastic_rounding(dev, n):
    gen = torch.Generator().manual_seed(n)
    p, g = torch.randn(n, generator=gen), torch.randn(n, generator=gen)
    m, v = _moments(n, torch.bfloat16, "device", "cpu", gen)
    kw = dict(step=3, seed=2**40 + 17, offset=123, **HYPER)
    p16, m16, v16 = _run(dev, n, p, g, m, v, **kw)
    p32, m32, v32 = _run(dev, n, p, g, m.float(), v.float(), **kw)
    _same(p16, p32)  # the update uses the unrounded moments
    idx = torch.arange(n) + 123
    _same(m16, ref.bf16_sr(m32, ref.sr_bits(kw["seed"], 3, idx, 0)))
    _same(v16, ref.bf16_sr(v32, ref.sr_bits(kw["seed"], 3, idx, 1)))


@pytest.mark.cuda
@pytest.mark.parametrize("moment_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n", [16, 4096, 4099, 100_003])
def test_adamw_bit_identical_to_host_kernel(dev, n, moment_dtype):
    """Equal to ramstream.functional.adamw_ on the host except in its scalar tail (the last
    n % 16 elements, where the host follows torch's double-precision tail)."""
    host_adamw = _host("adamw_")
    gen = torch.Generator().manual_seed(n)
    p, g = torch.randn(n, generator=gen), torch.randn(n, generator=gen).to(torch.bfloat16)
    m, v = _moments(n, moment_dtype, "device", "cpu", gen)
    kw = dict(step=5, seed=99, **HYPER)
    hp, hm, hv, hout = p.clone(), m.clone(), v.clone(), torch.empty(n, dtype=torch.bfloat16)
    host_adamw(hp, g, hm, hv, out=hout, **kw)
    dout = torch.empty(n, dtype=torch.bfloat16, device=dev)
    gp, gm, gv = _run(dev, n, p, g, m, v, out=dout, **kw)
    body = n - n % 16
    for got, want in zip((gp, gm, gv, dout.cpu()), (hp, hm, hv, hout)):
        _same(got[:body], want[:body])
        torch.testing.assert_close(got[body:].float(), want[body:].float(), rtol=1e-2, atol=1e-6)


@pytest.mark.cuda
@pytest.mark.parametrize("moment_dtype", [torch.float32, torch.bfloat16])
def test_adamw_pinned_moments_equal_device_moments(dev, moment_dtype):
    n = 100_003
    gen = torch.Generator().manual_seed(1)
    p, g = torch.randn(n, generator=gen), torch.randn(n, generator=gen)
    m, v = _moments(n, moment_dtype, "device", "cpu", gen)
    kw = dict(seed=5, **HYPER)
    dp, dm, dv = (t.to(dev, copy=True) for t in (p, m, v))
    pp = p.to(dev, copy=True)
    pm, pv = _moments(n, moment_dtype, "pinned", dev)
    pm.copy_(m)
    pv.copy_(v)
    for step in range(1, 4):
        gd = (g * step).to(dev)
        rc.adamw_(dp, gd, dm, dv, step=step, **kw)
        rc.adamw_(pp, gd, pm, pv, step=step, **kw)
    torch.cuda.synchronize()
    _same(pp, dp)
    _same(pm, dm)
    _same(pv, dv)
    assert not torch.equal(pm.float(), m.float())  # the pinned state really was written


@pytest.mark.cuda
@pytest.mark.parametrize("out_dtype", DTYPES)
def test_adamw_out_is_rounded_new_param(dev, out_dtype):
    n = 4099
    gen = torch.Generator().manual_seed(2)
    p, g = torch.randn(n, generator=gen) * 100, torch.randn(n, generator=gen)
    m, v = _moments(n, torch.float32, "pinned", dev, gen)
    dp = p.to(dev)
    out = torch.empty(n, dtype=out_dtype, device=dev)
    rc.adamw_(dp, g.to(dev), m, v, step=1, out=out, **HYPER)
    _same(out, dp.to(out_dtype))


@pytest.mark.cuda
@pytest.mark.parametrize("grad_dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("moment_dtype", [torch.float32, torch.bfloat16])
def test_adamw_low_precision_grads_equal_their_float32_values(dev, grad_dtype, moment_dtype):
    n = 1029
    gen = torch.Generator().manual_seed(3)
    p = torch.randn(n, generator=gen)
    g = torch.randn(n, generator=gen).to(grad_dtype)
    m, v = _moments(n, moment_dtype, "device", "cpu", gen)
    kw = dict(step=2, seed=1, grad_scale=0.5, **HYPER)
    for a, b in zip(_run(dev, n, p, g, m, v, **kw), _run(dev, n, p, g.float(), m, v, **kw)):
        _same(a, b)


@pytest.mark.cuda
def test_adamw_grad_scale_equals_prescaled_grad(dev):
    n = 2051
    gen = torch.Generator().manual_seed(4)
    p, g = torch.randn(n, generator=gen), torch.randn(n, generator=gen)
    m, v = _moments(n, torch.float32, "device", "cpu", gen)
    scaled = _run(dev, n, p, g, m, v, step=4, grad_scale=0.37, **HYPER)
    pre = _run(dev, n, p, (g.to(dev) * 0.37).cpu(), m, v, step=4, **HYPER)
    for a, b in zip(scaled, pre):
        _same(a, b)


@pytest.mark.cuda
def test_adamw_shards_with_offset_equal_the_whole(dev):
    n, cut = 10_000, 4_444
    gen = torch.Generator().manual_seed(5)
    p, g = torch.randn(n, generator=gen), torch.randn(n, generator=gen)
    m, v = _moments(n, torch.bfloat16, "device", "cpu", gen)
    kw = dict(step=9, seed=77, **HYPER)
    whole = _run(dev, n, p, g, m, v, **kw)
    first = _run(dev, cut, p[:cut], g[:cut], m[:cut], v[:cut], offset=0, **kw)
    second = _run(dev, n - cut, p[cut:], g[cut:], m[cut:], v[cut:], offset=cut, **kw)
    for w, a, b in zip(whole, first, second):
        _same(w, torch.cat([a, b]))
    other_seed = _run(dev, n, p, g, m, v, **{**kw, "seed": 78})
    assert not torch.equal(other_seed[1], whole[1])


@pytest.mark.cuda
@pytest.mark.parametrize("moment_dtype", [torch.float32, torch.bfloat16])
def test_adamw_misaligned_views_use_the_scalar_path(dev, moment_dtype):
    n = 1001
    gen = torch.Generator().manual_seed(6)
    p, g = torch.randn(n, generator=gen), torch.randn(n, generator=gen)
    m, v = _moments(n, moment_dtype, "device", "cpu", gen)
    kw = dict(step=2, seed=3, **HYPER)
    want = _run(dev, n, p, g, m, v, **kw)

    def shifted(t):
        big = torch.zeros(t.numel() + 1, dtype=t.dtype, device=dev)
        big[1:] = t.to(dev)
        return big[1:]

    dp, dm, dv = shifted(p), shifted(m), shifted(v)
    pm, pv = _moments(n + 1, moment_dtype, "pinned", dev)
    pm, pv = pm[1:], pv[1:]
    pm.copy_(m)
    pv.copy_(v)
    dp2 = shifted(p)
    rc.adamw_(dp, shifted(g), dm, dv, **kw)
    rc.adamw_(dp2, shifted(g), pm, pv, **kw)
    torch.cuda.synchronize()
    for got in ((dp, dm, dv), (dp2, pm, pv)):
        for a, b in zip(got, want):
            _same(a, b)


@pytest.mark.cuda
def test_adamw_bad_inputs(dev):
    n = 64
    p, g = torch.zeros(n, device=dev), torch.zeros(n, device=dev)
    m, v = torch.zeros(n, device=dev), torch.zeros(n, device=dev)
    unpinned = torch.zeros(n)
    assert not unpinned.is_pinned()
    with pytest.raises(ValueError, match="exp_avg: host tensor is not pinned"):
        rc.adamw_(p, g, unpinned, v, step=1, lr=1e-3)
    with pytest.raises(ValueError, match="exp_avg_sq: host tensor is not pinned"):
        rc.adamw_(p, g, m, torch.zeros(n), step=1, lr=1e-3)
    with pytest.raises(ValueError, match="param: host tensor is not pinned"):
        rc.adamw_(torch.zeros(n), g, m, v, step=1, lr=1e-3)
    with pytest.raises(ValueError, match="grad must be a CUDA tensor"):
        rc.adamw_(p, torch.zeros(n), m, v, step=1, lr=1e-3)
    with pytest.raises(ValueError, match="out must be a CUDA tensor"):
        rc.adamw_(p, g, m, v, step=1, lr=1e-3, out=torch.zeros(n))
    # the binding checks on its own too
    with pytest.raises(ValueError, match="exp_avg: host tensor is not pinned"):
        lib().cuda_adamw_(p, g, unpinned, v, None, lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8,
                          weight_decay=0.0, step=1)
    with pytest.raises(ValueError, match="param: host tensor is not pinned"):
        lib().cuda_adamw_(torch.zeros(n), g, m, v, None, lr=1e-3, beta1=0.9, beta2=0.999,
                          eps=1e-8, weight_decay=0.0, step=1)
    with pytest.raises(ValueError, match="exp_avg_sq: has 63 elements"):
        lib().cuda_adamw_(p, g, m, v[:63], None, lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8,
                          weight_decay=0.0, step=1)
    with pytest.raises(ValueError, match="lr must be a finite float"):
        lib().cuda_adamw_(p, g, m, v, None, lr=float("nan"), beta1=0.9, beta2=0.999, eps=1e-8,
                          weight_decay=0.0, step=1)
    with pytest.raises(TypeError, match="exp_avg_sq: expected dtype bfloat16"):
        lib().cuda_adamw_(p, g, m.bfloat16(), v, None, lr=1e-3, beta1=0.9, beta2=0.999,
                          eps=1e-8, weight_decay=0.0, step=1)
    # nothing was modified by the failed calls
    assert torch.count_nonzero(p).item() == 0 and torch.count_nonzero(m).item() == 0


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
