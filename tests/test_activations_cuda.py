"""Activation offload and the chunked loss on a GPU: bit-exact gradients with prefetch depths 1, 2
(over varied batches and weights, with reused buffers poisoned), saved-tensor layouts under the
SDPA backends, measured VRAM reduction, nothing paged under no_grad, pinned buffers reused and
given back, chunked loss peak memory against the dense loss. Every stream wait is shown needed:
with it removed (buffers._TEST_SKIP_WAIT) and the stream it orders delayed, gradients go wrong."""

from __future__ import annotations

import copy
import time

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

import ramstream
from ramstream.activations import ActivationOffloader, buffers, find_blocks
from ramstream.activations.buffers import SKIPPABLE_WAITS, Saved

pytestmark = pytest.mark.cuda


def _dev():
    return torch.device("cuda", torch.cuda.current_device())


class Block(nn.Module):
    """Pre-norm GPT block with SDPA attention (q, k, v are strided views of one qkv output)."""

    def __init__(self, d: int, heads: int, ckpt: bool = False) -> None:
        super().__init__()
        self.heads, self.ckpt = heads, ckpt
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.fc, self.out = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def _mlp(self, x):
        return self.out(F.gelu(self.fc(self.ln2(x)), approximate="tanh"))

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.heads, d // self.heads).unbind(2)
        a = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True
        )
        x = x + self.proj(a.transpose(1, 2).reshape(b, t, d))
        if self.ckpt:
            return x + checkpoint(self._mlp, x, use_reentrant=False)
        return x + self._mlp(x)


class GPT(nn.Module):
    def __init__(self, vocab=512, d=256, layers=6, heads=4, ctx=512, ckpt=False) -> None:
        super().__init__()
        self.wte, self.wpe = nn.Embedding(vocab, d), nn.Embedding(ctx, d)
        self.layers = nn.ModuleList(Block(d, heads, ckpt) for _ in range(layers))
        self.ln_f = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)

    def forward(self, idx, targets):
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1], device=idx.device))
        for blk in self.layers:
            x = blk(x)
        return ramstream.causal_lm_loss(self.ln_f(x), self.head.weight, targets, chunk_size=512)


def _model(seed=0, **kw):
    torch.manual_seed(seed)
    return GPT(**kw).to(_dev())


def _data(b=4, t=256, vocab=512, seed=1):
    g = torch.Generator().manual_seed(seed)
    return (
        torch.randint(0, vocab, (b, t), generator=g).to(_dev()),
        torch.randint(0, vocab, (b, t), generator=g).to(_dev()),
    )


def _grads(model, x, y, autocast, before_backward=None):
    model.zero_grad(set_to_none=True)
    with torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast):
        loss = model(x, y)
    if before_backward is not None:
        before_backward()
    loss.backward()
    torch.cuda.synchronize()
    return loss.detach(), [p.grad.clone() for p in model.parameters()]


def _offloader(model, depth=1, min_bytes=64 << 10):
    off = ActivationOffloader(
        find_blocks(model), _dev(), prefetch_depth=depth, min_offload_bytes=min_bytes
    ).attach()
    off.set_paged(range(len(off.blocks)))
    return off


def _layout_spy(off):
    """Checks every unpacked tensor against the tensor packed: dtype, size, stride, storage
    offset and address modulo 512. Returns the list of (packed, unpacked) metadata tuples."""
    log, meta = [], {}
    real_pack, real_unpack = off._pack, off._unpack

    def key(t):
        return (t.dtype, tuple(t.shape), t.stride(), t.storage_offset(), t.data_ptr() % 512)

    def pack(t, call, paged):
        h = real_pack(t, call, paged)
        if type(h) is Saved:  # paged (a Kept tensor stays on the device)
            meta[id(h)] = key(t)
        return h

    def unpack(h):
        out = real_unpack(h)
        if id(h) in meta:
            log.append((meta[id(h)], key(out)))
        return out

    off._pack, off._unpack = pack, unpack
    return log


