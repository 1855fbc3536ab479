"""chunked_cross_entropy / causal_lm_loss against dense F.cross_entropy(F.linear(...)): values,
gradients, autocast, Hugging Face's shift and num_items_in_batch, validation, peak memory."""

from __future__ import annotations

import weakref

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

import ramstream
from ramstream import causal_lm_loss, chunked_cross_entropy


def _inputs(n=150, d=24, v=500, bias=True, seed=0, lead=None, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    shape = (n,) if lead is None else lead
    h = torch.randn(*shape, d, generator=g).to(dtype).requires_grad_()
    w = (torch.randn(v, d, generator=g) * 0.2).to(dtype).requires_grad_()
    b = (torch.randn(v, generator=g) * 0.5).to(dtype).requires_grad_() if bias else None
    t = torch.randint(0, v, shape, generator=g)
    return h, w, b, t


def _params(h, w, b):
    return [x for x in (h, w, b) if x is not None]


def _rel_max(a, b):
    if b.numel() == 0:
        return 0.0 if a.shape == b.shape else float("inf")
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item()


def _rel_norm(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30)).item()


def _dense(h, w, b, t, **kw):
    logits = F.linear(h, w, b)
    return F.cross_entropy(logits.float().reshape(-1, w.shape[0]), t.reshape(-1), **kw)


def _check_fp32(loss, ref, params):
    assert loss.dtype == torch.float32
    assert abs(loss.item() - ref.item()) <= 1e-5 * max(abs(ref.item()), 1e-30)
    g = torch.autograd.grad(loss, params)
    gr = torch.autograd.grad(ref, params)
    for a, r in zip(g, gr):
        assert a.dtype == r.dtype and a.shape == r.shape
        assert _rel_max(a, r) <= 1e-5


@pytest.mark.parametrize("n", [0, 1, 7, 63, 64, 65, 301])
@pytest.mark.parametrize("chunk", [1, 64, 4096])
@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_equals_dense_fp32(n, chunk, reduction):
    h, w, b, t = _inputs(n=n)
    if n > 3:
        t[::3] = -100
    loss = chunked_cross_entropy(h, w, t, b, chunk_size=chunk, reduction=reduction)
    ref = _dense(h, w, b, t, reduction=reduction)
    if n == 0 and reduction == "mean":
        assert torch.isnan(loss) and torch.isnan(ref)
        return
    _check_fp32(loss, ref, _params(h, w, b))


def test_leading_dims_no_bias_custom_ignore_index_and_int32_targets():
    h, w, _, t = _inputs(lead=(3, 41), bias=False)
    t[:, :5] = 7
    loss = chunked_cross_entropy(h, w, t.int(), chunk_size=50, ignore_index=7)
    ref = _dense(h, w, None, t, ignore_index=7)
    _check_fp32(loss, ref, [h, w])


def test_num_items_in_batch_like_hugging_face():
    h, w, b, t = _inputs(lead=(2, 60))
    t[0, 40:] = -100
    for num in (17, 17.0, torch.tensor(17), torch.tensor([17.0])):
        loss = chunked_cross_entropy(h, w, t, b, chunk_size=32, num_items=num)
        ref = _dense(h, w, b, t, reduction="sum") / 17
        _check_fp32(loss, ref, [h, w, b])


def test_all_targets_ignored_matches_dense():
    h, w, b, t = _inputs(n=20)
    t[:] = -100
    loss = chunked_cross_entropy(h, w, t, b, chunk_size=8)
    ref = _dense(h, w, b, t)
    assert torch.isnan(loss) and torch.isnan(ref)
    g = torch.autograd.grad(loss, [h, w, b])
    gr = torch.autograd.grad(ref, [h, w, b])
    for a, r in zip(g, gr):
        assert torch.equal(a, r)
    s = chunked_cross_entropy(h, w, t, b, reduction="sum")
    assert s.item() == 0.0


