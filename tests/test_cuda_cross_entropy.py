"""The fused cross-entropy kernels (ops/cross_entropy.py) against torch in float64, and the chunked
loss with them against the same loss on torch's ops (kernels switched off) and the dense loss."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from ramstream import causal_lm_loss, chunked_cross_entropy
from ramstream.ops import cross_entropy as ce

pytestmark = pytest.mark.cuda
DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def _logits(rows, vocab, dtype, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(rows, vocab, device="cuda", generator=g) * 4
    x[0, : vocab // 2] = float("-inf")  # a row half masked
    x[1, 3] = 60.0  # one dominant logit
    t = torch.randint(0, vocab, (rows,), device="cuda", generator=g)
    return x.to(dtype), t


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("vocab", [151936, 1001, 8])  # 16-byte rows (vector path) and not
def test_forward_equals_float64_logsumexp(dtype, vocab):
    x, t = _logits(37, vocab, dtype)
    lse, tl = ce.forward(x, t)
    ref = torch.logsumexp(x.double(), 1)
    assert torch.allclose(lse.double(), ref, rtol=2e-6, atol=2e-6)
    assert torch.equal(tl, x.gather(1, t[:, None]).squeeze(1).float())


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("vocab", [151936, 1001])
def test_backward_equals_torch_cross_entropy_gradient(dtype, vocab):
    x, t = _logits(19, vocab, dtype, seed=1)
    scale = torch.rand(19, device="cuda") / 19
    scale[5] = 0.0  # an ignored row
    lse, _ = ce.forward(x, t)
    got = ce.backward_(x.clone(), t, lse, scale)
    xd = x.double().requires_grad_()
    (F.cross_entropy(xd, t, reduction="none") * scale.double()).sum().backward()
    ref = xd.grad
    assert got.dtype == dtype and torch.all(got[5] == 0)
    # float32 arithmetic: exp(x - lse) carries lse's rounding (relative 2^-23 of |lse|, ~60 here),
    # the target's term (p - 1) * s that error times s; then one rounding to dtype
    eps = torch.finfo(dtype).eps
    lse_ref = torch.logsumexp(x.double(), 1, keepdim=True)
    rel = eps + 4 * 2.0**-24 * (1 + lse_ref.abs())
    onehot = F.one_hot(t, vocab).double() * scale.double()[:, None]
    fi = torch.finfo(dtype)
    bound = (ref.abs() + onehot) * rel + fi.tiny * fi.eps  # + half a subnormal step (float16 underflow)
    err = (got.double() - ref).abs()
    assert torch.all(err <= bound), (err - bound).max()


def test_nan_logits_give_a_nan_loss_as_torch():
    x, t = _logits(4, 1001, torch.float32)
    x[2, 7] = float("nan")
    lse, _ = ce.forward(x, t)
    assert torch.isnan(lse[2]) and torch.isfinite(lse[[0, 1, 3]]).all()


def test_bad_arguments_are_named():
    from ramstream._native import lib

    x, t = _logits(4, 64, torch.bfloat16)
    lse = torch.empty(4, device="cuda")
    with pytest.raises(TypeError, match="targets"):
        lib().cuda_ce_forward(x, t.int(), lse, lse.clone())
    with pytest.raises(ValueError, match="logits"):
        lib().cuda_ce_forward(x.reshape(-1), t, lse, lse.clone())
    with pytest.raises(ValueError, match="lse"):
        lib().cuda_ce_forward(x, t, torch.empty(3, device="cuda"), lse)
    with pytest.raises(TypeError, match="scale"):
        lib().cuda_ce_backward(x, t, lse, lse.double())


def _run_loss(fused, dtype, autocast, bias, ignore, chunk, vocab=5003, causal=False):
    g = torch.Generator().manual_seed(3)
    h = torch.randn(2, 300, 64, generator=g).cuda().to(dtype).requires_grad_()
    w = (torch.randn(vocab, 64, generator=g) * 0.05).cuda().to(dtype).requires_grad_()
    b = (torch.randn(vocab, generator=g) * 0.1).cuda().to(dtype).requires_grad_() if bias else None
    t = torch.randint(0, vocab, (2, 300), generator=g).cuda()
    if ignore:
        t[:, ::7] = -100
    old = ce.ENABLED
    ce.ENABLED = fused
    try:
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast):
            if causal:
                loss = causal_lm_loss(h, w, t, b, chunk_size=chunk)
            else:
                loss = chunked_cross_entropy(h, w, t, b, chunk_size=chunk)
        loss.backward()
    finally:
        ce.ENABLED = old
    grads = [x.grad for x in (h, w, b) if x is not None]
    return loss.detach(), grads, (h, w, b, t)


@pytest.mark.parametrize(
    "dtype,autocast", [(torch.float32, False), (torch.float32, True), (torch.bfloat16, False)]
)
@pytest.mark.parametrize(
    "bias,ignore,causal", [(False, False, False), (True, True, False), (False, True, True)]
)
def test_chunked_loss_with_kernels_equals_it_without(dtype, autocast, bias, ignore, causal):
    lf, gf, _ = _run_loss(True, dtype, autocast, bias, ignore, chunk=128, causal=causal)
    lt, gt, (h, w, b, t) = _run_loss(False, dtype, autocast, bias, ignore, chunk=128, causal=causal)
    low = dtype != torch.float32 or autocast
    assert abs(lf.item() - lt.item()) <= (2e-3 if low else 1e-5) * abs(lt.item())
    # against the dense loss in float64 (the torch path's own distance to it bounds the kernels')
    hd, wd = h.detach().double().requires_grad_(), w.detach().double().requires_grad_()
    bd = b.detach().double().requires_grad_() if b is not None else None
    tt = F.pad(t[..., 1:], (0, 1), value=-100) if causal else t
    ref = F.cross_entropy(F.linear(hd, wd, bd).flatten(0, 1), tt.flatten(), ignore_index=-100)
    ref.backward()
    refs = [x.grad for x in (hd, wd, bd) if x is not None]
    for a, c, r in zip(gf, gt, refs):
        err_f = (a.double() - r).abs().max().item()
        err_t = (c.double() - r).abs().max().item()
        assert err_f <= 1.5 * err_t + 1e-6 * r.abs().max().item(), (err_f, err_t)


def test_the_kernels_are_used_on_cuda():
    assert ce.usable(torch.device("cuda"), torch.bfloat16)
    assert not ce.usable(torch.device("cuda"), torch.float64)
    assert not ce.usable(torch.device("cpu"), torch.float32)


def test_a_target_outside_the_vocab_gives_nan_not_another_rows_logit():
    """The forward kernel reads a row's target logit only for a target in [0, vocab): one outside
    makes that row's loss NaN (torch would stop at a device-side assert), never a logit read from
    another row or past the tensor."""
    x, t = _logits(6, 1001, torch.float32)
    t[2], t[4] = 1001, -3
    lse, tl = ce.forward(x, t)
    assert torch.isnan(tl[2]) and torch.isnan(tl[4])
    ok = torch.tensor([0, 1, 3, 5], device="cuda")
    assert torch.equal(tl[ok], x[ok].gather(1, t[ok, None]).squeeze(1).float())
    hidden = torch.randn(4, 16, device="cuda")
    weight = torch.randn(1001, 16, device="cuda")
    loss = chunked_cross_entropy(hidden, weight, torch.tensor([1, 2, 5000, 3], device="cuda"))
    assert torch.isnan(loss)
