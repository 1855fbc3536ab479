"""Activation offload on the CPU engine, edge cases against an unpaged clone (bit-exact): in-place
ops after saving, aliasing across blocks, tuple/dict outputs, shared and skipped blocks,
autograd.grad, double backward, unusual dtypes and layouts, exceptions in backward."""

from __future__ import annotations

import gc

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from _act_helpers import _assert_same_grads, _offloader
from _models import clone

INPLACE = "modified by an inplace operation"


def _run(blocks, x, order=None):
    for i in range(len(blocks)) if order is None else order:
        x = blocks[i](x)
    if isinstance(x, dict):
        x = x["h"]
    elif isinstance(x, tuple):
        x = x[0] + x[1].sum()
    return x.square().sum()


def _both(blocks, x, order=None, **kw):
    """Backward through `blocks` paged and an unpaged clone: bit-equal gradients (and x's)."""
    ref = clone(blocks)
    off = _offloader(list(blocks), **kw)
    xr = x.detach().clone().requires_grad_(x.requires_grad)
    _run(blocks, x, order).backward()
    _run(ref, xr, order).backward()
    _assert_same_grads(blocks, ref)
    if x.requires_grad:
        assert torch.equal(x.grad, xr.grad)
    return off


def _clean(off):
    gc.collect()
    s = off.stats()
    assert s["live_entries"] == 0 and s["host_bytes_in_use"] == 0, s


# ---- in-place after saving: torch's version check still raises -----------------------------------
class _SigmoidInplace(nn.Module):
    def __init__(self, d=16, inplace=True):
        super().__init__()
        self.fc = nn.Linear(d, d)
        self.inplace = inplace

    def forward(self, x):
        y = torch.sigmoid(self.fc(x))  # sigmoid saves its output
        if self.inplace:
            y.mul_(2)
        return y + x


@pytest.mark.parametrize("mode", ["paged", "too_small", "measured"])
def test_inplace_after_save_raises_like_torch(mode):
    torch.manual_seed(0)
    blocks = nn.ModuleList([_SigmoidInplace(), _SigmoidInplace()])
    x = torch.randn(8, 16, requires_grad=True)
    with pytest.raises(RuntimeError, match=INPLACE):
        _run(blocks, x).backward()  # torch, unpaged
    kw = {"min_offload_bytes": 1 << 30} if mode == "too_small" else {}
    off = _offloader(list(blocks), paged=set() if mode == "measured" else "all", **kw)
    off.set_measuring(mode == "measured")
    with pytest.raises(RuntimeError, match=INPLACE):
        _run(blocks, x).backward()
    _clean(off)
    for b in blocks:  # the next step is not disturbed
        b.inplace = False
    ref = clone(blocks)
    xr = x.detach().clone().requires_grad_()
    blocks.zero_grad(), _run(blocks, x).backward(), _run(ref, xr).backward()
    _assert_same_grads(blocks, ref)
    _clean(off)


def test_inplace_on_an_earlier_blocks_output_raises():
    class Tanh(nn.Linear):
        def forward(self, x):
            return torch.tanh(super().forward(x))  # saves its output, the next block's input

    class AddInplace(nn.Linear):
        def forward(self, x):
            x.add_(1)  # modifies what block 0 saved
            return super().forward(x)

    blocks = nn.ModuleList([Tanh(16, 16), AddInplace(16, 16)])
    off = _offloader(list(blocks))
    with pytest.raises(RuntimeError, match=INPLACE):
        _run(blocks, torch.randn(4, 16)).backward()
    _clean(off)


# ---- aliasing, tuples and dicts, shared and skipped blocks ---------------------------------------
class _Pair(nn.Module):
    """(h, aux) -> (h', aux): saves h twice, a view of h, and aux (paged by another block)."""

    def __init__(self, d=16, as_dict=False):
        super().__init__()
        self.fc = nn.Linear(d, d)
        self.as_dict = as_dict

    def forward(self, x):
        if isinstance(x, dict):
            h, aux = x["h"], x["aux"]
        elif isinstance(x, tuple):
            h, aux = x
        else:
            h, aux = x, x.tanh()
        a = h * h  # saves h twice
        b = h[:, 1:].sin()  # saves a view of h (the previous output)
        c = self.fc(a) * aux  # saves aux (made by the first block)
        out = h + c + F.pad(b, (1, 0))
        return {"h": out, "aux": aux} if self.as_dict else (out, aux)