def test_frozen_head_non_contiguous_hidden_and_no_grad():
    h, w, b, t = _inputs(lead=(40, 3))
    w.requires_grad_(False)
    ht = h.transpose(0, 1)  # [3, 40, d], non-contiguous
    tt = t.t()
    loss = chunked_cross_entropy(ht, w, tt, b, chunk_size=16)
    ref = _dense(ht, w, b, tt)
    _check_fp32(loss, ref, [h, b])
    with torch.no_grad():
        out = chunked_cross_entropy(ht, w, tt, b)
    assert out.grad_fn is None and abs(out.item() - ref.item()) <= 1e-5 * ref.item()


def test_bf16_autocast_within_2e_2():
    h, w, b, t = _inputs(n=300, d=64, v=1000)
    t[::5] = -100
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = chunked_cross_entropy(h, w, t, b, chunk_size=128)
        ref = _dense(h, w, b, t)  # F.linear in bf16, loss in fp32
    assert loss.dtype == torch.float32
    assert abs(loss.item() - ref.item()) <= 2e-2 * abs(ref.item())
    g = torch.autograd.grad(loss, [h, w, b])
    gr = torch.autograd.grad(ref, [h, w, b])
    for a, r in zip(g, gr):
        assert a.dtype == torch.float32
        assert _rel_norm(a, r) <= 2e-2
    # the matmul really ran in bf16: fp32 result differs from the autocast one
    exact = chunked_cross_entropy(h, w, t, b, chunk_size=128)
    assert exact.item() != loss.item()


def test_bf16_weights_without_autocast():
    h, w, b, t = _inputs(n=200, d=64, v=700, dtype=torch.bfloat16)
    loss = chunked_cross_entropy(h, w, t, b, chunk_size=64)
    ref = _dense(h, w, b, t)
    assert abs(loss.item() - ref.item()) <= 2e-2 * abs(ref.item())
    g = torch.autograd.grad(loss, [h, w, b])
    gr = torch.autograd.grad(ref, [h, w, b])
    for a, r in zip(g, gr):
        assert a.dtype == torch.bfloat16 and _rel_norm(a, r) <= 2e-2


def _hf_causal_lm_loss(logits, labels, num_items_in_batch=None, ignore_index=-100):
    """Hugging Face's ForCausalLMLoss, as documented: float logits, labels padded on the right
    with ignore_index and shifted by one, summed and divided by num_items_in_batch if given."""
    logits = logits.float()
    labels = F.pad(labels, (0, 1), value=ignore_index)
    shift_labels = labels[..., 1:].contiguous()
    logits = logits.view(-1, logits.size(-1))
    shift_labels = shift_labels.view(-1)
    reduction = "sum" if num_items_in_batch is not None else "mean"
    loss = F.cross_entropy(logits, shift_labels, ignore_index=ignore_index, reduction=reduction)
    if reduction == "sum":
        loss = loss / num_items_in_batch
    return loss


@pytest.mark.parametrize("num_items", [None, 50])
def test_causal_lm_loss_equals_hugging_face_shift(num_items):
    h, w, b, labels = _inputs(lead=(3, 33), bias=False)
    labels[1, :10] = -100
    loss = causal_lm_loss(h, w, labels, chunk_size=20, num_items=num_items)
    ref = _hf_causal_lm_loss(F.linear(h, w), labels, num_items)
    _check_fp32(loss, ref, [h, w])
    # the textbook shift (drop the last position, labels from 1) is the same loss
    if num_items is None:
        alt = F.cross_entropy(F.linear(h[:, :-1], w).reshape(-1, w.shape[0]), labels[:, 1:].reshape(-1))
        assert abs(loss.item() - alt.item()) <= 1e-5 * alt.item()


def test_exports():
    assert ramstream.chunked_cross_entropy is chunked_cross_entropy
    assert "chunked_cross_entropy" in ramstream.__all__ and "causal_lm_loss" in ramstream.__all__


