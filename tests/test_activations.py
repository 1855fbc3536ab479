"""Activation offload on the CPU engine, the mechanism: bit-exact gradients, prefetch order,
layouts, what is (not) paged, dedupe and spans, checkpointing, hooks, validation (the host buffer
pool: test_activation_pool.py; find_blocks and the planner: test_find_blocks_planner.py)."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

import ramstream
from ramstream.activations import ActivationOffloader, find_blocks

from _act_helpers import CPU, _assert_same_grads, _backward_both, _offloader, _spy
from _models import batches, clone, make_model


# ---- bit-exactness ------------------------------------------------------------------------------
@pytest.mark.parametrize("depth", [1, 2])
@pytest.mark.parametrize("paged", ["all", {0}, {1, 2}])
def test_tiny_gpt_gradients_bit_exact_over_steps(depth, paged):
    model = make_model(0, n_blocks=3, d=32)
    ref = clone(model)
    off = _offloader(find_blocks(model), paged, prefetch_depth=depth)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    for x, y in batches(4, b=4, t=16):
        model(x, y).backward()
        ref(x, y).backward()
        _assert_same_grads(model, ref)
        opt.step(), ref_opt.step()
        opt.zero_grad(), ref_opt.zero_grad()
    s = off.stats()
    assert s["copies_d2h"] > 0 and s["copies_h2d"] == s["copies_d2h"]
    assert s["live_entries"] == 0 and s["host_bytes_in_use"] == 0


def _trace(off):
    """Logs ('grad', j) when backward reaches block j's output, ('fetch', j) when block j's saved
    tensors start coming back, ('unpack', j) at block j's first unpack."""
    events = []
    real_grad, real_fetch, real_unpack = off._on_output_grad, off._fetch_call, off._unpack

    def on_grad(call):
        events.append(("grad", call.index))
        real_grad(call)

    def fetch(call):
        if not call.fetched and call.entries:
            events.append(("fetch", call.index))
        real_fetch(call)

    def unpack(x):
        out = real_unpack(x)
        e = getattr(x, "entry", None)
        if e is not None and ("unpack", e.call.index) not in events:
            events.append(("unpack", e.call.index))
        return out

    off._on_output_grad, off._fetch_call, off._unpack = on_grad, fetch, unpack
    return events


@pytest.mark.parametrize("depth", [1, 2, 3])
def test_prefetch_runs_depth_blocks_ahead_of_backward(depth):
    n = 5
    model = make_model(0, n_blocks=n, d=32)
    off = _offloader(find_blocks(model), prefetch_depth=depth)
    ev = _trace(off)
    x, y = batches(1, b=4, t=16)[0]
    model(x, y).backward()
    fetches = [j for kind, j in ev if kind == "fetch"]
    assert fetches == list(range(n - 1, -1, -1))  # each block once, in backward order
    for j in range(n):
        # block j starts coming back when backward reaches block j + depth's output (or the last
        # block's, at the start), so before it reaches the next block's
        trigger = min(n - 1, j + depth)
        assert ev.index(("grad", trigger)) < ev.index(("fetch", j)) < ev.index(("unpack", j))
        if trigger - 1 >= j:
            assert ev.index(("fetch", j)) < ev.index(("grad", trigger - 1)), ev


def test_prefetch_looks_across_unpaged_blocks():
    model = make_model(0, n_blocks=4, d=32)
    off = _offloader(find_blocks(model), paged={0, 1}, prefetch_depth=1)
    ev = _trace(off)
    x, y = batches(1, b=4, t=16)[0]
    model(x, y).backward()
    # block 1 (the last paged one) starts coming back when backward reaches block 3's output,
    # so blocks 3 and 2 compute while it copies
    assert ev.index(("grad", 3)) < ev.index(("fetch", 1)) < ev.index(("grad", 2))
    assert ev.index(("fetch", 0)) < ev.index(("grad", 0))


class _LayoutProbe(torch.autograd.Function):
    """Multiplies by 2; saves its input and checks in backward that the saved tensor came back
    with the forward's dtype, size, stride, storage offset and 64-byte alignment."""

    @staticmethod
    def forward(ctx, x, log):
        ctx.save_for_backward(x)
        ctx.meta = (x.dtype, tuple(x.shape), x.stride(), x.storage_offset(), x.data_ptr() % 64)
        ctx.log = log
        return x * 2

    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        ctx.log.append(
            (ctx.meta, (x.dtype, tuple(x.shape), x.stride(), x.storage_offset(), x.data_ptr() % 64))
        )
        return g * 2, None