@pytest.mark.parametrize("as_dict", [False, True])
def test_aliasing_across_blocks_and_tuple_dict_outputs(as_dict):
    torch.manual_seed(0)
    blocks = nn.ModuleList([_Pair(as_dict=as_dict) for _ in range(3)])
    off = _both(blocks, torch.randn(6, 16, requires_grad=True))
    assert off.stats()["copies_d2h"] > 0
    _clean(off)


@pytest.mark.parametrize("order", [[0, 1, 0, 1], [0, 0, 0], [1, 0], [0, 2], [2, 1, 0, 1, 2]])
def test_shared_skipped_and_reordered_blocks(order):
    torch.manual_seed(0)
    blocks = nn.ModuleList([_SigmoidInplace(inplace=False) for _ in range(3)])
    off = _both(blocks, torch.randn(8, 16, requires_grad=True), order=order, prefetch_depth=2)
    assert off.stats()["copies_d2h"] > 0
    _clean(off)


# ---- autograd.grad, retain_graph, double backward ------------------------------------------------
def test_autograd_grad_retain_graph_and_double_backward():
    torch.manual_seed(0)
    blocks = nn.ModuleList([_SigmoidInplace(inplace=False) for _ in range(2)])
    ref = clone(blocks)
    off = _offloader(list(blocks))
    x = torch.randn(8, 16, requires_grad=True)
    xr = x.detach().clone().requires_grad_()
    outs = []
    for bl, xx in ((blocks, x), (ref, xr)):
        loss = _run(bl, xx)
        g1 = torch.autograd.grad(loss, list(bl.parameters()), retain_graph=True)
        g2 = torch.autograd.grad(loss, list(bl.parameters()))
        loss = _run(bl, xx)  # a gradient penalty
        (gx,) = torch.autograd.grad(loss, xx, create_graph=True)
        gx.square().sum().backward()
        outs.append([*g1, *g2, gx.detach()])
    assert all(torch.equal(a, b) for a, b in zip(*outs))
    _assert_same_grads(blocks, ref)
    assert torch.equal(x.grad, xr.grad)
    _clean(off)


# ---- dtypes and layouts --------------------------------------------------------------------------
class _Kinds(nn.Module):
    """Saves int64 indices, a bool mask, complex, 0-d, stride-0, storage-offset and sparse."""

    def __init__(self, d=16):
        super().__init__()
        self.fc = nn.Linear(d, d)
        self.s = nn.Parameter(torch.tensor(0.5))

    def forward(self, x):
        h = self.fc(x)  # [n, d]
        idx = h.detach().abs().argsort(-1)[:, :4]  # int64 [n, 4]
        g = h.gather(1, idx) + h.index_select(1, idx[0])
        mask = h.detach() > 0  # bool [n, d]
        m = h.masked_fill(mask, 0.0)
        z = torch.view_as_complex(torch.stack([h, h.flip(-1)], -1))  # complex [n, d]
        zz = (z * z.conj().exp()).real
        s0 = (self.s * 3).tanh()  # 0-d saved by mul
        e = h[:1].expand_as(h)  # stride 0 in dim 0
        off = h.reshape(-1)[5 : 5 + h.shape[0] * 2].view(-1, 2)  # storage offset 5
        sp = torch.eye(h.shape[0]).to_sparse().requires_grad_(False)
        spm = torch.sparse.mm(sp, h * e)
        out = m + zz + s0 * h + spm + F.pad(g, (0, h.shape[1] - 4))
        return out + F.pad(off.sin() * s0, (0, h.shape[1] - 2))


def test_integer_bool_complex_0d_expanded_offset_and_sparse_saved_tensors():
    torch.manual_seed(0)
    blocks = nn.ModuleList([_Kinds(), _Kinds()])
    off = _both(blocks, torch.randn(8, 16, requires_grad=True))
    assert off.stats()["copies_d2h"] > 0
    _clean(off)