@pytest.mark.parametrize("fn", [chunked_cross_entropy, causal_lm_loss])
def test_bad_inputs(fn):
    h, w, b, t = _inputs(lead=(2, 10))
    name = fn.__name__
    cases = [
        (dict(hidden=h[0, 0]), ValueError, "hidden"),
        (dict(weight=w[:, :-1]), ValueError, "weight"),
        (dict(weight=w[0]), ValueError, "weight"),
        (dict(targets=t[:, :-1]), ValueError, "targets|labels"),  # causal_lm_loss's name: labels
        (dict(targets=t.float()), TypeError, "targets|labels"),
        (dict(hidden=h.long()), TypeError, "hidden"),
        (dict(bias=b[:-1]), ValueError, "bias"),
        (dict(chunk_size=0), ValueError, "chunk_size"),
        (dict(chunk_size=2.5), ValueError, "chunk_size"),
        (dict(chunk_size=True), ValueError, "chunk_size"),
        (dict(reduction="none"), ValueError, "reduction"),
        (dict(num_items=0), ValueError, "num_items"),
        (dict(num_items=float("inf")), ValueError, "num_items"),
        (dict(num_items=torch.tensor([1, 2])), ValueError, "num_items"),
        (dict(num_items=10, reduction="sum"), ValueError, "num_items"),
        (dict(ignore_index=1.5), ValueError, "ignore_index"),
        (dict(weight=w.to("meta")), ValueError, "weight is on meta"),
    ]
    for kw, exc, match in cases:
        args = dict(hidden=h, weight=w, targets=t, bias=b)
        args.update(kw)
        pos = (args.pop("hidden"), args.pop("weight"), args.pop("targets"), args.pop("bias"))
        with pytest.raises(exc, match=match):
            fn(*pos, **args)
        with pytest.raises(exc, match=name):
            fn(*pos, **args)


# ---- peak memory ---------------------------------------------------------------------------------
class LiveBytes(TorchDispatchMode):
    """Tracks the bytes of every storage an op creates while the mode is on, until the storage dies;
    `peak` is the largest total alive at once. Outputs that alias an input (views, in-place ops)
    create no storage; storages made before the mode are not counted."""

    def __init__(self):
        super().__init__()
        self.live = 0
        self.peak = 0
        self.largest = 0
        self._seen: dict[int, weakref.ref] = {}

    def _free(self, ptr, n):
        self.live -= n
        self._seen.pop(ptr, None)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        inputs = {
            t.untyped_storage().data_ptr() for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)
        }
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if not isinstance(t, torch.Tensor) or t.device.type != "cpu":
                continue
            st = t.untyped_storage()
            ptr = st.data_ptr()
            known = self._seen.get(ptr)
            if ptr == 0 or ptr in inputs or (known is not None and known() is st):
                continue
            n = st.nbytes()
            self._seen[ptr] = weakref.ref(st)
            weakref.finalize(st, self._free, ptr, n)
            self.live += n
            self.largest = max(self.largest, n)
            self.peak = max(self.peak, self.live)
        return out


def _peak(fn, *args, autocast=False, **kw):
    with LiveBytes() as m:
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            loss = fn(*args, **kw)
        loss.backward()
        del loss
    return m


def test_live_bytes_tracker_counts_what_it_should():
    a = torch.randn(1000)
    with LiveBytes() as m:
        v = a.t()[10:]  # views: nothing new
        a.mul_(2)  # in place: nothing new
        b = a * 2  # 4000 bytes
        c = b.view(10, 100)  # view of a new storage: counted once
        del b, c
        d = torch.empty(250)  # 1000 bytes, after b died
    assert m.peak == 4000 and m.live == 1000 and m.largest == 4000
    del d, v
    assert m.live == 0


@pytest.mark.parametrize("autocast", [False, True])
def test_peak_memory_below_a_quarter_of_dense_cpu(autocast):
    n, d, v, chunk = 2048, 64, 8000, 256
    h, w, b, t = _inputs(n=n, d=d, v=v)
    dense = _peak(_dense, h, w, b, t, autocast=autocast)
    grads_dense = [x.grad.clone() for x in (h, w, b)]
    for x in (h, w, b):
        x.grad = None
    chunked = _peak(chunked_cross_entropy, h, w, t, b, chunk_size=chunk, autocast=autocast)
    for x, r in zip((h, w, b), grads_dense):
        if autocast:
            assert _rel_norm(x.grad, r) <= 2e-2
        else:
            assert _rel_max(x.grad, r) <= 1e-5
    logits = n * v * 4
    assert dense.largest >= logits and dense.peak >= 2 * logits  # the tracker sees the logits
    assert chunked.largest < logits / 4
    assert chunked.peak < dense.peak / 4, (chunked.peak, dense.peak)