@pytest.fixture
def poison(monkeypatch):
    """Every host buffer handed out and every device buffer an H2D lands in starts as NaN bytes:
    a copy read before it ran, or never run, cannot give the right values by chance."""
    monkeypatch.setattr(buffers, "_TEST_POISON", True)


def _train_both(model, ref, steps, autocast, exact, before_backward=None):
    """`steps` SGD steps of `model` (paged) and `ref` (its unpaged copy), each on a new batch:
    equal losses and gradients at every step, so both take the same step (the weights change)."""
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=1e-2)
    for i in range(steps):
        x, y = _data(seed=10 + i)
        loss_r, gr = _grads(ref, x, y, autocast)
        loss_m, gm = _grads(model, x, y, autocast, before_backward)
        if exact:
            assert torch.equal(loss_m, loss_r), i
        _assert_grads(gm, gr, exact)
        opt.step(), ref_opt.step()


def _reproducible(model, x, y, autocast):
    _, a = _grads(model, x, y, autocast)
    _, b = _grads(model, x, y, autocast)
    return all(torch.equal(u, v) for u, v in zip(a, b))


def _assert_grads(ga, gb, exact):
    for a, b in zip(ga, gb):
        if exact:
            assert torch.equal(a, b), (a - b).abs().max().item()
        else:
            assert ((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30)) < 1e-3


@pytest.mark.parametrize("depth", [1, 2])
@pytest.mark.parametrize("autocast", [False, True])
def test_bit_exact_gradients_prefetch_depth(depth, autocast, poison):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    model = _model()
    ref = copy.deepcopy(model)
    with sdpa_kernel(SDPBackend.MATH):  # deterministic attention backward
        assert _reproducible(model, *_data(), autocast)
        off = _offloader(model, depth)
        spy = _layout_spy(off)
        _train_both(model, ref, 4, autocast, exact=True)
    s = off.stats()
    assert s["copies_d2h"] > 0 and s["copies_h2d"] == s["copies_d2h"] and s["live_entries"] == 0
    assert s["host_reuses"] > 0  # later steps ran in reused (poisoned) buffers
    assert spy and all(a == b for a, b in spy)
    off.detach()


@pytest.mark.parametrize("backend", ["EFFICIENT_ATTENTION", "CUDNN_ATTENTION", "MATH"])
def test_sdpa_backends_layout_preserved(backend):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    model = _model(d=256, heads=4, layers=3)
    x, y = _data()
    with sdpa_kernel(getattr(SDPBackend, backend)):
        try:
            _, ref = _grads(model, x, y, True)
        except RuntimeError as e:
            pytest.skip(f"{backend} unavailable for this shape/GPU: {str(e)[:200]}")
        exact = _reproducible(model, x, y, True)
        off = _offloader(model, depth=2)
        spy = _layout_spy(off)
        _, got = _grads(model, x, y, True)
    off.detach()
    assert len(spy) > 0
    if backend != "MATH":  # the fused kernels save q, k, v themselves: strided views of qkv
        strided = [
            a for a, _ in spy if len(a[1]) == 4 and a[2] != tuple(torch.empty(a[1], device="meta").stride())
        ]
        assert strided, "expected q/k/v saved as non-contiguous views"
    for before, after in spy:
        assert before == after
    _assert_grads(got, ref, exact)


def test_checkpoint_inside_blocks_bit_exact():
    from torch.nn.attention import SDPBackend, sdpa_kernel

    model = _model(ckpt=True)
    x, y = _data()
    with sdpa_kernel(SDPBackend.MATH):
        _, ref = _grads(model, x, y, True)
        off = _offloader(model)
        _, got = _grads(model, x, y, True)
    _assert_grads(got, ref, exact=True)
    assert off.stats()["copies_d2h"] > 0
    off.detach()


