"""Activation offload on the CPU engine, the host side: the buffer pool's reuse, growth and
trimming, graphs dropped without backward, and the waits on copies and compute (with fake events)."""
from __future__ import annotations

import gc

import pytest

from ramstream.activations import find_blocks
from _act_helpers import _offloader
from _models import batches, make_model


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
    assert held[0] == held[1] == all_held             # kept while they may come back
    assert 0 < held[3] < all_held / 2                 # then block 0's buffers only
    assert held[3] >= off.stats()["block_bytes"][0]      # (size classes round up)


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
    model(x, y).backward()                         # buffers are reused
    assert off.stats()["host_allocations"] == s["host_allocations"]


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
    assert all(id(e) not in owner for e in waits)    # no D2H waits in backward


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
