"""Activation offload on the CPU engine, the host side: the buffer pool's reuse, growth and
give-back after a large batch, graphs dropped without backward, poisoned buffers (the test-only
NaN fill), and the waits on copies and compute (with fake events)."""

from __future__ import annotations

import gc
import re

import pytest
import torch

from ramstream.activations import buffers, find_blocks

from _act_helpers import _assert_same_grads, _offloader
from _models import batches, clone, make_model


# ---- host buffer pool ----------------------------------------------------------------------------
def test_pool_reused_and_host_memory_flat_over_50_steps():
    model = make_model(0, n_blocks=3, d=32)
    off = _offloader(find_blocks(model))
    data = batches(2, b=4, t=16)
    held = []
    for step in range(50):
        x, y = data[step % 2]
        model(x, y).backward()
        model.zero_grad(set_to_none=True)
        s = off.stats()
        held.append(s["host_bytes_held"])
        assert s["host_bytes_in_use"] == 0 and s["live_entries"] == 0
    s = off.stats()
    assert held[0] > 0 and len(set(held)) == 1
    assert s["host_allocations"] == s["copies_d2h"] // 50
    assert s["host_reuses"] == s["copies_d2h"] - s["host_allocations"]
    assert s["host_bytes_peak"] == held[0]


def test_pool_gives_back_buffers_idle_for_two_passes():
    model = make_model(0, n_blocks=3, d=32)
    off = _offloader(find_blocks(model))
    x, y = batches(1, b=4, t=16)[0]
    model(x, y).backward()
    all_held = off.stats()["host_bytes_held"]
    off.set_paged({0})
    held = []
    for _ in range(4):
        model(x, y).backward()
        held.append(off.stats()["host_bytes_held"])
    assert held[0] == held[1] == all_held  # kept while they may come back
    assert 0 < held[3] < all_held / 2  # then block 0's buffers only
    assert held[3] >= off.stats()["block_bytes"][0]  # (size classes round up)


def test_graph_dropped_without_backward_releases_buffers():
    model = make_model(0, n_blocks=3, d=32)
    off = _offloader(find_blocks(model))
    x, y = batches(1, b=4, t=16)[0]
    loss = model(x, y)
    assert off.stats()["live_entries"] > 0 and off.stats()["host_bytes_in_use"] > 0
    del loss
    gc.collect()
    s = off.stats()
    assert s["live_entries"] == 0 and s["host_bytes_in_use"] == 0
    model(x, y).backward()  # buffers are reused
    assert off.stats()["host_allocations"] == s["host_allocations"]


def _train(model, ref, data, off):
    """One SGD step per batch on `model` (paged) and `ref` (its unpaged clone): bit-equal
    gradients at every step; returns host_bytes_held after each step."""
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    held = []
    for x, y in data:
        model(x, y).backward()
        ref(x, y).backward()
        _assert_same_grads(model, ref)
        opt.step(), ref_opt.step()
        opt.zero_grad(set_to_none=True), ref_opt.zero_grad(set_to_none=True)
        held.append(off.stats()["host_bytes_held"])
    return held


def _small_need(n_blocks=3, b=2):
    """host_bytes_held of a fresh offloader after one step at the small batch (what it needs)."""
    model = make_model(0, n_blocks=n_blocks, d=32)
    off = _offloader(find_blocks(model))
    x, y = batches(1, b=b, t=16, seed=9)[0]
    model(x, y).backward()
    s = off.stats()
    return s["host_bytes_held"], s["bytes_paged_last_pass"], s["copies_d2h"]


@pytest.mark.parametrize("window", [1, 2, 4])
def test_pool_shrinks_after_a_large_batch_to_what_small_batches_need(window):
    model = make_model(0, n_blocks=3, d=32)
    ref = clone(model)
    off = _offloader(find_blocks(model), pool_window=window)
    big = batches(1, b=32, t=16, seed=3)
    small = batches(window + 3, b=2, t=16, seed=4)
    big_held = _train(model, ref, big, off)[0]
    held = _train(model, ref, small, off)
    need, paged, copies = _small_need()
    s = off.stats()
    assert need * 8 < big_held
    # the pool holds at most the most in use over the last `window` steps: the large batch's
    # bytes for `window` steps (its oldest buffers go first), then what one small step uses: its
    # saved bytes rounded up to size classes (<= 12.5 % or 4 KiB per buffer)
    assert big_held < held[0] <= big_held + need
    assert all(need < h <= big_held for h in held[1:window]), (held, big_held)
    assert held[window:] == [need] * 3, (held, need)
    assert need <= paged * 1.125 + 4096 * copies
    assert s["host_bytes_high_water"] == need and s["host_bytes_in_use"] == 0
    assert s["host_bytes_given_back"] == s["host_bytes_peak"] - need
    assert s["host_trims"] == 0  # the CPU pool has no arena cache to trim