def _after_forward_and_peak(model, x, y, off=None):
    """(bytes allocated after forward, peak over the step, seconds the step took)."""
    dev = _dev()
    model.zero_grad(set_to_none=True)
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    base = torch.cuda.memory_allocated(dev)
    torch.cuda.reset_peak_memory_stats(dev)
    t0 = time.perf_counter()
    with torch.autocast("cuda", dtype=torch.bfloat16):
        loss = model(x, y)
    torch.cuda.synchronize()
    torch.cuda.empty_cache()  # processes the copy streams' deferred frees
    after_fwd = torch.cuda.memory_allocated(dev) - base
    loss.backward()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated(dev) - base
    return after_fwd, peak, time.perf_counter() - t0


def test_measured_vram_reduction():
    model = _model(d=512, heads=8, layers=8)
    x, y = _data(b=8, t=512)
    fwd0, peak0, _ = _after_forward_and_peak(model, x, y)
    off = _offloader(model, depth=1)
    fwd1, peak1, wall = _after_forward_and_peak(model, x, y, off)
    st = off.stats()
    paged = st["bytes_paged_last_pass"]
    print(
        f"\nactivations after forward: {fwd0 / 2**20:.1f} -> {fwd1 / 2**20:.1f} MiB; "
        f"peak over the step: {peak0 / 2**20:.1f} -> {peak1 / 2**20:.1f} MiB; "
        f"paged {paged / 2**20:.1f} MiB; GPU waited {st['h2d_stall_s'] * 1e3:.2f} ms for H2D"
    )
    # GPU time spent waiting within one step cannot exceed the step (a counter in the wrong
    # unit or counted twice would); that it measures the wait: test_h2d_stall_is_the_gpu_wait
    assert 0.0 <= st["h2d_stall_s"] <= wall
    assert paged > 0
    assert fwd0 - fwd1 >= 0.8 * paged
    assert peak1 <= 0.6 * peak0
    off.detach()


def test_no_offload_under_no_grad_or_eval():
    model = _model()
    x, y = _data()
    off = _offloader(model)
    with torch.no_grad():
        model(x, y)
    model.eval()
    model(x, y).backward()
    model.train()
    torch.cuda.synchronize()
    s = off.stats()
    assert s["copies_d2h"] == 0 and s["host_bytes_held"] == 0
    model(x, y).backward()
    assert off.stats()["copies_d2h"] > 0
    off.detach()


def test_pinned_buffers_reused_no_host_growth():
    model = _model()
    x, y = _data()
    off = _offloader(model, depth=2)
    held, arena = [], []
    for _ in range(50):
        model.zero_grad(set_to_none=True)
        model(x, y).backward()
        torch.cuda.synchronize()
        held.append(off.stats()["host_bytes_held"])
        arena.append(ramstream.memory_stats()["bytes_in_use"])
    s = off.stats()
    assert held[0] > 0 and len(set(held)) == 1 and len(set(arena[1:])) == 1
    assert s["host_allocations"] * 50 == s["copies_d2h"] and s["live_entries"] == 0
    off.detach()


def test_graph_dropped_without_backward_releases_buffers():
    model = _model()
    x, y = _data()
    off = _offloader(model)
    loss = model(x, y)
    assert off.stats()["live_entries"] > 0
    del loss
    assert off.stats()["live_entries"] == 0 and off.stats()["host_bytes_in_use"] == 0
    off.detach()


# ---- chunked loss --------------------------------------------------------------------------------
def _loss_peak(fn, h, w, t, autocast):
    dev = _dev()
    h.grad = w.grad = None
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    base = torch.cuda.memory_allocated(dev)
    torch.cuda.reset_peak_memory_stats(dev)
    with torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast):
        loss = fn(h, w, t)
    loss.backward()
    torch.cuda.synchronize()
    return loss.item(), torch.cuda.max_memory_allocated(dev) - base, h.grad.clone(), w.grad.clone()