class _StridedBlock(nn.Module):
    """Saved tensors that are transposes, channels_last conv activations, slices and views."""

    def __init__(self, c: int = 8, log=None) -> None:
        super().__init__()
        self.conv = nn.Conv2d(c, c, 3, padding=1)
        self.lin = nn.Linear(c, c)
        self.log = log if log is not None else []

    def forward(self, x):  # x: [B, C, H, W] channels_last
        y = F.gelu(self.conv(x))
        y = _LayoutProbe.apply(y, self.log)  # channels_last saved tensor
        t = y.transpose(2, 3)  # non-contiguous view
        z = _LayoutProbe.apply(t, self.log)
        s = z[:, :, 1:, 2:]  # offset view
        s = _LayoutProbe.apply(s, self.log)
        u = self.lin(s.permute(0, 2, 3, 1))  # matmul on a permuted view
        return x + F.pad(u.permute(0, 3, 1, 2), (2, 0, 1, 0)).transpose(2, 3)


def test_layouts_come_back_exactly_and_grads_bit_exact():
    torch.manual_seed(0)
    log: list = []
    blocks = nn.Sequential(_StridedBlock(log=log), _StridedBlock(log=log))
    blocks = blocks.to(memory_format=torch.channels_last)
    ref = clone(blocks)
    ref_log: list = []
    for b in ref:
        b.log = ref_log
    x = torch.randn(2, 8, 12, 12).to(memory_format=torch.channels_last).requires_grad_()
    xr = x.detach().clone().requires_grad_()
    off = _offloader(list(blocks))
    spy = _spy(off)
    blocks(x).square().sum().backward()
    ref(xr).square().sum().backward()
    _assert_same_grads(blocks, ref)
    assert torch.equal(x.grad, xr.grad)
    assert len(log) == 6 and spy
    for before, after in log:
        assert before == after
    assert log[0][0][2][1] == 1  # the first probe saw channels_last (C stride 1)
    assert off.stats()["copies_d2h"] > 0


def test_saved_storage_is_released_in_forward_and_restored_in_backward():
    torch.manual_seed(0)
    refs = []

    class Blk(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(64, 256)

        def forward(self, x):
            h = self.fc(x)
            refs.append(weakref.ref(h.untyped_storage()))
            return F.gelu(h).sum(-1, keepdim=True) + x

    blocks = nn.ModuleList([Blk(), Blk()])
    x = torch.randn(32, 64, requires_grad=True)

    def run():
        y = x
        for b in blocks:
            y = b(y)
        return y.sum()

    loss = run()  # unpaged: gelu keeps h alive
    gc.collect()
    assert all(r() is not None for r in refs)
    loss.backward()
    refs.clear()
    off = _offloader(list(blocks))
    loss = run()  # paged: h's storage died after its copy
    gc.collect()
    assert len(refs) == 2 and all(r() is None for r in refs)
    loss.backward()
    assert off.stats()["live_entries"] == 0


# ---- what is not paged ---------------------------------------------------------------------------
class _ParamViews(nn.Module):
    """Saves its parameters and views of them (transpose, slice) in matmuls."""

    def __init__(self, d=64) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(d, d) / d)
        self.v = nn.Parameter(torch.randn(d, 2 * d) / d)
        self.register_buffer("scale", torch.linspace(0.5, 1.5, d))

    def forward(self, x):
        x = x @ self.w.t()
        x = x @ self.v[:, : x.shape[-1]] * self.scale
        return torch.tanh(x)


def test_parameters_views_of_parameters_and_buffers_are_never_paged():
    torch.manual_seed(0)
    blocks = nn.ModuleList([_ParamViews(), _ParamViews()])
    ref = clone(blocks)
    off = _offloader(list(blocks))
    spy = _spy(off)
    x = torch.randn(16, 64, requires_grad=True)
    xr = _backward_both(blocks, ref, x)
    assert torch.equal(x.grad, xr.grad)
    persistent = {t.untyped_storage().data_ptr() for t in list(blocks.parameters()) + list(blocks.buffers())}
    assert spy, "activations should reach the paging decision"
    assert not {ptr for _, ptr, _ in spy} & persistent


def test_parameters_of_a_wrapped_model_are_not_paged_and_training_matches_torch():
    model = make_model(0, n_blocks=3, d=32)
    ref = clone(model)
    data = batches(3, b=4, t=16)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, foreach=False)
    model, opt = ramstream.wrap(model, torch.optim.AdamW(model.parameters(), lr=1e-2))
    off = _offloader(find_blocks(model))
    spy = _spy(off)
    for x, y in data:
        model(x, y).backward()
        ref(x, y).backward()
        opt.step(), ref_opt.step()
        opt.zero_grad(), ref_opt.zero_grad()
    opt.synchronize()
    persistent = {p.untyped_storage().data_ptr() for p in model.parameters()}
    assert spy and not {ptr for _, ptr, _ in spy} & persistent
    for pa, pb in zip(model.parameters(), ref.parameters()):
        assert (pa.detach() - pb.detach()).abs().max().item() < 1e-6
    ramstream.unwrap(model)


