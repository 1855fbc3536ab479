"""Host AdamW's rounding: the low-precision `out` copy (docs/NUMERICS.md rule 1), stochastic
rounding of bf16 moments (rule 2), large calls with non-temporal stores of `out` and the AVX512-BF16
conversion."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest
import torch

import ramstream.functional as F
from ramstream._native import lib

from _adamw_helpers import assert_bits_equal, bits, lr_at, make_problem, ours

# isa and restore_threads are fixtures: pytest finds them here once imported
from _isa import isa, restore_threads  # noqa: F401

C = lib()


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
    special = torch.tensor(
        [
            float("inf"),
            -float("inf"),
            3.0e38,
            -7.0e4,
            65519.0,
            65520.0,
            1e-40,
            -1e-45,
            6.0e-8,
            2.9e-8,
            0.0,
            -0.0,
            1.0 + 2**-8,
            1.0 + 3 * 2**-8,
            1.00048828125,
        ]
    )
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
    const = (
        (seed & M) * 0xC2B2AE3D + (seed >> 32) * 0x27D4EB2F + (step & M) * 0x165667B1 + moment * 0xD3A2646C
    ) & M
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
    C.adamw_ptr(
        p.data_ptr(),
        g.data_ptr(),
        C.DTYPE_FLOAT32,
        m.data_ptr(),
        v.data_ptr(),
        C.DTYPE_BFLOAT16,
        0,
        C.DTYPE_BFLOAT16,
        n,
        offset,
        1e-3,
        0.0,
        0.0,
        1e-8,
        0.0,
        step,
        1.0,
        seed,
    )
    index = np.arange(n, dtype=np.uint64) + np.uint64(offset)
    for moment, (state, exact) in enumerate(((m, g), (v, g * g))):
        u = exact.numpy().view(np.uint32).astype(np.uint64)
        r = _sr_bits_reference(seed, step, index, moment).astype(np.uint64)
        want = ((u + r) >> np.uint64(16)) & np.uint64(0xFFFF)
        special = (u & 0x7F800000) == 0x7F800000
        want[special] = (u[special] >> np.uint64(16)) | np.where(
            (u[special] & 0x7FFFFF) != 0, np.uint64(0x40), np.uint64(0)
        )
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
    out = {
        "aligned": torch.empty(n, dtype=out_dtype),
        "unaligned": torch.empty(n + 40, dtype=out_dtype)[3 : 3 + n],
        "grad": None,
    }[placement]
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
        out = torch.empty(n + 40, dtype=torch.bfloat16)[5 : 5 + n]
        C.adamw_(
            p,
            g,
            m,
            v,
            out,
            lr=1e-3,
            beta1=0.9,
            beta2=0.999,
            eps=1e-8,
            weight_decay=1e-2,
            step=1,
            grad_scale=1.0,
            seed=5,
            offset=offset,
        )
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
    payloads = np.array(
        [0x7FFFFFFF, 0xFFFFFFFF, 0x7FC0FFFF, 0xFF80FFFF, 0x7FFFFF00, 0xFFC0FFFF, 0x7F80FFFF], dtype=np.uint32
    )
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
        res = subprocess.run(
            [sys.executable, "-c", _BF16_SWITCH_SCRIPT], env=env, capture_output=True, text=True, check=True
        )
        lines.append(res.stdout.split())
    for isa_name, same, _ in lines:
        assert isa_name == "avx512" and same == "True"
    assert lines[0][2] == lines[1][2]
