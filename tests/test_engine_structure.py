"""The engine's composition (docs/architecture.md): parts that own their state and do not hold the
Engine, and data parallel as a strategy with the single-process strategy's interface, so that the
intake and the updater follow whatever strategy they are given."""

from __future__ import annotations

import inspect

import pytest
import torch

import ramstream
from ramstream.engine import core
from ramstream.engine.distributed import DataParallel
from ramstream.engine.parallel import SingleProcess

from _models import batches, clone, make_model, max_diff, train_torch


def _interface(cls) -> dict:
    return {
        n: list(inspect.signature(f).parameters)
        for n, f in vars(cls).items()
        if callable(f) and not n.startswith("_")
    }


def test_data_parallel_has_the_single_process_interface():
    single, dp = _interface(SingleProcess), _interface(DataParallel)
    assert len(single) >= 10
    for name, params in single.items():
        assert name in dp, name
        assert dp[name] == params, name
    assert SingleProcess.distributed is False and DataParallel.distributed is True


def test_parts_do_not_hold_the_engine():
    """Each part gets what it needs at construction; none keeps the Engine (or a bound method of
    it) in its state, so the direction of calls is Engine -> parts only."""
    model = make_model(0)
    opt = ramstream.OffloadAdamW(model.parameters(), lr=1e-3, max_grad_norm=1.0)
    e = opt._engine
    parts = [e.intake, e.intake.inflight, e.updater, e.updater.mapped, e.weights, e.parallel]
    for part in parts:
        for name, value in vars(part).items():
            assert value is not e, (type(part).__name__, name)
            assert getattr(value, "__self__", None) is not e, (type(part).__name__, name)
    opt.close()


class _Deferred(SingleProcess):
    """A strategy that flushes nothing when a bucket completes, and everything at the end of the
    pass, last bucket first; it records what the engine asked of it."""

    def __init__(self, dev) -> None:
        super().__init__(dev)
        self.flushed: list[int] = []
        self.broadcast_asked: list[int] = []

    def on_bucket_complete(self, b, flush) -> None:
        pass

    def end_backward(self, buckets, flush) -> None:
        for b in reversed(buckets):
            if b.micro_list:
                self.flushed.append(b.index)
                flush(b)

    def broadcast(self, b) -> bool:
        self.broadcast_asked.append(b.index)
        return False


@pytest.mark.parametrize("kw", [{}, {"max_grad_norm": 0.5}, {"accumulation_steps": 2}])
def test_the_engine_follows_its_strategy(monkeypatch, kw):
    made = []

    def make(distributed, *, buckets, dev, wait_job, mapped_fraction):
        made.append(_Deferred(dev))
        return made[-1]

    monkeypatch.setattr(core, "make_strategy", make)
    k = kw.get("accumulation_steps", 1)
    data = batches(3 * k)
    model = make_model(0)
    ref = clone(model)
    train_torch(
        ref,
        torch.optim.AdamW(ref.parameters(), lr=1e-2, foreach=False),
        data,
        accumulation=k,
        max_grad_norm=kw.get("max_grad_norm"),
    )
    model, opt = ramstream.wrap(
        model, torch.optim.AdamW(model.parameters(), lr=1e-2), bucket_bytes=16 << 10, **kw
    )
    (strategy,) = made
    n = len(opt._engine.buckets)
    assert n >= 3
    train_torch(model, opt, data, accumulation=k)
    opt.synchronize()
    assert max_diff(ref, model) < 1e-5
    # every bucket flushed by the strategy at the end of each pass, in its order
    assert strategy.flushed == list(range(n - 1, -1, -1)) * (3 * k)
    # and each step asks it to broadcast every stepped bucket, in bucket order
    assert strategy.broadcast_asked == list(range(n)) * 3