@pytest.mark.parametrize("autocast", [False, True])
def test_chunked_loss_peak_below_quarter_of_dense_4096x50000(autocast):
    g = torch.Generator(device=_dev()).manual_seed(0)
    n, d, v = 4096, 1024, 50000
    h = torch.randn(n, d, device=_dev(), generator=g).requires_grad_()
    w = (torch.randn(v, d, device=_dev(), generator=g) * 0.02).requires_grad_()
    t = torch.randint(0, v, (n,), device=_dev(), generator=g)
    t[::9] = -100

    def dense(h, w, t):
        return F.cross_entropy(F.linear(h, w).float(), t)

    def chunked(h, w, t):
        return ramstream.chunked_cross_entropy(h, w, t)

    ld, pd, ghd, gwd = _loss_peak(dense, h, w, t, autocast)
    lc, pc, ghc, gwc = _loss_peak(chunked, h, w, t, autocast)
    print(
        f"\nautocast={autocast}: dense peak {pd / 2**20:.0f} MiB, chunked {pc / 2**20:.0f} MiB "
        f"({pc / pd:.3f})"
    )
    assert pc < pd / 4
    tol = 2e-2 if autocast else 1e-5
    assert abs(lc - ld) <= tol * abs(ld)
    for a, b in ((ghc, ghd), (gwc, gwd)):
        if autocast:
            assert ((a - b).norm() / b.norm()).item() <= 2e-2
        else:
            # fp32 sums over 4096 rows in another order (chunks vs one GEMM): compare norms
            assert ((a - b).norm() / b.norm()).item() <= 1e-5


def test_copy_stream_overlap_does_not_change_results(poison):
    """A slow compute stream (big matmuls queued before the block) must not let the D2H copy read
    the activation before it is written, nor the allocator reuse it before the copy ran; each step
    runs a new batch on weights the step before changed, in poisoned reused buffers."""
    model = _model(layers=4)
    ref_model = copy.deepcopy(model)
    off = _offloader(model, depth=1)
    big = [torch.randn(4096, 4096, device=_dev())]

    def busy():
        for _ in range(20):
            big[0] = torch.tanh(big[0] @ big[0]) * 0.01  # keeps the GPU busy, forward queued

    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    ref_opt = torch.optim.SGD(ref_model.parameters(), lr=1e-2)
    for i in range(3):
        x, y = _data(seed=20 + i)
        _, ref = _grads(ref_model, x, y, True)
        busy()
        _, got = _grads(model, x, y, True)
        for a, b in zip(got, ref):
            assert ((a.float() - b.float()).norm() / b.float().norm()).item() < 1e-3
        opt.step(), ref_opt.step()
    assert off.stats()["host_reuses"] > 0
    off.detach()


# ---- every wait is needed: remove one, delay the stream it orders, the gradients go wrong -------
_SLEEP_CYCLES = 200_000_000  # torch.cuda._sleep: ~0.1 s at 2 GHz, far longer than a copy


def _delay(stream):
    """Queues a GPU spin of _SLEEP_CYCLES on `stream`; returns its (start, end) timing events."""
    ev = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    with torch.cuda.stream(stream):
        ev[0].record(stream)
        torch.cuda._sleep(_SLEEP_CYCLES)
        ev[1].record(stream)
    return ev


