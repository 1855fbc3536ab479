"""chunked_cross_entropy edge cases against dense F.cross_entropy(F.linear(...)): a head tied with
the embedding, float64 (gradcheck), inputs that need no gradient, ignored targets with num_items,
scaled and repeated backward, out-of-range targets, double backward, num_items on another device."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from ramstream import causal_lm_loss, chunked_cross_entropy


def _inputs(n=37, d=12, v=90, seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(n, d, generator=g).to(dtype).requires_grad_()
    w = (torch.randn(v, d, generator=g) * 0.3).to(dtype).requires_grad_()
    b = (torch.randn(v, generator=g) * 0.5).to(dtype).requires_grad_()
    t = torch.randint(0, v, (n,), generator=g)
    return h, w, b, t


def _dense(h, w, b, t, **kw):
    return F.cross_entropy(F.linear(h, w, b).float(), t, **kw)


def _close(a, r, tol):
    assert a.dtype == r.dtype and a.shape == r.shape
    scale = r.abs().max().clamp_min(1e-30) if r.numel() else 1.0
    assert ((a - r).abs().max() / scale).item() <= tol if r.numel() else True


def test_head_tied_with_the_embedding_adds_both_gradients():
    torch.manual_seed(0)
    emb = nn.Embedding(90, 12)
    mix = nn.Linear(12, 12)
    ref_emb, ref_mix = nn.Embedding(90, 12), nn.Linear(12, 12)
    ref_emb.load_state_dict(emb.state_dict()), ref_mix.load_state_dict(mix.state_dict())
    idx = torch.randint(0, 90, (3, 13))
    tgt = torch.randint(0, 90, (3, 13))
    loss = chunked_cross_entropy(torch.tanh(mix(emb(idx))), emb.weight, tgt, chunk_size=8)
    hr = torch.tanh(ref_mix(ref_emb(idx)))
    ref = F.cross_entropy(F.linear(hr, ref_emb.weight).reshape(-1, 90), tgt.reshape(-1))
    loss.backward(), ref.backward()
    assert abs(loss.item() - ref.item()) <= 1e-5 * ref.item()
    _close(emb.weight.grad, ref_emb.weight.grad, 1e-5)
    _close(mix.weight.grad, ref_mix.weight.grad, 1e-5)
    # both paths contributed: the embedding rows used as inputs and every row as the head
    only_head = torch.autograd.grad(
        chunked_cross_entropy(torch.tanh(mix(emb(idx))).detach(), emb.weight, tgt, chunk_size=8), emb.weight
    )[0]
    assert not torch.equal(only_head, emb.weight.grad)


@pytest.mark.parametrize("chunk", [1, 5, 64])
def test_float64_inputs_compute_in_float64(chunk):
    h, w, b, t = _inputs(n=11, d=5, v=17, dtype=torch.float64)
    t[3] = -100
    loss = chunked_cross_entropy(h, w, t, b, chunk_size=chunk)
    ref = F.cross_entropy(F.linear(h, w, b), t)
    assert loss.dtype == torch.float64
    assert abs(loss.item() - ref.item()) <= 1e-12 * ref.item()
    for a, r in zip(torch.autograd.grad(loss, [h, w, b]), torch.autograd.grad(ref, [h, w, b])):
        _close(a, r, 1e-12)
    assert torch.autograd.gradcheck(
        lambda h, w, b: chunked_cross_entropy(h, w, t, b, chunk_size=chunk), (h, w, b)
    )
    s = chunked_cross_entropy(h, w, t, b, chunk_size=chunk, reduction="sum", num_items=None)
    assert torch.autograd.gradcheck(
        lambda h, w: chunked_cross_entropy(h, w, t, chunk_size=chunk, num_items=4.0), (h, w)
    )
    assert s.dtype == torch.float64


def _dense64(h, w, b, t, **kw):
    """The reference: dense cross-entropy in float64 on copies (its own leaves)."""
    h, w, b = (x.detach().double().requires_grad_() for x in (h, w, b))
    return F.cross_entropy(F.linear(h, w, b), t, **kw), (h, w, b)


@pytest.mark.parametrize("needs", ["w", "b", "h", "hw", "wb", "hb", "none"])
def test_inputs_that_need_no_gradient(needs):
    """Some inputs need no gradient: the loss, and loss.backward() filling exactly the .grad of
    those that do, against float64; with none, backward raises as torch's does."""
    h, w, b, t = _inputs()
    for name, x in (("h", h), ("w", w), ("b", b)):
        x.requires_grad_(name in needs)
    loss = chunked_cross_entropy(h, w, t, b, chunk_size=10)
    ref, leaves = _dense64(h, w, b, t)
    assert abs(loss.item() - ref.item()) <= 1e-5 * ref.item()
    if needs == "none":
        assert not loss.requires_grad
        with pytest.raises(RuntimeError, match="does not require grad"):
            _dense(h, w, b, t).backward()
        with pytest.raises(RuntimeError, match="does not require grad"):
            loss.backward()
        return
    loss.backward()
    ref.backward()
    for name, x, r in zip("hwb", (h, w, b), leaves):
        if name in needs:
            assert x.grad is not None
            _close(x.grad.double(), r.grad, 1e-5)
        else:
            assert x.grad is None


