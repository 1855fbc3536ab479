"""Buckets moved mid-run (engine/layout.py move_buckets, used by the split refiner and the VRAM
watchdog) never run the host out of memory: relocation_host_bytes counts what a move allocates in
host memory (against hand arithmetic), and a move that needs more than host_room() stays, with the
rest, logged with the numbers (the R5 row's host OOM of bench/RESULTS.md, fifteenth session)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from ramstream.engine import layout
from ramstream.runtime import measure


def _bucket(index, numel, placement, *, dtype=torch.bfloat16, moment=torch.float32, where="cpu"):
    """A stand-in bucket whose master and moments lie on `where` ("meta" stands in for VRAM)."""
    return SimpleNamespace(
        index=index, numel=numel, dtype=dtype, placement=placement, streamed=False, disk=None,
        master=torch.empty(numel, dtype=torch.float32, device=where),
        exp_avg=torch.empty(numel, dtype=moment, device=where),
        exp_avg_sq=torch.empty(numel, dtype=moment, device=where),
        device_flat=torch.empty(numel, dtype=dtype, device="meta"),
    )  # fmt: skip


def _engine(buckets, accumulation=1):
    return SimpleNamespace(buckets=buckets, dev=SimpleNamespace(type="cpu"), accumulation_steps=accumulation)


@pytest.mark.parametrize("accumulation", [1, 2])
def test_host_bytes_of_each_move_against_hand_arithmetic(accumulation):
    n = 1000
    e = _engine([], accumulation)
    acc = 4 * n if accumulation > 1 else 0
    # from VRAM to the host: fp32 master 4 + two fp32 moments 8 + a bf16 landing 2 per element
    assert layout.relocation_host_bytes(e, _bucket(0, n, "device", where="meta"), "host") == 14 * n + acc
    # bf16 moments: 4 + 2 + 2 + 2
    dev_bf16 = _bucket(0, n, "device", moment=torch.bfloat16, where="meta")
    assert layout.relocation_host_bytes(e, dev_bf16, "host") == 10 * n + acc
    # from mapped (state in host memory already) to the host: the landing only
    assert layout.relocation_host_bytes(e, _bucket(0, n, "mapped"), "host") == 2 * n + acc
    # to mapped from ordinary host memory: pinned master and moments (no landing)
    assert layout.relocation_host_bytes(e, _bucket(0, n, "host"), "mapped") == 12 * n
    # with delayed_update a bucket that becomes host-updated also gets its side buffers: the
    # pending weights and a second landing (working dtype), a second sum with accumulation
    delayed = SimpleNamespace(**vars(e), delayed=object())
    assert layout.relocation_host_bytes(delayed, _bucket(0, n, "mapped"), "host") == 6 * n + 2 * acc
    assert layout.relocation_host_bytes(delayed, _bucket(0, n, "host"), "mapped") == 12 * n
    # to the device, or where it already is: nothing on the host
    assert layout.relocation_host_bytes(e, _bucket(0, n, "host"), "device") == 0
    assert layout.relocation_host_bytes(e, _bucket(0, n, "host"), "host") == 0


def test_a_move_that_needs_more_host_memory_than_is_left_stays_with_the_rest():
    n = 1 << 20
    buckets = [_bucket(i, n, "device", where="meta") for i in range(4)]
    e, moved, log = _engine(buckets), [], []
    opt = SimpleNamespace(_engine=e, _log=log.append)

    def relocate(engine, b, where):
        moved.append(b.index)
        b.placement = where

    room = [30 * n]  # room for two moves of 14 bytes per element, not three

    def host_room():
        return room[0] - 14 * n * len(moved)

    assert layout.move_buckets(opt, ["host"] * 4, relocate, "test", host_room) == 2
    assert moved == [0, 1] and [b.placement for b in buckets] == ["host", "host", "device", "device"]
    assert len(log) == 1 and "bucket 2 stays device" in log[0]
    assert "needs 14 MiB, 2 MiB may still be taken" in log[0]
    # without host_room (a caller that does not guard) every bucket moves, as before
    assert layout.move_buckets(opt, ["host"] * 4, relocate, "test") == 2 and moved == [0, 1, 2, 3]


def test_host_room_is_what_is_available_less_the_reserve(monkeypatch):
    from ramstream.planner import profile
    from ramstream.planner.rules import HOST_RESERVE_SHARE

    gib = 2**30
    fake = {"total": 128 * gib, "available": 30 * gib, "cgroup_limit": None, "cgroup_usage": None}
    monkeypatch.setattr(profile, "available_ram", lambda: dict(fake))
    assert measure.host_room() == 30 * gib - int(128 * gib * HOST_RESERVE_SHARE)
    fake.update(cgroup_limit=24 * gib, available=5 * gib)  # a container's limit is its machine
    assert measure.host_room() == 5 * gib - int(24 * gib * HOST_RESERVE_SHARE)