def _delayed_run(wait, skip, monkeypatch):
    """Two steps on new batches of a paged model against its unpaged copy, with the stream that
    `wait` orders delayed: the H2D stream before backward (compute_after_h2d), the D2H stream
    before the last block's copies (h2d_after_d2h: backward fetches them at once), the compute
    stream before the last block's kernels (d2h_after_compute). With `skip`, that one wait is
    left out. Returns (the steps whose gradients equal the reference's, the offloader's stats,
    the delays' timing events)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    monkeypatch.setattr(buffers, "_TEST_POISON", True)
    monkeypatch.setattr(buffers, "_TEST_SKIP_WAIT", wait if skip else None)
    model = _model(layers=3)
    ref = copy.deepcopy(model)
    off = _offloader(model)
    delays = []
    before_backward = None
    if wait == "compute_after_h2d":

        def before_backward():
            delays.append(_delay(off._copies.h2d))
    else:

        def pre(m, args):
            stream = off._copies.d2h if wait == "h2d_after_d2h" else torch.cuda.current_stream()
            delays.append(_delay(stream))

        model.layers[-1].register_forward_pre_hook(pre)  # runs after the offloader's pre-hook
    right = []
    with sdpa_kernel(SDPBackend.MATH):
        for i in range(2):
            x, y = _data(seed=30 + i)
            _, want = _grads(ref, x, y, False)
            _, got = _grads(model, x, y, False, before_backward)
            right.append(all(torch.equal(a, b) for a, b in zip(got, want)))
    torch.cuda.synchronize()
    st = off.stats()
    off.detach()
    buffers._TEST_SKIP_WAIT = None
    return right, st, delays


@pytest.mark.parametrize("wait", SKIPPABLE_WAITS)
def test_every_wait_is_needed(wait, monkeypatch):
    right, _, delays = _delayed_run(wait, False, monkeypatch)
    assert len(delays) == 2 and right == [True, True]  # with the wait: exact, delay or not
    right, _, _ = _delayed_run(wait, True, monkeypatch)
    assert right != [True, True], f"without the {wait} wait the gradients should be wrong"


def test_h2d_stall_is_the_gpu_wait(monkeypatch):
    """h2d_stall_s is the GPU time compute waited for H2D copies: about the H2D stream's delay with
    the wait, about nothing without it."""
    _, st, delays = _delayed_run("compute_after_h2d", False, monkeypatch)
    slept = sum(a.elapsed_time(b) for a, b in delays) / 1e3
    assert 0.5 * slept <= st["h2d_stall_s"] <= slept + 0.05, (st["h2d_stall_s"], slept)
    _, st, _ = _delayed_run("compute_after_h2d", True, monkeypatch)
    assert st["h2d_stall_s"] < 0.1 * slept, (st["h2d_stall_s"], slept)


def _large_batch_then_small(model, off):
    """Three small steps, one 16x larger, three small: (pool bytes small, pool bytes large, arena
    pinned bytes after the large one)."""
    for i in range(3):
        _grads(model, *_data(b=2, seed=40 + i), False)
    need = off.stats()["host_bytes_held"]
    torch.cuda.synchronize()
    _grads(model, *_data(b=32, seed=50), False)
    big = off.stats()["host_bytes_held"]
    pinned_big = ramstream.memory_stats()["bytes_pinned"]
    for i in range(3):
        _grads(model, *_data(b=2, seed=60 + i), False)
    return need, big, pinned_big


def test_pinned_pool_gives_memory_back_after_a_large_batch():
    model = _model(layers=3)
    off = _offloader(model)
    need, big, pinned_big = _large_batch_then_small(model, off)
    assert big > 8 * need
    s = off.stats()
    assert s["host_bytes_held"] == need and s["host_trims"] >= 1
    assert ramstream.memory_stats()["bytes_pinned"] < pinned_big  # some went back to the driver
    off.detach()


@pytest.mark.cuda
def test_pinned_pool_large_batch_reaches_the_driver_in_full():
    model = _model(layers=3)
    off = _offloader(model)
    try:  # the large batch's pinned memory went back to the driver, not just to the arena's cache:
        # its buffers (>= 256 KiB here) have their own pages, which no slab keeps pinned
        need, big, pinned_big = _large_batch_then_small(model, off)
        given_back = pinned_big - ramstream.memory_stats()["bytes_pinned"]
        assert given_back >= 0.95 * (big - need), (given_back, big, need)
    finally:
        off.detach()
