"""CUDA AdamW (ramstream.ops.cuda.adamw_) with device or pinned-host moments, against torch, the
spec reference and the host kernel; offsets, misaligned views, bad input. @pytest.mark.cuda."""

from __future__ import annotations

import pytest
import torch

from ramstream._native import lib
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
    opt = torch.optim.AdamW([ref_p], lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2, foreach=False)
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
        lib().cuda_adamw_(
            p, g, unpinned, v, None, lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0, step=1
        )
    with pytest.raises(ValueError, match="param: host tensor is not pinned"):
        lib().cuda_adamw_(
            torch.zeros(n), g, m, v, None, lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0, step=1
        )
    with pytest.raises(ValueError, match="exp_avg_sq: has 63 elements"):
        lib().cuda_adamw_(
            p, g, m, v[:63], None, lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0, step=1
        )
    with pytest.raises(ValueError, match="lr must be a finite float"):
        lib().cuda_adamw_(
            p, g, m, v, None, lr=float("nan"), beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0, step=1
        )
    with pytest.raises(TypeError, match="exp_avg_sq: expected dtype bfloat16"):
        lib().cuda_adamw_(
            p, g, m.bfloat16(), v, None, lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0, step=1
        )
    # nothing was modified by the failed calls
    assert torch.count_nonzero(p).item() == 0 and torch.count_nonzero(m).item() == 0
