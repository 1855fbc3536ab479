"""Host AdamW: bit-exact against torch's fused CPU AdamW, every ISA and thread count, mixed precision,
stochastic rounding of bf16 moments (docs/NUMERICS.md rule 2), the low-precision `out` copy, bad input."""
from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest
import torch

import ramstream.functional as F
from ramstream._native import lib

# isa, restore_isa and restore_threads are fixtures: pytest finds them here once imported
from _isa import isa, restore_isa, restore_threads, supported_isas  # noqa: F401

C = lib()
STEPS = 20


def bits(t: torch.Tensor) -> np.ndarray:
    t = t.detach().contiguous().cpu()
    view = {torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float16: torch.int16}[t.dtype]
    return t.view(view).numpy().copy()


def assert_bits_equal(a: torch.Tensor, b: torch.Tensor, what: str = "") -> None:
    ba, bb = bits(a), bits(b)
    bad = np.flatnonzero(ba != bb)
    assert bad.size == 0, f"{what}: {bad.size} of {ba.size} differ, first at {bad[:5]}: {a.flatten()[bad[:3]]} vs {b.flatten()[bad[:3]]}"


def lr_at(s: int) -> float:
    """A schedule that changes every step (warm-up then decay)."""
    return 1e-3 * min(1.0, (s + 1) / 5) / (1 + 0.05 * s)


def make_problem(n: int, seed: int, steps: int = STEPS):
    g = torch.Generator().manual_seed(seed)
    p0 = torch.randn(n, generator=g)
    # gradients spanning several orders of magnitude, so rounding differences would show
    scales = torch.logspace(-4, 1, max(n, 1))[:n]
    grads = [torch.randn(n, generator=g) * scales for _ in range(steps)]
    return p0, grads


def torch_adamw(p0, grads, *, beta1=0.9, beta2=0.999, eps=1e-8, wd=1e-2, lr_fn=lr_at, **impl):
    p = torch.nn.Parameter(p0.clone())
    opt = torch.optim.AdamW([p], lr=lr_fn(0), betas=(beta1, beta2), eps=eps, weight_decay=wd, **impl)
    for s, gr in enumerate(grads):
        opt.param_groups[0]["lr"] = lr_fn(s)
        p.grad = gr.clone()
        opt.step()
    st = opt.state[p]
    return p.detach(), st["exp_avg"], st["exp_avg_sq"]


def ours(p0, grads, *, beta1=0.9, beta2=0.999, eps=1e-8, wd=1e-2, lr_fn=lr_at, moment_dtype=torch.float32,
         grad_dtype=None, grad_scale=1.0, seed=0):
    p = p0.clone()
    m = torch.zeros(p0.numel(), dtype=moment_dtype)
    v = torch.zeros(p0.numel(), dtype=moment_dtype)
    for s, gr in enumerate(grads):
        if grad_dtype is not None:
            gr = gr.to(grad_dtype)
        F.adamw_(p, gr, m, v, step=s + 1, lr=lr_fn(s), beta1=beta1, beta2=beta2, eps=eps, weight_decay=wd,
                 grad_scale=grad_scale, seed=seed)
    return p, m, v


SIZES = [0, 1, 7, 8, 9, 15, 16, 17, 31, 33, 1000003]


# ---- fp32: bit-identical to torch.optim.AdamW(fused=True) -----------------------------------------

@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("wd", [0.0, 1e-2])
def test_bit_identical_to_torch_fused(n, wd):
    p0, grads = make_problem(n, seed=n + 1)
    ref = torch_adamw(p0, grads, wd=wd, fused=True)
    got = ours(p0, grads, wd=wd)
    for name, a, b in zip(("param", "exp_avg", "exp_avg_sq"), got, ref):
        assert_bits_equal(a, b, f"n={n} wd={wd} {name}")


@pytest.mark.parametrize("n", [1, 15, 16, 17, 100003])
def test_bit_identical_every_isa(isa, n):
    p0, grads = make_problem(n, seed=7 * n)
    ref = torch_adamw(p0, grads, fused=True)
    got = ours(p0, grads)
    for name, a, b in zip(("param", "exp_avg", "exp_avg_sq"), got, ref):
        assert_bits_equal(a, b, f"{isa} n={n} {name}")


