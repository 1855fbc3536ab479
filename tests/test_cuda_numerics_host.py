"""The CUDA kernels' element numerics (cuda/src/numerics.cuh) compiled for the host and checked
against the spec references and torch: runs without a GPU (needs the source tree and a C++17
compiler; skipped otherwise)."""

from __future__ import annotations

import ctypes
import os
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch

import _spec_reference as ref

HEADER_DIR = Path(__file__).resolve().parents[1] / "cuda" / "src"
CORE_INCLUDE = Path(__file__).resolve().parents[1] / "cpp" / "include"  # ramstream/rounding.h

SHIM = r"""
#include "numerics.cuh"
using namespace ramstream::cuda::detail;
extern "C" {
void rs_adamw(float* p, const float* g, float* m, float* v, long long n, double lr, double b1,
              double b2, double eps, double wd, long long step, float gs) {
  const AdamWCoef c = make_adamw_coef(lr, b1, b2, eps, wd, step, gs);
  for (long long i = 0; i < n; ++i) adamw_math(c, p[i], g[i], m[i], v[i]);
}
void rs_sr_bits(unsigned long long seed, long long step, const long long* idx, long long n,
                unsigned moment, unsigned* out) {
  const unsigned base = sr_key_base(seed, step);
  for (long long i = 0; i < n; ++i) out[i] = sr_bits(base, (unsigned long long)idx[i], moment);
}
void rs_bf16(const float* x, const unsigned* r, long long n, int stochastic, unsigned short* out) {
  for (long long i = 0; i < n; ++i)
    out[i] = stochastic ? float_to_bf16_sr(x[i], r[i]) : float_to_bf16_rne(x[i]);
}
void rs_nf4_table(float* out) {
  const float t[16] = RAMSTREAM_NF4_TABLE;
  for (int i = 0; i < 16; ++i) out[i] = t[i];
}
void rs_int8_scale(const float* a, long long n, float* out) {
  for (long long i = 0; i < n; ++i) out[i] = int8_scale(a[i]);
}
}
"""


@pytest.fixture(scope="module")
def shim(tmp_path_factory):
    if not (HEADER_DIR / "numerics.cuh").exists():
        pytest.skip("needs the source tree (cuda/src/numerics.cuh)")
    cxx = os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++") or shutil.which("clang++")
    if not cxx:
        pytest.skip("needs a C++ compiler")
    d = tmp_path_factory.mktemp("numerics")
    (d / "shim.cpp").write_text(SHIM)
    so = d / "shim.so"
    # -ffp-contract=off: the host build of the header must not fuse (the device build uses _rn
    # intrinsics, which nvcc never fuses).
    subprocess.run(
        [
            cxx,
            "-std=c++17",
            "-O2",
            "-ffp-contract=off",
            "-shared",
            "-fPIC",
            f"-I{HEADER_DIR}",
            f"-I{CORE_INCLUDE}",
            str(d / "shim.cpp"),
            "-o",
            str(so),
        ],
        check=True,
    )
    lib = ctypes.CDLL(str(so))
    P, LL = ctypes.c_void_p, ctypes.c_longlong
    lib.rs_adamw.argtypes = [
        P,
        P,
        P,
        P,
        LL,
        ctypes.c_double,
        ctypes.c_double,
        ctypes.c_double,
        ctypes.c_double,
        ctypes.c_double,
        LL,
        ctypes.c_float,
    ]
    lib.rs_sr_bits.argtypes = [ctypes.c_ulonglong, LL, P, LL, ctypes.c_uint, P]
    lib.rs_bf16.argtypes = [P, P, LL, ctypes.c_int, P]
    lib.rs_nf4_table.argtypes = [P]
    lib.rs_int8_scale.argtypes = [P, LL, P]
    return lib


def _ptr(t: torch.Tensor) -> int:
    assert t.is_contiguous()
    return t.data_ptr()


HYPERS = [
    dict(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=1e-2, grad_scale=1.0),
    dict(lr=3e-2, beta1=0.3, beta2=0.95, eps=1e-6, weight_decay=0.0, grad_scale=0.37),  # lerp from g
    dict(lr=0.0, beta1=0.0, beta2=0.0, eps=1e-3, weight_decay=0.5, grad_scale=2.0),
]


@pytest.mark.parametrize("hyper", HYPERS)
@pytest.mark.parametrize("n", [1, 15, 16, 17, 4099])
def test_adamw_math_equals_spec_reference(shim, hyper, n):
    gen = torch.Generator().manual_seed(n)
    p = torch.randn(n, generator=gen)
    m = torch.randn(n, generator=gen) * 0.1
    v = torch.rand(n, generator=gen) * 0.01
    for step in (1, 2, 7):
        g = torch.randn(n, generator=gen)
        want = ref.adamw_step(p.numpy(), g.numpy(), m.numpy(), v.numpy(), step=step, **hyper)
        shim.rs_adamw(
            _ptr(p),
            _ptr(g),
            _ptr(m),
            _ptr(v),
            n,
            hyper["lr"],
            hyper["beta1"],
            hyper["beta2"],
            hyper["eps"],
            hyper["weight_decay"],
            step,
            hyper["grad_scale"],
        )
        for got, exp in zip((p, m, v), want):
            np.testing.assert_array_equal(got.numpy().view(np.int32), exp.view(np.int32))