def test_a_pinned_pool_releases_its_dropped_buffers_before_it_trims_the_arena(monkeypatch):
    """The arena can give back to the driver only what reached it: every buffer the pool drops
    must be dead when the pool calls empty_cache(), and the large ones are own-pages blocks."""
    import weakref

    import ramstream.ops.memory as memory

    asked, alive_at_trim = [], []
    refs = []

    def fake_pinned_empty(n, dtype, *, own_pages=False):
        asked.append((n, own_pages))
        t = torch.empty(n, dtype=dtype)
        refs.append(weakref.ref(t))
        return t

    monkeypatch.setattr(memory, "pinned_empty", fake_pinned_empty)
    monkeypatch.setattr(
        memory, "empty_cache", lambda: alive_at_trim.append(sum(r() is not None for r in refs))
    )
    pool = buffers.HostPool(pinned=True, window=1)
    small = [pool.take(8 << 10) for _ in range(2)]
    big = [pool.take(1 << 20) for _ in range(3)]
    assert [o for _, o in asked] == [False, False, True, True, True]  # OWN_PAGES_MIN = 256 KiB
    for b in small + big:
        pool.give(b, None)
    del b, big
    pool.new_pass()  # the step that used everything
    for _ in range(2):
        small = [pool.take(8 << 10) for _ in range(2)]
        for b in small:
            pool.give(b, None)
        del b
        pool.new_pass()
    assert pool.stats()["host_bytes_held"] == 2 * (8 << 10)
    assert alive_at_trim and alive_at_trim[-1] == 2  # only the kept small buffers were alive


def test_pool_give_back_is_logged_with_its_numbers():
    logs = []
    model = make_model(0, n_blocks=3, d=32)
    off = _offloader(find_blocks(model), log=logs.append)
    for x, y in batches(1, b=32, t=16) + batches(3, b=2, t=16):
        model(x, y).backward()
    gone = [
        re.fullmatch(
            r"activation offload: host pool gave back ([0-9.]+) MiB of ([0-9.]+) MiB "
            r"\(keeps ([0-9.]+) MiB: the most in use over the last 2 steps\)",
            m,
        )
        for m in logs
        if "gave back" in m
    ]
    assert len(gone) == 2 and all(gone)  # at the 3rd and the 4th step
    s = off.stats()
    assert sum(float(m[1]) for m in gone) == pytest.approx(s["host_bytes_given_back"] / 2**20, abs=0.1)
    assert float(gone[-1][3]) == pytest.approx(s["host_bytes_high_water"] / 2**20, abs=0.05)


def test_a_graph_kept_alive_does_not_stop_the_give_back():
    """A graph that never runs backward (one held by an exception's traceback) keeps its own
    buffers in use; the free ones still go back once later steps do not need them."""
    model = make_model(0, n_blocks=3, d=32)
    off = _offloader(find_blocks(model))
    xb, yb = batches(1, b=32, t=16, seed=3)[0]
    model(xb, yb).backward()
    big_held = off.stats()["host_bytes_held"]
    xm, ym = batches(1, b=8, t=16, seed=5)[0]
    kept = model(xm, ym)  # no backward: its entries stay alive
    kept_bytes = off.stats()["host_bytes_in_use"]
    assert kept_bytes > 0
    need = _small_need()[0]
    for x, y in batches(4, b=2, t=16, seed=4):
        model(x, y).backward()
    s = off.stats()
    assert s["live_entries"] > 0 and s["host_bytes_in_use"] == kept_bytes
    assert s["host_bytes_held"] == kept_bytes + need < big_held
    del kept
    gc.collect()
    for x, y in batches(3, b=2, t=16, seed=4):
        model(x, y).backward()
    assert off.stats()["host_bytes_held"] == need


# ---- poisoned buffers (the test-only NaN fill of buffers.py) -------------------------------------
@pytest.fixture
def poison(monkeypatch):
    monkeypatch.setattr(buffers, "_TEST_POISON", True)