@pytest.mark.parametrize("beta1,beta2,wd", [(0.5, 0.999, 0.05), (0.3, 0.95, 0.1), (0.0, 0.9, 0.3), (0.95, 0.0, 0.0)])
@pytest.mark.parametrize("n", [13, 1041])
def test_bit_identical_betas(beta1, beta2, wd, n):
    """1 - beta1 >= 0.5 takes torch's other lerp form; beta2 = 0 is allowed too."""
    p0, grads = make_problem(n, seed=n)
    ref = torch_adamw(p0, grads, beta1=beta1, beta2=beta2, wd=wd, eps=1e-6, fused=True)
    got = ours(p0, grads, beta1=beta1, beta2=beta2, wd=wd, eps=1e-6)
    for name, a, b in zip(("param", "exp_avg", "exp_avg_sq"), got, ref):
        assert_bits_equal(a, b, f"beta1={beta1} {name}")


@pytest.mark.parametrize("n", [1, 17, 100003])
def test_close_to_torch_for_loop(n):
    p0, grads = make_problem(n, seed=3)
    ref = torch_adamw(p0, grads, foreach=False)
    got = ours(p0, grads)
    assert (got[0] - ref[0]).abs().max().item() <= 1e-6
    torch.testing.assert_close(got[1], ref[1], rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(got[2], ref[2], rtol=1e-5, atol=1e-9)


@pytest.mark.parametrize("grad_dtype", [torch.bfloat16, torch.float16])
def test_low_precision_grads_match_torch_fed_float(grad_dtype):
    n = 4099
    p0, grads = make_problem(n, seed=11)
    grads = [g.to(grad_dtype) for g in grads]
    ref = torch_adamw(p0, [g.float() for g in grads], fused=True)
    got = ours(p0, grads)
    for name, a, b in zip(("param", "exp_avg", "exp_avg_sq"), got, ref):
        assert_bits_equal(a, b, f"{grad_dtype} {name}")


@pytest.mark.parametrize("scale", [0.37, 2.0, 1.0])
def test_grad_scale_matches_premultiplied_grad(scale):
    n = 2053
    p0, grads = make_problem(n, seed=5)
    ref = torch_adamw(p0, [g * torch.tensor(scale, dtype=torch.float32) for g in grads], fused=True)
    got = ours(p0, grads, grad_scale=scale)
    for name, a, b in zip(("param", "exp_avg", "exp_avg_sq"), got, ref):
        assert_bits_equal(a, b, f"scale={scale} {name}")


def test_thread_count_independent(restore_threads):
    n = 300007  # several 32K-element chunks, odd tail
    p0, grads = make_problem(n, seed=9, steps=3)
    results = []
    for threads in (1, 2, 3):
        C.set_num_threads(threads)
        assert C.num_threads() == threads
        results.append(ours(p0, grads, moment_dtype=torch.bfloat16, grad_dtype=torch.bfloat16, seed=4))
        results.append(ours(p0, grads))
    for k in (2, 4):
        for a, b in zip(results[k], results[0]):
            assert_bits_equal(a, b, "bf16 state, threads")
        for a, b in zip(results[k + 1], results[1]):
            assert_bits_equal(a, b, "fp32 state, threads")


@pytest.mark.parametrize("grad_dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("moment_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("out_dtype", [None, torch.float32, torch.bfloat16, torch.float16])
def test_every_isa_identical_mixed(restore_isa, grad_dtype, moment_dtype, out_dtype):
    n = 1000 + 37
    p0, grads = make_problem(n, seed=21, steps=4)
    runs = []
    for name in supported_isas():
        C.set_isa(name)
        p = p0.clone()
        m = torch.zeros(n, dtype=moment_dtype)
        v = torch.zeros(n, dtype=moment_dtype)
        out = None if out_dtype is None else torch.empty(n, dtype=out_dtype)
        for s, g in enumerate(grads):
            F.adamw_(p, g.to(grad_dtype), m, v, step=s + 1, lr=lr_at(s), grad_scale=0.5, out=out, seed=99)
        runs.append((name, [p, m, v] + ([] if out is None else [out])))
    for name, tensors in runs[1:]:
        for a, b in zip(tensors, runs[0][1]):
            assert_bits_equal(a, b, f"{name} vs {runs[0][0]}")


# ---- out: the new weight in low precision, written in the same pass ----------------------------------

def _bf16_rne_reference(x: torch.Tensor) -> np.ndarray:
    """docs/NUMERICS.md rule 1 in numpy."""
    u = x.numpy().view(np.uint32).astype(np.uint64)
    r = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16) & 0xFFFF
    nan = np.isnan(x.numpy())
    r[nan] = ((u[nan] >> 16) & 0x8000) | 0x7FC0
    return r.astype(np.uint16).view(np.int16)


@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_out_equals_param_cast(isa, out_dtype):
    n = 5003
    p0, grads = make_problem(n, seed=13, steps=2)
    special = torch.tensor([float("inf"), -float("inf"), 3.0e38, -7.0e4, 65519.0, 65520.0, 1e-40, -1e-45,
                            6.0e-8, 2.9e-8, 0.0, -0.0, 1.0 + 2**-8, 1.0 + 3 * 2**-8, 1.00048828125])
    p0[: special.numel()] = special
    p = p0.clone()
    m, v = torch.zeros(n), torch.zeros(n)
    out = torch.empty(n, dtype=out_dtype)
    for s, g in enumerate(grads):
        g = g.clone()
        g[: special.numel()] = 0.0
        F.adamw_(p, g, m, v, step=s + 1, lr=1e-3, weight_decay=0.0, out=out)
        assert_bits_equal(out, p.to(out_dtype), f"{isa} out {out_dtype}")


def test_out_random_bit_patterns(isa):
    """Every exponent range (fp16 subnormals, overflow, NaN payloads): lr = 0 and g = 0 leave the
    weights as they are, so `out` must be the rule-1 / IEEE cast of arbitrary float bit patterns."""
    rng = np.random.default_rng(0)
    n = 1 << 16
    u = rng.integers(0, 2**32, size=n, dtype=np.uint64).astype(np.uint32)
    # half of them with exponents around fp16's subnormal, normal and overflow thresholds
    expo = rng.integers(98, 146, size=n // 2, dtype=np.uint32)
    u[: n // 2] = (u[: n // 2] & np.uint32(0x807FFFFF)) | (expo << np.uint32(23))
    p = torch.from_numpy(u.view(np.int32).copy()).view(torch.float32)
    zero = torch.zeros(n)
    for dt in (torch.bfloat16, torch.float16, torch.float32):
        q = p.clone()
        out = torch.empty(n, dtype=dt)
        F.adamw_(q, zero, torch.zeros(n), torch.zeros(n), step=1, lr=0.0, weight_decay=0.0, out=out)
        nan = torch.isnan(q)
        if dt == torch.bfloat16:
            np.testing.assert_array_equal(bits(out), _bf16_rne_reference(q))
        else:
            assert torch.isnan(out[nan]).all()
            assert_bits_equal(out[~nan], q[~nan].to(dt), f"{isa} {dt}")
            if dt == torch.float16:  # F16C's NaN: sign | 0x7E00 | payload >> 13
                want = ((u[nan.numpy()] >> 16) & 0x8000) | 0x7E00 | ((u[nan.numpy()] >> 13) & 0x3FF)
                np.testing.assert_array_equal(bits(out[nan]).view(np.uint16), want.astype(np.uint16))


def test_out_nan_rule(isa):
    n = 40
    p = torch.randn(n)
    p[3] = float("nan")
    p[20] = -float("nan")
    m, v = torch.zeros(n), torch.zeros(n)
    g = torch.randn(n)
    outs = {dt: torch.empty(n, dtype=dt) for dt in (torch.bfloat16, torch.float16)}
    for dt, out in outs.items():
        q = p.clone()
        F.adamw_(q, g, m.clone(), v.clone(), step=1, lr=1e-3, out=out)
        assert torch.isnan(out[[3, 20]]).all()
        if dt == torch.bfloat16:
            np.testing.assert_array_equal(bits(out), _bf16_rne_reference(q))
        else:
            ok = ~torch.isnan(q)
            assert_bits_equal(out[ok], q[ok].to(dt), "fp16 non-NaN")


# ---- bf16 moments: stochastic rounding ---------------------------------------------------------------

def _sr_bits_reference(seed: int, step: int, index: np.ndarray, moment: int) -> np.ndarray:
    """docs/NUMERICS.md rule 2 in numpy (uint32 arithmetic mod 2^32)."""
    M = 0xFFFFFFFF
    idx = index.astype(np.uint64)
    lo = (idx & M).astype(np.uint64)
    hi = (idx >> np.uint64(32)).astype(np.uint64)
    const = ((seed & M) * 0xC2B2AE3D + (seed >> 32) * 0x27D4EB2F + (step & M) * 0x165667B1 + moment * 0xD3A2646C) & M
    k = (lo * np.uint64(0x9E3779B1) + hi * np.uint64(0x85EBCA77) + np.uint64(const)) & np.uint64(M)
    k ^= k >> np.uint64(16)
    k = (k * np.uint64(0x7FEB352D)) & np.uint64(M)
    k ^= k >> np.uint64(15)
    k = (k * np.uint64(0x846CA68B)) & np.uint64(M)
    k ^= k >> np.uint64(16)
    return (k & np.uint64(0xFFFF)).astype(np.uint32)


def test_sr_bits_match_spec():
    idx = np.array([0, 1, 2, 15, 16, 12345, 2**32 - 1, 2**32, 2**32 + 7, 2**40 + 3], dtype=np.uint64)
    for seed in (0, 1, 0xDEADBEEF, 2**63 + 12345):
        for step in (1, 2, 1000):
            for moment in (0, 1):
                ref = _sr_bits_reference(seed, step, idx, moment)
                got = [C.sr_bits(seed, step, int(i), moment) for i in idx]
                np.testing.assert_array_equal(np.array(got, dtype=np.uint32), ref)


@pytest.mark.parametrize("offset", [0, 5, 2**32 - 20])
def test_sr_moments_follow_spec(isa, offset):
    """beta1 = beta2 = 0 make the new moments g and g*g exactly (inf/NaN in v: the special case of
    rule 2): check the stored bf16 bits bit for bit against a numpy model of the spec."""
    n = 1000 + 3
    g = torch.randn(n) * 3
    g[5] = float("inf")
    g[6] = float("nan")
    p = torch.randn(n)
    m = torch.zeros(n, dtype=torch.bfloat16)
    v = torch.zeros(n, dtype=torch.bfloat16)
    seed, step = 123456789012, 3
    C.adamw_ptr(p.data_ptr(), g.data_ptr(), C.DTYPE_FLOAT32, m.data_ptr(), v.data_ptr(), C.DTYPE_BFLOAT16, 0,
                C.DTYPE_BFLOAT16, n, offset, 1e-3, 0.0, 0.0, 1e-8, 0.0, step, 1.0, seed)
    index = np.arange(n, dtype=np.uint64) + np.uint64(offset)
    for moment, (state, exact) in enumerate(((m, g), (v, g * g))):
        u = exact.numpy().view(np.uint32).astype(np.uint64)
        r = _sr_bits_reference(seed, step, index, moment).astype(np.uint64)
        want = ((u + r) >> np.uint64(16)) & np.uint64(0xFFFF)
        special = (u & 0x7F800000) == 0x7F800000
        want[special] = (u[special] >> np.uint64(16)) | np.where((u[special] & 0x7FFFFF) != 0, np.uint64(0x40), np.uint64(0))
        got = bits(state).view(np.uint16)
        keep = np.ones(n, dtype=bool)
        if moment == 0:  # m = fma(0, g - m, g): inf and NaN gradients give NaN (0 * inf)
            keep[[5, 6]] = False
            assert torch.isnan(state[[5, 6]].float()).all()
        np.testing.assert_array_equal(got[keep], want.astype(np.uint16)[keep], err_msg=f"moment {moment}")


def test_sr_unbiased():
    """Many independent roundings of one value average to the value."""
    n = 200000
    x = 1.0 + 2**-9 + 2**-12  # between the bf16 neighbours 1.0 and 1.0078125, 0.28 of the way up
    p = torch.zeros(n)
    g = torch.full((n,), x)
    m = torch.zeros(n, dtype=torch.bfloat16)
    v = torch.zeros(n, dtype=torch.bfloat16)
    F.adamw_(p, g, m, v, step=1, lr=0.0, beta1=0.0, beta2=0.0, weight_decay=0.0, seed=17)
    lo, hi = 1.0, 1.0 + 2**-7
    vals = m.float()
    assert set(torch.unique(vals).tolist()) == {lo, hi}
    spacing = hi - lo
    assert abs(vals.double().mean().item() - x) < 0.01 * spacing
    # exp_avg_sq holds x*x rounded the same way
    xx = float(np.float32(x) * np.float32(x))
    sq = v.float().double()
    assert abs(sq.mean().item() - xx) < 0.01 * 2**-6
    # the two moments use different random streams
    assert not torch.equal((vals == hi), (v.float() > xx))


def test_sr_deterministic_per_seed():
    n = 10007
    p0, grads = make_problem(n, seed=1, steps=3)
    a = ours(p0, grads, moment_dtype=torch.bfloat16, seed=1)
    b = ours(p0, grads, moment_dtype=torch.bfloat16, seed=1)
    c = ours(p0, grads, moment_dtype=torch.bfloat16, seed=2)
    for x, y in zip(a, b):
        assert_bits_equal(x, y, "same seed")
    assert (bits(a[1]) != bits(c[1])).sum() > n // 10
    assert (bits(a[2]) != bits(c[2])).sum() > n // 10


def test_bf16_moments_track_fp32():
    n, steps = 4096, 200
    g = torch.Generator().manual_seed(0)
    p32 = torch.randn(n, generator=g)
    p16 = p32.clone()
    m32, v32 = torch.zeros(n), torch.zeros(n)
    m16, v16 = torch.zeros(n, dtype=torch.bfloat16), torch.zeros(n, dtype=torch.bfloat16)
    base = torch.randn(n, generator=g) * 0.1
    for s in range(steps):
        grad = base + 0.05 * torch.randn(n, generator=g)
        F.adamw_(p32, grad, m32, v32, step=s + 1, lr=1e-3)
        F.adamw_(p16, grad, m16, v16, step=s + 1, lr=1e-3, seed=5)
    rel = ((v16.float() - v32).abs() / v32.abs().clamp_min(1e-30)).mean().item()
    assert rel < 0.03
    rel_m = ((m16.float() - m32).abs().sum() / m32.abs().sum()).item()
    assert rel_m < 0.03
    assert (p16 - p32).abs().max().item() < 1e-2


# ---- offsets and the raw-pointer entry point -------------------------------------------------------

def test_split_calls_with_offsets_equal_one_call():
    """The engine may update a tensor in pieces cut at multiples of 16: the result is the same."""
    n, cut = 5000 + 5, 2048
    p0, grads = make_problem(n, seed=31, steps=3)
    whole = [p0.clone(), torch.zeros(n, dtype=torch.bfloat16), torch.zeros(n, dtype=torch.bfloat16),
             torch.empty(n, dtype=torch.float16)]
    parts = [t.clone() for t in whole]
    for s, g in enumerate(grads):
        gb = g.to(torch.bfloat16)
        F.adamw_(whole[0], gb, whole[1], whole[2], step=s + 1, lr=lr_at(s), out=whole[3], seed=8)
        for lo, hi in ((0, cut), (cut, n)):
            p, m, v, o = (t[lo:hi] for t in parts)
            C.adamw_(p, gb[lo:hi], m, v, o, lr=lr_at(s), beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=1e-2,
                     step=s + 1, grad_scale=1.0, seed=8, offset=lo)
    for a, b in zip(parts, whole):
        assert_bits_equal(a, b, "split")


def test_adamw_ptr_equals_tensor_api():
    n = 3001
    p0, grads = make_problem(n, seed=2, steps=2)
    a = [p0.clone(), torch.zeros(n), torch.zeros(n), torch.empty(n, dtype=torch.bfloat16)]
    b = [t.clone() for t in a]
    for s, g in enumerate(grads):
        gh = g.half()
        F.adamw_(a[0], gh, a[1], a[2], step=s + 1, lr=2e-3, weight_decay=0.1, grad_scale=0.25, out=a[3])
        C.adamw_ptr(b[0].data_ptr(), gh.data_ptr(), C.DTYPE_FLOAT16, b[1].data_ptr(), b[2].data_ptr(),
                    C.DTYPE_FLOAT32, b[3].data_ptr(), C.DTYPE_BFLOAT16, n, 0, 2e-3, 0.9, 0.999, 1e-8, 0.1,
                    s + 1, 0.25, 0)
    for x, y in zip(a, b):
        assert_bits_equal(x, y, "ptr")
    assert (C.DTYPE_FLOAT32, C.DTYPE_BFLOAT16, C.DTYPE_FLOAT16) == (0, 1, 2)


# ---- large calls: non-temporal stores of `out`, `out` over `grad`, the AVX512-BF16 path ----------------

BIG = (1 << 18) + 16 * 37 + 5  # from 2**18 elements on, `out` gets non-temporal stores


def _big_run(out_dtype, placement, steps=2):
    """AdamW over BIG elements, bf16 moments, grads in out_dtype; `out` separate ("aligned"), at an
    address 3 elements past an aligned one ("unaligned"), or the grad buffer itself ("grad")."""
    n = BIG
    p0, grads = make_problem(n, seed=41, steps=steps)
    p = p0.clone()
    m = torch.zeros(n, dtype=torch.bfloat16)
    v = torch.zeros(n, dtype=torch.bfloat16)
    out = {"aligned": torch.empty(n, dtype=out_dtype),
           "unaligned": torch.empty(n + 40, dtype=out_dtype)[3:3 + n],
           "grad": None}[placement]
    for s, g in enumerate(grads):
        g = g.to(out_dtype)
        o = g if placement == "grad" else out
        F.adamw_(p, g, m, v, step=s + 1, lr=lr_at(s), grad_scale=0.5, out=o, seed=17)
    return [p, m, v, o]


@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_large_out_placements_identical(isa, restore_threads, out_dtype):
    """Streaming `out` from its first 64-byte aligned element, ordinary stores when it is the grad
    buffer: the same bits for every placement and thread count, equal to the scalar kernel's."""
    C.set_num_threads(3)
    runs = {pl: _big_run(out_dtype, pl) for pl in ("aligned", "unaligned", "grad")}
    C.set_num_threads(1)
    runs["1 thread"] = _big_run(out_dtype, "unaligned")
    prev = C.active_isa()
    C.set_isa("scalar")
    try:
        ref = _big_run(out_dtype, "aligned")
    finally:
        C.set_isa(prev)
    for name, tensors in runs.items():
        for what, a, b in zip(("param", "exp_avg", "exp_avg_sq", "out"), tensors, ref):
            assert_bits_equal(a, b, f"{isa} {out_dtype} {name} {what}")
    p, out = ref[0], ref[3]
    if out_dtype == torch.bfloat16:
        np.testing.assert_array_equal(bits(out), _bf16_rne_reference(p))
    else:
        assert_bits_equal(out, p.to(out_dtype), "out is the cast of param")


@pytest.mark.parametrize("offset", [2**32 - 1024, 2**32 - 1008])
def test_large_out_across_index_word_boundary(isa, restore_threads, offset):
    """A streamed `out` when the random-stream index crosses 2**32 inside a task: the vector that
    straddles it takes the element update, and (with the first offset: `out` starts 5 elements
    past a 64-byte line, an even number of vectors before the straddling one) the next vector
    realigns `out` to whole lines. The scalar kernel's bits either way."""
    n = BIG
    p0, grads = make_problem(n, seed=43, steps=1)
    g = grads[0].to(torch.bfloat16)

    def run():
        p = p0.clone()
        m = torch.zeros(n, dtype=torch.bfloat16)
        v = torch.zeros(n, dtype=torch.bfloat16)
        out = torch.empty(n + 40, dtype=torch.bfloat16)[5:5 + n]
        C.adamw_(p, g, m, v, out, lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=1e-2,
                 step=1, grad_scale=1.0, seed=5, offset=offset)
        return [p, m, v, out]

    C.set_num_threads(2)
    got = run()
    prev = C.active_isa()
    C.set_isa("scalar")
    try:
        ref = run()
    finally:
        C.set_isa(prev)
    for what, a, b in zip(("param", "exp_avg", "exp_avg_sq", "out"), got, ref):
        assert_bits_equal(a, b, f"{isa} {what}")


def test_sr_nan_payloads_stay_nan(isa):
    """NaN moments whose payload would carry into the sign under `bits + r` keep rule 2's NaN case,
    wherever they fall in the vector loop."""
    n = 1000 + 3
    g = torch.randn(n)
    nan_at = [0, 17, 31, 32, 500, 999, 1001]
    payloads = np.array([0x7FFFFFFF, 0xFFFFFFFF, 0x7FC0FFFF, 0xFF80FFFF, 0x7FFFFF00, 0xFFC0FFFF, 0x7F80FFFF],
                        dtype=np.uint32)
    g.numpy().view(np.uint32)[nan_at] = payloads
    p = torch.randn(n)
    m = torch.zeros(n, dtype=torch.bfloat16)
    v = torch.zeros(n, dtype=torch.bfloat16)
    out = torch.empty(n, dtype=torch.bfloat16)
    F.adamw_(p, g, m, v, step=1, lr=1e-3, beta1=0.0, beta2=0.0, weight_decay=0.0, out=out, seed=3)
    for name, t in (("exp_avg", m), ("exp_avg_sq", v), ("out", out), ("param", p)):
        assert torch.isnan(t[nan_at].float()).all(), name
        ok = torch.ones(n, dtype=torch.bool)
        ok[nan_at] = False
        assert not torch.isnan(t[ok].float()).any(), name


_BF16_SWITCH_SCRIPT = """
import hashlib, numpy as np, torch
import ramstream._C as C, ramstream.functional as F
def run():
    n = (1 << 18) + 77
    rng = np.random.default_rng(5)
    u = rng.integers(0, 2**32, size=n, dtype=np.uint64).astype(np.uint32)
    p = torch.from_numpy(u.view(np.int32).copy()).view(torch.float32)  # NaN payloads, subnormals
    m, v = torch.zeros(n, dtype=torch.bfloat16), torch.zeros(n, dtype=torch.bfloat16)
    out1 = torch.empty(n, dtype=torch.bfloat16)
    F.adamw_(p, torch.zeros(n, dtype=torch.bfloat16), m, v, step=1, lr=0.0, weight_decay=0.0, out=out1)
    q = torch.from_numpy(rng.standard_normal(n).astype(np.float32))
    g = torch.from_numpy(rng.standard_normal(n).astype(np.float32)).to(torch.bfloat16)
    out2 = torch.empty(n, dtype=torch.bfloat16)
    F.adamw_(q, g, m, v, step=2, lr=1e-3, out=out2, seed=9)
    return [t.view(torch.int16 if t.dtype != torch.float32 else torch.int32).numpy().tobytes()
            for t in (p, m, v, out1, q, out2)]
fast = run()
C.set_isa("scalar")
same = fast == run()
print(C.best_isa(), same, hashlib.sha256(b"".join(fast)).hexdigest())
"""


def test_avx512_bf16_conversion_switch():
    """The AVX-512 kernel converts bf16 `out` with vcvtne2ps2bf16 where the CPU has AVX512-BF16
    (NaN and subnormal weights take the integer rule instead); RAMSTREAM_AVX512BF16=0 turns it off.
    Both give the scalar kernel's bits."""
    if C.best_isa() != "avx512":
        pytest.skip("needs AVX-512")
    lines = []
    for flag in ("1", "0"):
        env = dict(os.environ, RAMSTREAM_AVX512BF16=flag)
        env.pop("RAMSTREAM_FORCE_ISA", None)
        res = subprocess.run([sys.executable, "-c", _BF16_SWITCH_SCRIPT], env=env, capture_output=True,
                             text=True, check=True)
        lines.append(res.stdout.split())
    for isa_name, same, _ in lines:
        assert isa_name == "avx512" and same == "True"
    assert lines[0][2] == lines[1][2]


def test_force_isa_environment():
    code = "import ramstream._C as C; print(C.active_isa()); print(repr(C.isa_env_error()))"
    env = dict(os.environ, RAMSTREAM_FORCE_ISA="scalar")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    lines = out.stdout.splitlines()
    assert lines[0] == "scalar" and lines[1] == "''"
    env["RAMSTREAM_FORCE_ISA"] = "avx9000"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    lines = out.stdout.splitlines()
    assert lines[0] == C.best_isa()
    assert "RAMSTREAM_FORCE_ISA" in lines[1] and "avx9000" in lines[1]


# ---- bad input -----------------------------------------------------------------------------------

def _state(n=8, moment_dtype=torch.float32):
    return torch.zeros(n), torch.zeros(n), torch.zeros(n, dtype=moment_dtype), torch.zeros(n, dtype=moment_dtype)


@pytest.mark.parametrize("kw,exc,match", [
    (dict(lr=float("nan")), ValueError, "lr"),
    (dict(lr=-1e-3), ValueError, "lr"),
    (dict(lr="0.1"), TypeError, "lr"),
    (dict(beta1=1.0), ValueError, "beta1"),
    (dict(beta1=-0.1), ValueError, "beta1"),
    (dict(beta2=1.5), ValueError, "beta2"),
    (dict(beta2=float("inf")), ValueError, "beta2"),
    (dict(eps=0.0), ValueError, "eps"),
    (dict(eps=float("nan")), ValueError, "eps"),
    (dict(weight_decay=-0.1), ValueError, "weight_decay"),
    (dict(weight_decay=float("inf")), ValueError, "weight_decay"),
    (dict(step=0), ValueError, "step"),
    (dict(step=1.5), TypeError, "step"),
    (dict(grad_scale=float("inf")), ValueError, "grad_scale"),
    (dict(seed=-1), ValueError, "seed"),
    (dict(seed=2**64), ValueError, "seed"),
])
def test_bad_hyper_parameters(kw, exc, match):
    p, g, m, v = _state()
    args = dict(step=1, lr=1e-3) | kw
    before = p.clone()
    with pytest.raises(exc, match=match):
        F.adamw_(p, g, m, v, **args)
    assert torch.equal(p, before)


def test_bad_tensors():
    p, g, m, v = _state()
    with pytest.raises(TypeError, match="param must be float32"):
        F.adamw_(p.double(), g, m, v, step=1, lr=1e-3)
    with pytest.raises(TypeError, match="grad must be float32/bfloat16/float16"):
        F.adamw_(p, g.to(torch.int32), m, v, step=1, lr=1e-3)
    with pytest.raises(TypeError, match="exp_avg must be float32/bfloat16"):
        F.adamw_(p, g, m.half(), v.half(), step=1, lr=1e-3)
    with pytest.raises(TypeError, match="exp_avg_sq must have exp_avg's dtype"):
        F.adamw_(p, g, m, v.bfloat16(), step=1, lr=1e-3)
    with pytest.raises(TypeError, match="out must be float32/bfloat16/float16"):
        F.adamw_(p, g, m, v, step=1, lr=1e-3, out=torch.empty(8, dtype=torch.float64))
    with pytest.raises(TypeError, match="grad must be a torch.Tensor"):
        F.adamw_(p, [0.0] * 8, m, v, step=1, lr=1e-3)
    for name, args in (("grad", (p, g[:7], m, v)), ("exp_avg", (p, g, m[:7], v)), ("exp_avg_sq", (p, g, m, v[:7]))):
        with pytest.raises(ValueError, match=f"{name} must have the same number of elements as param"):
            F.adamw_(*args, step=1, lr=1e-3)
    with pytest.raises(ValueError, match="out must have the same number of elements"):
        F.adamw_(p, g, m, v, step=1, lr=1e-3, out=torch.empty(9))
    wide = torch.zeros(8, 2)
    with pytest.raises(ValueError, match="param must be contiguous"):
        F.adamw_(wide[:, 0], g, m, v, step=1, lr=1e-3)
    with pytest.raises(ValueError, match="exp_avg_sq must be contiguous"):
        F.adamw_(p, g, m, wide[:, 1], step=1, lr=1e-3)
    with pytest.raises(ValueError, match="out must be contiguous"):
        F.adamw_(p, g, m, v, step=1, lr=1e-3, out=wide[:, 1])
    with pytest.raises(ValueError, match="grad must be a CPU tensor"):
        F.adamw_(p, g.to("meta"), m, v, step=1, lr=1e-3)
    # a non-contiguous grad is only read: accepted
    F.adamw_(p, wide[:, 0], m, v, step=1, lr=1e-3)


def test_binding_checks():
    """The compiled entry points validate on their own (no silent copies, arguments named)."""
    p, g, m, v = _state()
    kw = dict(lr=1e-3, step=1)
    with pytest.raises(TypeError, match="param"):
        C.adamw_(p.double(), g, m, v, None, **kw)
    with pytest.raises(ValueError, match="exp_avg: has 7 elements"):
        C.adamw_(p, g, m[:7], v, None, **kw)
    with pytest.raises(ValueError, match="grad: must be contiguous"):
        C.adamw_(p, torch.zeros(8, 2)[:, 0], m, v, None, **kw)
    with pytest.raises(ValueError, match="offset"):
        C.adamw_(p, g, m, v, None, offset=-1, **kw)
    with pytest.raises(ValueError, match="lr"):
        C.adamw_(p, g, m, v, None, lr=-1.0, step=1)
    with pytest.raises(ValueError, match="grad_dtype"):
        C.adamw_ptr(p.data_ptr(), g.data_ptr(), 7, m.data_ptr(), v.data_ptr(), 0, 0, 0, 8, 0,
                    1e-3, 0.9, 0.999, 1e-8, 0.0, 1, 1.0, 0)
    with pytest.raises(ValueError, match="moment dtype"):
        C.adamw_ptr(p.data_ptr(), g.data_ptr(), 0, m.data_ptr(), v.data_ptr(), C.DTYPE_FLOAT16, 0, 0, 8, 0,
                    1e-3, 0.9, 0.999, 1e-8, 0.0, 1, 1.0, 0)
    with pytest.raises(ValueError, match="null pointer"):
        C.adamw_ptr(0, g.data_ptr(), 0, m.data_ptr(), v.data_ptr(), 0, 0, 0, 8, 0,
                    1e-3, 0.9, 0.999, 1e-8, 0.0, 1, 1.0, 0)
    with pytest.raises(ValueError, match="step"):
        C.adamw_ptr(p.data_ptr(), g.data_ptr(), 0, m.data_ptr(), v.data_ptr(), 0, 0, 0, 8, 0,
                    1e-3, 0.9, 0.999, 1e-8, 0.0, 0, 1.0, 0)


def test_parameter_with_requires_grad_is_updated():
    p = torch.nn.Parameter(torch.randn(33))
    before = p.detach().clone()
    F.adamw_(p, torch.randn(33), torch.zeros(33), torch.zeros(33), step=1, lr=1e-2)
    assert not torch.equal(p.detach(), before)


# ---- CUDA dispatch (run by the lead on a GPU machine) --------------------------------------------

@pytest.mark.cuda
@pytest.mark.parametrize("moment_dtype", [torch.float32, torch.bfloat16])
def test_cuda_dispatch_matches_host(moment_dtype):
    """n % 8 == 0, so the host's tail form is not involved: CUDA must equal the host bit for bit."""
    n = 4096 + 16 * 7
    p0, grads = make_problem(n, seed=41, steps=5)
    host = [p0.clone(), torch.zeros(n, dtype=moment_dtype), torch.zeros(n, dtype=moment_dtype),
            torch.empty(n, dtype=torch.bfloat16)]
    dev = [t.cuda() for t in host]
    for s, g in enumerate(grads):
        gb = g.to(torch.bfloat16)
        F.adamw_(host[0], gb, host[1], host[2], step=s + 1, lr=lr_at(s), out=host[3], seed=3)
        F.adamw_(dev[0], gb.cuda(), dev[1], dev[2], step=s + 1, lr=lr_at(s), out=dev[3], seed=3)
    torch.cuda.synchronize()
    for a, b in zip(dev, host):
        assert_bits_equal(a.cpu(), b, "cuda vs host")