def test_adamw_math_close_to_torch(shim):
    """20 steps within 1e-6 of torch.optim.AdamW(foreach=False); exp_avg bit-identical to torch's
    fused CPU AdamW (its lerp is the same fma)."""
    n = 4096
    gen = torch.Generator().manual_seed(0)
    p0 = torch.randn(n, generator=gen)
    grads = [torch.randn(n, generator=gen) for _ in range(20)]
    hp = dict(lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2)
    ref_p = p0.clone().requires_grad_(True)
    fused_p = p0.clone().requires_grad_(True)
    opt = torch.optim.AdamW([ref_p], foreach=False, **hp)
    fused = torch.optim.AdamW([fused_p], fused=True, **hp)
    p, m, v = p0.clone(), torch.zeros(n), torch.zeros(n)
    for step, g in enumerate(grads, 1):
        ref_p.grad, fused_p.grad = g.clone(), g.clone()
        opt.step()
        fused.step()
        shim.rs_adamw(_ptr(p), _ptr(g), _ptr(m), _ptr(v), n, 1e-3, 0.9, 0.999, 1e-8, 1e-2, step, 1.0)
    assert (p - ref_p.detach()).abs().max().item() <= 1e-6
    assert (m - opt.state[ref_p]["exp_avg"]).abs().max().item() <= 1e-6
    assert (v - opt.state[ref_p]["exp_avg_sq"]).abs().max().item() <= 1e-6
    torch.testing.assert_close(m, fused.state[fused_p]["exp_avg"], rtol=0, atol=0)


def test_sr_bits_equal_spec_reference(shim):
    idx = torch.cat(
        [torch.arange(0, 5000), torch.tensor([2**32 - 1, 2**32, 2**32 + 7, 2**40 + 3, 2**62 + 11])]
    )
    out = torch.empty(idx.numel(), dtype=torch.int32)
    for seed, step, moment in [
        (0, 1, 0),
        (0, 1, 1),
        (12345, 77, 0),
        (2**63 + 5, 2**31 + 9, 1),
        (2**64 - 1, 1, 0),
    ]:
        shim.rs_sr_bits(seed, step, _ptr(idx), idx.numel(), moment, _ptr(out))
        got = out.to(torch.int64) & ref.M32
        torch.testing.assert_close(got, ref.sr_bits(seed, step, idx, moment), rtol=0, atol=0)
    # the bits are roughly uniform: a broken hash (e.g. constant) fails this
    bits = ref.sr_bits(7, 3, torch.arange(100000), 0).double()
    assert abs(bits.mean().item() - 32767.5) < 400


def _special_floats() -> torch.Tensor:
    gen = torch.Generator().manual_seed(1)
    bits = torch.randint(-(2**31), 2**31 - 1, (20000,), generator=gen, dtype=torch.int64).to(torch.int32)
    x = bits.view(torch.float32)
    extra = torch.tensor(
        [
            0.0,
            -0.0,
            float("inf"),
            -float("inf"),
            float("nan"),
            1e-45,
            -1e-40,
            3.3895314e38,
            3.4028235e38,
            -3.4028235e38,
            1.0,
            1.00390625,
            1.005859375,
        ]
    )
    return torch.cat([x, extra]).contiguous()


def test_bf16_rne_equals_rule1_and_torch(shim):
    x = _special_floats()
    out = torch.empty(x.numel(), dtype=torch.int16)
    shim.rs_bf16(_ptr(x), 0, x.numel(), 0, _ptr(out))
    got = out.to(torch.int64) & 0xFFFF
    torch.testing.assert_close(got, ref.bf16_rne_bits(x), rtol=0, atol=0)
    finite = ~torch.isnan(x)
    torch.testing.assert_close(out.view(torch.bfloat16)[finite], x[finite].to(torch.bfloat16), rtol=0, atol=0)


def test_bf16_stochastic_rounding_equals_rule2(shim):
    x = _special_floats()
    r = ref.sr_bits(3, 5, torch.arange(x.numel()), 1)
    r32 = r.to(torch.int32).contiguous()
    out = torch.empty(x.numel(), dtype=torch.int16)
    shim.rs_bf16(_ptr(x), _ptr(r32), x.numel(), 1, _ptr(out))
    torch.testing.assert_close(out.view(torch.int16), ref.bf16_sr(x, r).view(torch.int16), rtol=0, atol=0)
    # unbiased: the mean of many roundings of one value is the value
    v = torch.full((200000,), 1.0 + 1.0 / 3.0)
    rv = ref.sr_bits(11, 1, torch.arange(v.numel()), 0).to(torch.int32).contiguous()
    outv = torch.empty(v.numel(), dtype=torch.int16)
    shim.rs_bf16(_ptr(v), _ptr(rv), v.numel(), 1, _ptr(outv))
    mean = outv.view(torch.bfloat16).double().mean().item()
    assert abs(mean - (1.0 + 1.0 / 3.0)) < 2e-4, mean


def test_nf4_table_and_int8_scale(shim):
    t = torch.empty(16)
    shim.rs_nf4_table(_ptr(t))
    torch.testing.assert_close(t, ref.NF4_TABLE, rtol=0, atol=0)
    a = torch.rand(1000) * 10
    s = torch.empty(1000)
    shim.rs_int8_scale(_ptr(a), 1000, _ptr(s))
    torch.testing.assert_close(s, a / torch.full_like(a, 127.0), rtol=0, atol=0)