def test_poisoned_reused_buffers_varied_inputs_and_weights_stay_bit_exact(poison):
    model = make_model(0, n_blocks=4, d=32)
    ref = clone(model)
    off = _offloader(find_blocks(model), prefetch_depth=2)
    data = batches(6, b=4, t=16, seed=11)
    _train(model, ref, data, off)
    s = off.stats()
    assert s["host_reuses"] > 0 and s["host_reuses"] + s["host_allocations"] == s["copies_d2h"]


def test_poison_catches_a_host_copy_that_never_ran(poison, monkeypatch):
    """The poison is what makes a lost copy visible: a reused buffer would hold the previous step's
    bytes, right when the step repeats."""
    model = make_model(0, n_blocks=3, d=32)
    off = _offloader(find_blocks(model))
    x, y = batches(1, b=4, t=16)[0]
    model(x, y).backward()
    assert all(torch.isfinite(p.grad).all() for p in model.parameters())
    model.zero_grad(set_to_none=True)
    monkeypatch.setattr(off._copies, "to_host", lambda buf, src: None)
    model(x, y).backward()
    assert off.stats()["host_reuses"] > 0
    assert any(torch.isnan(p.grad).any() for p in model.parameters())


# ---- waits for copies and compute (fake events) --------------------------------------------------
class _FakeEvent:
    """Never complete by itself: every wait is logged."""

    def __init__(self, log):
        self.log = log

    def query(self):
        return False

    def synchronize(self):
        self.log.append(self)


def _fake_events(off):
    """CPU engine whose D2H events and compute-stream marks are _FakeEvents."""
    waits: list = []
    off._copies.d2h_event = lambda: _FakeEvent(waits)
    off._copies.mark = lambda: _FakeEvent(waits)
    return waits


def _calls(off):
    c, out = off._last_call, []
    while c is not None:
        out.append(c)
        c = c.prev
    return out[::-1]


@pytest.mark.parametrize("lag", [1, 2, 3])
def test_forward_waits_for_the_copies_lag_blocks_back(lag):
    n = 5
    model = make_model(0, n_blocks=n, d=32)
    off = _offloader(find_blocks(model), d2h_lag=lag)
    waits = _fake_events(off)
    x, y = batches(1, b=4, t=16)[0]
    loss = model(x, y)
    calls = _calls(off)
    owner = {id(c.d2h_event): c.index for c in calls}
    forward_waits = [owner[id(e)] for e in waits]
    # before block i: the last copy of block i - lag has finished
    assert forward_waits == list(range(n - lag))
    waits.clear()
    loss.backward()
    assert all(id(e) not in owner for e in waits)  # no D2H waits in backward


@pytest.mark.parametrize("depth,expected", [(1, [4, 3, 2]), (2, [4, 3]), (4, [])])
def test_prefetch_waits_for_the_gpu_to_reach_the_block_before(depth, expected):
    n = 5
    model = make_model(0, n_blocks=n, d=32)
    off = _offloader(find_blocks(model), prefetch_depth=depth)
    waits = _fake_events(off)
    x, y = batches(1, b=4, t=16)[0]
    loss = model(x, y)
    calls = _calls(off)
    waits.clear()
    loss.backward()
    owner = {id(c.bwd_event): c.index for c in calls}
    # prefetching from block k first waits for backward to have reached block k + 1
    assert [owner[id(e)] for e in waits] == expected


def test_a_failed_step_is_forgotten_and_its_buffers_dropped_at_once():
    """HostPool.forget_failed_pass: the needs of the passes since the last successful step are
    dropped, and so are the free buffers beyond what completed steps needed, newest first."""
    pool = buffers.HostPool(pinned=False, window=2)
    small = [pool.take(4096) for _ in range(3)]
    for b in small:
        pool.give(b, None)
    pool.new_pass()  # the small step's need is recorded
    pool.commit()  # ... and its optimizer step succeeded
    need = pool.needs[-1]
    big = [pool.take(1 << 20) for _ in range(4)]  # a large step: two passes (accumulation)
    for b in big:
        pool.give(b, None)
    pool.new_pass()
    assert pool.stats()["host_bytes_held"] >= 4 * (1 << 20)
    gone = pool.forget_failed_pass()  # ... and its step failed
    st = pool.stats()
    assert gone >= 4 * (1 << 20) and st["host_bytes_held"] <= need
    assert list(pool.needs) == [need]  # the failed passes' needs are gone