def test_small_tensors_stay_min_offload_bytes():
    model = make_model(0, n_blocks=2, d=32)
    x, y = batches(1, b=4, t=16)[0]
    off = _offloader(find_blocks(model), min_offload_bytes=4 * 16 * 128 * 4)  # fc1's output
    spy = _spy(off)
    model(x, y).backward()
    assert spy and all(n >= 4 * 16 * 128 * 4 for _, _, n in spy)
    off.min_offload_bytes = 1 << 30
    spy.clear()
    model(x, y).backward()
    assert not spy


def test_nothing_paged_under_no_grad_eval_or_inference_mode():
    model = make_model(0, n_blocks=2, d=32)
    x, y = batches(1, b=4, t=16)[0]
    off = _offloader(find_blocks(model))
    with torch.no_grad():
        model(x, y)
    with torch.inference_mode():
        model(x, y)
    model.eval()
    model(x, y).backward()
    assert off.stats()["copies_d2h"] == 0
    model.train()
    model(x, y).backward()
    assert off.stats()["copies_d2h"] > 0


def test_unpaged_blocks_untouched_and_measuring_counts_their_bytes():
    model = make_model(0, n_blocks=3, d=32)
    x, y = batches(1, b=4, t=16)[0]
    off = _offloader(find_blocks(model), paged={1})
    spy = _spy(off)
    model(x, y).backward()
    assert spy and {i for i, _, _ in spy} == {1}
    paged = off.stats()["block_bytes"][1]
    assert paged > 0 and off.stats()["bytes_paged_last_pass"] == paged
    off.set_measuring(True)
    model(x, y).backward()
    s = off.stats()
    assert s["block_bytes"] == [paged] * 3  # identical blocks, identical bytes
    assert s["bytes_paged_last_pass"] == paged  # only block 1 copied