def test_all_targets_ignored_with_num_items_and_empty_rows():
    h, w, b, t = _inputs(n=20)
    t[:] = -100
    loss = chunked_cross_entropy(h, w, t, b, chunk_size=7, num_items=5)
    ref = _dense(h, w, b, t, reduction="sum") / 5
    assert loss.item() == ref.item() == 0.0
    for a, r in zip(torch.autograd.grad(loss, [h, w, b]), torch.autograd.grad(ref, [h, w, b])):
        assert torch.equal(a, r)
    h0, t0 = h[:0], t[:0]  # no rows at all: sum is 0, mean nan (like torch)
    assert chunked_cross_entropy(h0, w, t0, b, reduction="sum").item() == 0.0
    assert torch.isnan(chunked_cross_entropy(h0, w, t0, b)) and torch.isnan(_dense(h0, w, b, t0))


@pytest.mark.parametrize("chunk", [1, 9, 64])
def test_scaled_combined_and_retained_backward(chunk):
    """Two reductions of one chunked loss scaled and summed, backward twice through a retained
    graph: gradients accumulate to twice the float64 reference's."""
    h, w, b, t = _inputs()
    t[::4] = -100
    total = 3 * chunked_cross_entropy(h, w, t, b, chunk_size=chunk) + 0.5 * chunked_cross_entropy(
        h, w, t, b, chunk_size=chunk, reduction="sum"
    )
    total.backward(retain_graph=True)
    total.backward()  # accumulates twice
    ref_mean, leaves = _dense64(h, w, b, t)
    ref_sum = F.cross_entropy(F.linear(*leaves), t, reduction="sum")
    ref = 3 * ref_mean + 0.5 * ref_sum
    assert abs(total.item() - ref.item()) <= 1e-5 * abs(ref.item())
    for x, r in zip((h, w, b), torch.autograd.grad(ref, list(leaves))):
        _close(x.grad.double(), 2 * r, 1e-5)


def test_targets_out_of_range_raise_naming_targets():
    h, w, b, t = _inputs()
    for bad in (90, -1):
        t2 = t.clone()
        t2[5] = bad
        with pytest.raises((RuntimeError, IndexError)):
            _dense(h, w, b, t2)
        with pytest.raises(
            ValueError, match=rf"targets must be class indices in \[0, {w.shape[0]}\).*e\.g\. {bad}"
        ):
            chunked_cross_entropy(h, w, t2, b, chunk_size=8)


@pytest.mark.filterwarnings("ignore:Using backward\\(\\) with create_graph")
def test_double_backward_is_a_clear_error_not_a_missing_term():
    h, w, b, t = _inputs()
    loss = chunked_cross_entropy(h, w, t, b)
    gh, gw = torch.autograd.grad(loss, [h, w], create_graph=True)
    ref = torch.autograd.grad(_dense(h, w, b, t), [h, w])
    _close(gh.detach(), ref[0], 1e-5), _close(gw.detach(), ref[1], 1e-5)  # first order fine
    # a gradient penalty next to a differentiable term: an error, not a silently dropped penalty
    with pytest.raises(RuntimeError, match="double backward is not supported"):
        (gh.square().sum() + b.sum()).backward()
    with pytest.raises(RuntimeError, match="double backward is not supported"):
        torch.autograd.grad(gw.sum(), [w])
    loss = chunked_cross_entropy(h, w, t, b)
    loss.backward(create_graph=True)  # create_graph alone does not raise
    assert h.grad is not None and w.grad is not None


def test_under_inference_mode_and_no_grad():
    h, w, b, t = _inputs()
    ref = _dense(h, w, b, t)
    with torch.inference_mode():
        a = chunked_cross_entropy(h, w, t, b, chunk_size=8)
    with torch.no_grad():
        c = causal_lm_loss(h[None], w, t[None], b, chunk_size=8)
    assert abs(a.item() - ref.item()) <= 1e-5 * ref.item() and not c.requires_grad


@pytest.mark.cuda
@pytest.mark.parametrize("where", ["cpu_num_items", "cuda_num_items_cpu_hidden"])
def test_num_items_tensor_on_another_device(where):
    h, w, b, t = _inputs()
    dev = torch.device("cuda")
    num = torch.tensor(13)
    if where == "cpu_num_items":
        h, w, b, t = (x.detach().to(dev).requires_grad_(x.requires_grad) for x in (h, w, b, t))
    else:
        num = num.to(dev)
    loss = chunked_cross_entropy(h, w, t, b, chunk_size=8, num_items=num)
    ref = _dense(h, w, b, t, reduction="sum") / 13
    assert loss.device == h.device and abs(loss.item() - ref.item()) <= 1e-5 * abs(ref.item())
    for a, r in zip(torch.autograd.grad(loss, [h, w, b]), torch.autograd.grad(ref, [h, w, b])):
        _close(a, r, 1e-4)
