"""Host AdamW against torch: bit-exact against torch's fused CPU AdamW, every ISA and thread count,
mixed precision, split calls with offsets, the raw-pointer entry point, the CUDA dispatch (the
low-precision `out` copy and stochastic rounding: test_adamw_rounding.py; bad input:
test_adamw_input.py)."""

from __future__ import annotations

import pytest
import torch

import ramstream.functional as F
from ramstream._native import lib

from _adamw_helpers import assert_bits_equal, lr_at, make_problem, ours, torch_adamw

# isa, restore_isa and restore_threads are fixtures: pytest finds them here once imported
from _isa import isa, restore_isa, restore_threads, supported_isas  # noqa: F401

C = lib()


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


@pytest.mark.parametrize(
    "beta1,beta2,wd", [(0.5, 0.999, 0.05), (0.3, 0.95, 0.1), (0.0, 0.9, 0.3), (0.95, 0.0, 0.0)]
)
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


# ---- offsets and the raw-pointer entry point -------------------------------------------------------


def test_split_calls_with_offsets_equal_one_call():
    """The engine may update a tensor in pieces cut at multiples of 16: the result is the same."""
    n, cut = 5000 + 5, 2048
    p0, grads = make_problem(n, seed=31, steps=3)
    whole = [
        p0.clone(),
        torch.zeros(n, dtype=torch.bfloat16),
        torch.zeros(n, dtype=torch.bfloat16),
        torch.empty(n, dtype=torch.float16),
    ]
    parts = [t.clone() for t in whole]
    for s, g in enumerate(grads):
        gb = g.to(torch.bfloat16)
        F.adamw_(whole[0], gb, whole[1], whole[2], step=s + 1, lr=lr_at(s), out=whole[3], seed=8)
        for lo, hi in ((0, cut), (cut, n)):
            p, m, v, o = (t[lo:hi] for t in parts)
            C.adamw_(
                p,
                gb[lo:hi],
                m,
                v,
                o,
                lr=lr_at(s),
                beta1=0.9,
                beta2=0.999,
                eps=1e-8,
                weight_decay=1e-2,
                step=s + 1,
                grad_scale=1.0,
                seed=8,
                offset=lo,
            )
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
        C.adamw_ptr(
            b[0].data_ptr(),
            gh.data_ptr(),
            C.DTYPE_FLOAT16,
            b[1].data_ptr(),
            b[2].data_ptr(),
            C.DTYPE_FLOAT32,
            b[3].data_ptr(),
            C.DTYPE_BFLOAT16,
            n,
            0,
            2e-3,
            0.9,
            0.999,
            1e-8,
            0.1,
            s + 1,
            0.25,
            0,
        )
    for x, y in zip(a, b):
        assert_bits_equal(x, y, "ptr")
    assert (C.DTYPE_FLOAT32, C.DTYPE_BFLOAT16, C.DTYPE_FLOAT16) == (0, 1, 2)


# ---- CUDA dispatch (run by the lead on a GPU machine) --------------------------------------------


@pytest.mark.cuda
@pytest.mark.parametrize("moment_dtype", [torch.float32, torch.bfloat16])
def test_cuda_dispatch_matches_host(moment_dtype):
    """n % 8 == 0, so the host's tail form is not involved: CUDA must equal the host bit for bit."""
    n = 4096 + 16 * 7
    p0, grads = make_problem(n, seed=41, steps=5)
    host = [
        p0.clone(),
        torch.zeros(n, dtype=moment_dtype),
        torch.zeros(n, dtype=moment_dtype),
        torch.empty(n, dtype=torch.bfloat16),
    ]
    dev = [t.cuda() for t in host]
    for s, g in enumerate(grads):
        gb = g.to(torch.bfloat16)
        F.adamw_(host[0], gb, host[1], host[2], step=s + 1, lr=lr_at(s), out=host[3], seed=3)
        F.adamw_(dev[0], gb.cuda(), dev[1], dev[2], step=s + 1, lr=lr_at(s), out=dev[3], seed=3)
    torch.cuda.synchronize()
    for a, b in zip(dev, host):
        assert_bits_equal(a.cpu(), b, "cuda vs host")