# ---- dedupe, spans -------------------------------------------------------------------------------
def test_same_storage_saved_twice_in_a_block_is_copied_once():
    class Sq(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(32, 128)  # h: [64, 128] = 32 KiB; x: 8 KiB stays

        def forward(self, x):
            h = self.fc(x)
            a, b = h.chunk(2, -1)  # two views of one storage
            return (h * h).sum(-1, keepdim=True) + (a * b)[:, :1] + x

    torch.manual_seed(0)
    blocks = nn.ModuleList([Sq(), Sq()])
    ref = clone(blocks)
    off = _offloader(list(blocks), min_offload_bytes=16 * 1024)
    x = torch.randn(64, 32, requires_grad=True)
    _backward_both(blocks, ref, x)
    # per block: h (saved 2x by h*h, and as a, b) -> one copy of its storage
    s = off.stats()
    assert s["copies_d2h"] == 2 and s["bytes_d2h"] == 2 * 64 * 128 * 4


def test_small_view_of_a_large_storage_copies_its_span_only():
    class Tail(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(16, 4096)

        def forward(self, x):
            h = self.fc(x)  # [8, 4096]: 128 KiB
            return torch.sin(h[6:, 1000:3000]).sum() + x  # sin saves its input: a tail view

    torch.manual_seed(0)
    blocks = nn.ModuleList([Tail(), Tail()])
    ref = clone(blocks)
    off = _offloader(list(blocks), min_offload_bytes=8 * 1024)
    x = torch.randn(8, 16, requires_grad=True)
    _backward_both(blocks, ref, x)
    s = off.stats()
    # the view's span (row 6 col 1000 .. row 7 col 2999) is < half its storage: copied from the
    # 512-byte boundary below its start to its end
    span = (4096 + 2000) * 4
    assert s["copies_d2h"] == 2 and span * 2 <= s["bytes_d2h"] <= 2 * (span + 512)


def test_retain_graph_backward_twice_matches_torch():
    model = make_model(0, n_blocks=2, d=32)
    ref = clone(model)
    off = _offloader(find_blocks(model))
    x, y = batches(1, b=4, t=16)[0]
    loss, rloss = model(x, y), ref(x, y)
    loss.backward(retain_graph=True)
    rloss.backward(retain_graph=True)
    loss.backward()
    rloss.backward()
    _assert_same_grads(model, ref)
    del loss
    gc.collect()
    assert off.stats()["live_entries"] == 0


def test_two_forwards_one_backward():
    model = make_model(0, n_blocks=3, d=32)
    ref = clone(model)
    off = _offloader(find_blocks(model), prefetch_depth=2)
    (x1, y1), (x2, y2) = batches(2, b=4, t=16)
    (model(x1, y1) + model(x2, y2)).backward()
    (ref(x1, y1) + ref(x2, y2)).backward()
    _assert_same_grads(model, ref)
    assert off.stats()["live_entries"] == 0


# ---- checkpointing, exceptions, detach -----------------------------------------------------------
class _CkptBlock(nn.Module):
    def __init__(self, d=32):
        super().__init__()
        self.ln = nn.LayerNorm(d)
        self.fc1, self.fc2 = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def _mlp(self, h):
        return self.fc2(F.gelu(self.fc1(h)))

    def forward(self, x):
        return x + checkpoint(self._mlp, self.ln(x), use_reentrant=False)


class _CkptModel(nn.Module):
    def __init__(self, outer: bool, n=3, d=32):
        super().__init__()
        self.outer = outer
        self.blocks = nn.ModuleList(_CkptBlock(d) for _ in range(n))

    def forward(self, x):
        for b in self.blocks:
            x = checkpoint(b, x, use_reentrant=False) if self.outer else b(x)
        return x.square().mean()


@pytest.mark.parametrize("outer", [False, True])
def test_checkpoint_non_reentrant(outer):
    torch.manual_seed(0)
    model = _CkptModel(outer)
    ref = clone(model)
    off = _offloader(list(model.blocks))
    for _ in range(2):
        x = torch.randn(4, 16, 32)
        model(x).backward()
        ref(x).backward()
        _assert_same_grads(model, ref)
    s = off.stats()
    if outer:  # the block runs under checkpoint's hooks: they own its tensors
        assert s["copies_d2h"] == 0
    else:  # ln's input and the checkpointed function's input are paged
        assert s["copies_d2h"] > 0 and s["copies_h2d"] == s["copies_d2h"]
    assert s["live_entries"] == 0


def test_exception_in_a_block_leaves_no_hooks_behind():
    class Boom(nn.Linear):
        def forward(self, x):
            y = super().forward(x)
            if self.fail:
                raise RuntimeError("boom")
            return y

    blocks = nn.ModuleList([Boom(8, 8), Boom(8, 8)])
    for b in blocks:
        b.fail = False
    blocks[1].fail = True
    off = _offloader(list(blocks))
    x = torch.randn(4, 8, requires_grad=True)
    with pytest.raises(RuntimeError, match="boom"):
        blocks[1](blocks[0](x))
    assert torch._C._autograd._top_saved_tensors_default_hooks(False) is None
    assert off._stack() == []


def test_detach_restores_the_modules():
    model = make_model(0, n_blocks=2, d=32)
    blocks = find_blocks(model)
    before = [(len(b._forward_pre_hooks), len(b._forward_hooks)) for b in blocks]
    off = _offloader(blocks)
    x, y = batches(1, b=4, t=16)[0]
    loss = model(x, y)  # built while attached
    off.detach()
    assert [(len(b._forward_pre_hooks), len(b._forward_hooks)) for b in blocks] == before
    loss.backward()  # still unpacks
    n = off.stats()["copies_d2h"]
    model(x, y).backward()
    assert off.stats()["copies_d2h"] == n and off.stats()["host_bytes_held"] == 0
    off.attach()
    model(x, y).backward()
    assert off.stats()["copies_d2h"] > n


def test_constructor_and_set_paged_validation():
    blocks = find_blocks(make_model(0, n_blocks=2))
    with pytest.raises(ValueError, match="prefetch_depth"):
        ActivationOffloader(blocks, CPU, prefetch_depth=0)
    with pytest.raises(ValueError, match="min_offload_bytes"):
        ActivationOffloader(blocks, CPU, min_offload_bytes=-1)
    with pytest.raises(ValueError, match="d2h_lag"):
        ActivationOffloader(blocks, CPU, d2h_lag=0)
    with pytest.raises(ValueError, match="blocks"):
        ActivationOffloader([], CPU)
    with pytest.raises(ValueError, match="twice"):
        ActivationOffloader([blocks[0], blocks[0]], CPU)
    with pytest.raises(ValueError, match="device"):
        ActivationOffloader(blocks, "meta")
    off = ActivationOffloader(blocks, CPU)
    with pytest.raises(ValueError, match="indices"):
        off.set_paged({2})
    with pytest.raises(ValueError, match="indices"):
        off.set_paged({True})
    events = []
    off = ActivationOffloader(blocks, CPU, log=events.append)
    off.set_paged({0, 1})
    assert off.paged == [0, 1] and "0-1" in events[-1]