def test_layout_of_every_kind_comes_back_exactly():
    seen = []

    class Probe(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, t):
            ctx.save_for_backward(t)
            ctx.meta = (t.dtype, t.shape, t.stride(), t.storage_offset(), t.clone())
            return x.clone()

        @staticmethod
        def backward(ctx, g):
            (t,) = ctx.saved_tensors
            dt, shape, stride, offset, val = ctx.meta
            meta = (t.dtype, t.shape, t.stride(), t.storage_offset())
            seen.append(meta == (dt, shape, stride, offset) and torch.equal(t, val))
            return g, None

    class Blk(nn.Linear):
        def forward(self, x):
            h = super().forward(x)
            for t in (
                h.detach() > 0,
                h.detach().long(),
                torch.tensor(3.0) * h.sum().detach(),
                torch.view_as_complex(h.detach().reshape(-1, 2)),
                h.detach()[1:, 3:],
                h.detach()[:1].expand(5, -1),
                h.detach().t(),
            ):
                x = Probe.apply(x, t)
            return x + h

    blocks = nn.ModuleList([Blk(16, 16), Blk(16, 16)])
    off = _both(blocks, torch.randn(6, 16, requires_grad=True))
    assert len(seen) == 28 and all(seen)  # 7 probes x 2 blocks, paged and unpaged
    assert off.stats()["copies_d2h"] > 0
    _clean(off)


# ---- host memory over steps with shared blocks -------------------------------------------------
def test_shared_blocks_reuse_host_buffers_over_steps():
    blocks = nn.ModuleList([_SigmoidInplace(64, inplace=False) for _ in range(2)])
    off = _offloader(list(blocks))
    x = torch.randn(32, 64)
    held = []
    for order in ([0, 1, 0, 1, 0, 1], [1, 0]):  # a new pass at every call of a block again
        allocs = []
        for _ in range(4):
            _run(blocks, x, order).backward()
            _clean(off)
            allocs.append(off.stats()["host_allocations"])
            held.append(off.stats()["host_bytes_held"])
        assert len(set(allocs)) == 1, allocs  # reused each step, never reallocated
    # 6 calls x (input, sigmoid output) of 8 KiB, then 2 calls' worth once the rest idled
    assert held[0] == held[3] == 12 * 8192 and held[-1] == 4 * 8192, held


# ---- exceptions in forward and backward ----------------------------------------------------------
class _Fail(torch.autograd.Function):
    armed = False

    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, g):
        if _Fail.armed:
            raise RuntimeError("boom in backward")
        return g


class _FailBlock(_SigmoidInplace):
    def forward(self, x):
        if getattr(self, "fail_forward", False):
            raise RuntimeError("boom in forward")
        return super().forward(_Fail.apply(x))


def test_exceptions_in_forward_or_backward_leak_nothing_and_next_steps_are_exact():
    torch.manual_seed(0)
    blocks = nn.ModuleList([_FailBlock(inplace=False) for _ in range(3)])
    ref = clone(blocks)
    off = _offloader(list(blocks))
    x = torch.randn(8, 16, requires_grad=True)
    blocks[2].fail_forward = True
    with pytest.raises(RuntimeError, match="boom in forward"):
        _run(blocks, x)  # blocks 0 and 1 paged already
    blocks[2].fail_forward = False
    _clean(off)
    _Fail.armed = True
    with pytest.raises(RuntimeError, match="boom in backward"):
        _run(blocks, x).backward()
    _Fail.armed = False
    _clean(off)
    held = off.stats()["host_bytes_held"]
    for _ in range(2):
        blocks.zero_grad(), ref.zero_grad()
        xr = x.detach().clone().requires_grad_()
        _run(blocks, x).backward()
        _run(ref, xr).backward()
        _assert_same_grads(blocks, ref)
        assert torch.equal(x.grad, xr.grad) and off._stack() == []
        x.grad = None
        _clean(off)
    assert off.stats()["host_bytes_held"] == held
