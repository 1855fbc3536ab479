"""The chunked loss's kernel path (taken on CUDA) run on the CPU with torch stand-ins for the two
kernels (the kernels themselves: tests/test_cuda_cross_entropy.py): the chunking, the saved
log-sum-exp, the ignored rows, bias and dh/dW give what the torch path gives."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from ramstream import causal_lm_loss, chunked_cross_entropy
from ramstream.ops import cross_entropy as ce


def _forward(logits, targets):
    x = logits.float()
    return torch.logsumexp(x, 1), x.gather(1, targets[:, None]).squeeze(1)


def _backward_(logits, targets, lse, scale):
    g = torch.exp(logits.float() - lse[:, None]) * scale[:, None]
    g.scatter_add_(1, targets[:, None], -scale[:, None])
    logits.copy_(g)
    return logits


@pytest.fixture
def fused(monkeypatch):
    calls = {"forward": 0, "backward": 0}

    def fwd(*a):
        calls["forward"] += 1
        return _forward(*a)

    def bwd(*a):
        calls["backward"] += 1
        return _backward_(*a)

    monkeypatch.setattr(ce, "usable", lambda device, dtype: dtype != torch.float64)
    monkeypatch.setattr(ce, "forward", fwd)
    monkeypatch.setattr(ce, "backward_", bwd)
    return calls


def _case(seed=0, n=53, d=16, v=301, bias=True):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(n, d, generator=g).requires_grad_()
    w = (torch.randn(v, d, generator=g) * 0.2).requires_grad_()
    b = (torch.randn(v, generator=g) * 0.3).requires_grad_() if bias else None
    t = torch.randint(0, v, (n,), generator=g)
    t[::5] = -100
    return h, w, b, t


def _grads(fn, h, w, b):
    loss = fn()
    return [loss.detach()] + list(torch.autograd.grad(loss, [x for x in (h, w, b) if x is not None]))


@pytest.mark.parametrize("chunk", [1, 7, 16, 1000])
@pytest.mark.parametrize("bias", [True, False])
def test_kernel_path_equals_the_torch_path(fused, chunk, bias):
    h, w, b, t = _case(bias=bias)
    got = _grads(lambda: chunked_cross_entropy(h, w, t, b, chunk_size=chunk), h, w, b)
    assert fused["forward"] == -(-53 // chunk)
    # a trained bias takes torch's backward (its float32 sums); without one, the kernel's
    assert fused["backward"] == (0 if bias else fused["forward"])
    ref = F.cross_entropy(F.linear(h, w, b), t)
    want = [ref.detach()] + list(torch.autograd.grad(ref, [x for x in (h, w, b) if x is not None]))
    for a, r in zip(got, want):
        assert torch.allclose(a, r, rtol=1e-5, atol=1e-6)


def test_kernel_path_keeps_full_chunks_for_16_bit(fused):
    """No fp32 copy of the logits on this path: a bf16 matmul takes chunk_size rows at once."""
    h, w, b, t = _case()
    hb, wb = h.detach().bfloat16().requires_grad_(), w.detach().bfloat16().requires_grad_()
    loss = chunked_cross_entropy(hb, wb, t, chunk_size=16)
    loss.backward()
    assert fused["forward"] == 4  # 53 rows / 16 (the torch path halves: 7 chunks of 8)
    ref = F.cross_entropy(F.linear(hb.float(), wb.float()), t)
    assert abs(loss.item() - ref.item()) <= 2e-2 * ref.item()


def test_kernel_path_with_num_items_and_causal_shift(fused):
    h, w, b, t = _case(n=40)
    h3, t3 = h.reshape(2, 20, 16), t.reshape(2, 20)
    got = _grads(lambda: causal_lm_loss(h3, w, t3, b, chunk_size=9, num_items=31), h, w, b)
    shifted = F.pad(t3[:, 1:], (0, 1), value=-100)
    ref = F.cross_entropy(F.linear(h3, w, b).flatten(0, 1), shifted.flatten(), reduction="sum") / 31
    want = [ref.detach()] + list(torch.autograd.grad(ref, [h, w, b]))
    for a, r in zip(got, want):
        assert torch.allclose(a, r, rtol=1e-5, atol=1e-6)
