"""The CUDA engine's host-copy logic on the CPU: a fake device that takes the CUDA code paths
(gradients gathered into a staging buffer and copied into the pinned landing buffer, the host
update writing the new weights into the landing buffer, an H2D copy of the updated ranges back
into the device buffer) with synchronous copies. The CPU engine skips all of that (the update
writes the device buffer directly), so without this device CI never runs it.

The fake landing buffer starts as NaN, as pinned_empty() memory holds whatever was there; the
same model tests run on a GPU (marked cuda) with the real landing buffers filled with NaN.
"""

from __future__ import annotations

import threading
import time

import pytest
import torch
import torch.nn as nn

import ramstream
import ramstream.engine.core as core
import ramstream.engine.updater as updater
from ramstream.engine.devices import CpuDevice
from ramstream.engine.host_jobs import Piece, update

from _models import Boom as _Boom


class CopyingDevice(CpuDevice):
    """The CPU as a device with separate host buffers: the engine runs its CUDA paths."""

    type = "copying"

    def host_buffer(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        return torch.full((numel,), float("nan"), dtype=dtype)


@pytest.fixture(params=["copying", pytest.param("cuda", marks=pytest.mark.cuda)])
def dev(request, monkeypatch):
    """The device string for wrap(): the fake device takes the place of the CPU one."""
    if request.param == "copying":
        monkeypatch.setattr(core, "make_device", lambda device: CopyingDevice(device))
        return "cpu"
    return "cuda"


class Scale(nn.Module):
    def __init__(self, n: int) -> None:
        super().__init__()
        self.x = nn.Parameter(torch.randn(n))


class Gated(nn.Module):
    """a -> (optionally scaled by x) -> c; x is small and sits between a and c in one bucket,
    so a step that does not use x updates the parameters on both sides of it."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a = nn.Linear(8, 8)
        self.g = Scale(8)  # a submodule: its parameter comes after a's, before c's
        self.c = nn.Linear(8, 4)

    def forward(self, inp, use_x: bool):
        h = self.a(_Boom.apply(inp))  # raises (when armed) after every gradient arrived
        if use_x:
            h = h * self.g.x
        return self.c(h).square().mean()


def _data(n, device="cpu"):
    g = torch.Generator().manual_seed(3)
    return [torch.randn(5, 8, generator=g).to(device) for _ in range(n)]


def _reference(uses, device):
    model = Gated().to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1, foreach=False)
    for inp, use_x in zip(_data(len(uses), device), uses):
        model(inp, use_x).backward()
        opt.step()
        opt.zero_grad()
    return model


def _wrapped(device, **kw):
    model = Gated().to(device)
    model, opt = ramstream.wrap(
        model,
        torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1),
        device=device,
        offload=True,
        bucket_bytes=1 << 16,
        **{"optimizer_mode": "cpu", **kw},  # the host path's copies are what this file tests
    )
    (b,) = opt._engine.buckets
    assert b.placement == "host" and b.landing.data_ptr() != b.device_flat.data_ptr()
    b.landing.fill_(float("nan"))  # what an unwritten pinned buffer may hold
    return model, opt


def _assert_same(model, ref):
    for (n, p), q in zip(model.named_parameters(), ref.parameters()):
        assert (p.detach() - q.detach()).abs().max() < 1e-5, n


@pytest.mark.parametrize("kw", [{}, dict(eager_updates=False), dict(max_grad_norm=1.0)])
def test_unused_parameter_between_updated_ones_keeps_its_weights(dev, kw):
    """x gets no gradient in the first steps: the H2D copy of its neighbours' new weights must
    not carry x's range of the landing buffer (never written: NaN here, stale pinned memory on
    the GPU) over x's weights."""
    uses = [False, False, True, False, True]
    model, opt = _wrapped(dev, **kw)
    assert opt._engine.dev.type in ("copying", "cuda")
    for inp, use_x in zip(_data(len(uses), dev), uses):
        model(inp, use_x).backward()
        opt.step()
        opt.zero_grad()
    opt.synchronize()
    if not kw:
        _assert_same(model, _reference(uses, dev))
    assert torch.isfinite(model.g.x.detach()).all()
    x0 = Gated().g.x.detach().to(dev)
    # x was trained in steps 3 and 5 only; before step 3 it must have kept its initial value
    model2, opt2 = _wrapped(dev, **kw)
    for inp, use_x in zip(_data(2, dev), uses[:2]):
        model2(inp, use_x).backward()
        opt2.step()
        opt2.zero_grad()
    opt2.synchronize()
    assert torch.equal(model2.g.x.detach(), x0)


def test_abandoned_backward_leaves_no_gradient_in_the_weights(dev):
    """A backward that raised after x's gradient landed (its update waiting for step()) leaves
    that gradient in x's range of the landing buffer; a later step that does not use x must not
    copy it into x's weights."""
    model, opt = _wrapped(dev, eager_updates=False)
    data = _data(3, dev)
    model(data[0], True).backward()
    opt.step()
    opt.zero_grad()
    _Boom.armed = True
    try:
        with pytest.raises(RuntimeError, match="injected failure"):
            # every gradient landed (the bucket was flushed), then the input's backward raised
            model(data[1].requires_grad_(), True).backward()
    finally:
        _Boom.armed = False
    opt.zero_grad()  # discards the failed pass
    model(data[2], False).backward()
    opt.step()
    opt.synchronize()
    ref = Gated().to(dev)
    ropt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.1, foreach=False)
    for inp, use_x in ((data[0], True), (data[2], False)):
        ref(inp, use_x).backward()
        ropt.step()
        ropt.zero_grad()
    _assert_same(model, ref)


def test_loaded_weights_are_not_reverted_by_a_neighbours_update(dev):
    """load_state_dict() writes the device weights; the landing buffer still holds x's old
    weights, which a neighbours' update must not copy back over the loaded ones."""
    model, opt = _wrapped(dev)
    data = _data(2, dev)
    model(data[0], True).backward()
    opt.step()
    opt.zero_grad()
    opt.synchronize()
    sd = {k: v.clone() for k, v in model.state_dict().items()}
    sd["g.x"] = torch.full_like(sd["g.x"], 0.25)
    model.load_state_dict(sd)
    model(data[1], False).backward()
    opt.step()
    opt.synchronize()
    assert torch.equal(model.g.x.detach().cpu(), torch.full((8,), 0.25))


def test_update_ranges_merge_padding_only():
    """update() returns the ranges to copy back: padding between updated slots is merged, a
    slot not updated in this job never is."""
    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8))
    from ramstream.engine.buckets import Slot, build_buckets

    slots = [Slot(param=p, index=i, group=0, numel=p.numel()) for i, p in enumerate(model.parameters())]
    (b,) = build_buckets(slots, 1 << 16, 4)
    b.master = torch.zeros(b.numel)
    b.exp_avg, b.exp_avg_sq = torch.zeros(b.numel), torch.zeros(b.numel)
    b.landing = torch.zeros(b.numel)
    b.acc = None
    from ramstream.engine.host_jobs import Hyper

    hyper = [Hyper(1e-3, 0.9, 0.999, 1e-8, 0.0)]
    out = torch.zeros(b.numel)
    s = sorted(b.slots, key=lambda s: s.offset)
    all_ranges = update(b, [Piece(x.offset, x.numel, 0, 1, True) for x in s], hyper, 1.0, False, out, 0)
    assert all_ranges == [(s[0].offset, s[-1].offset + s[-1].numel - s[0].offset)]
    skip = [x for i, x in enumerate(s) if i != 1]
    ranges = update(b, [Piece(x.offset, x.numel, 0, 1, True) for x in skip], hyper, 1.0, False, out, 0)
    covered = set()
    for a, n in ranges:
        covered.update(range(a, a + n))
    assert not covered & set(range(s[1].offset, s[1].offset + s[1].numel))
    for x in skip:
        assert set(range(x.offset, x.offset + x.numel)) <= covered


@pytest.fixture
def single_rank_group():
    import torch.distributed as dist

    if dist.is_initialized():
        pytest.skip("a process group is already initialised")
    store = dist.HashStore()
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_data_parallel_flush_of_an_unused_bucket_waits_for_the_last_update(single_rank_group, monkeypatch):
    """Data parallel: a bucket none of whose parameters got a gradient on this rank is still
    flushed (zeros) into the owner's landing buffer at the end of backward; that must wait for
    the bucket's previous update job, which reads the landing buffer as its gradient (and, on
    CUDA, for the H2D copy out of it)."""
    started = threading.Event()
    real = updater.update

    def slow_update(b, pieces, *args):
        if b.index == 1:
            started.set()
            time.sleep(0.3)  # the next backward runs meanwhile
        return real(b, pieces, *args)

    monkeypatch.setattr(updater, "update", slow_update)

    class Two(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.a = nn.Linear(64, 64)
            self.b = nn.Linear(64, 64)

        def forward(self, inp, use_b):
            h = self.a(inp)
            return (self.b(h) if use_b else h).square().mean()

    data = _data(2)
    inp = [torch.cat([d] * 8, 1) for d in data]
    ref = Two()
    ropt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    ref(inp[0], True).backward()
    ropt.step()
    ropt.zero_grad()
    ref(inp[1], False).backward()
    ref.b.weight.grad, ref.b.bias.grad = torch.zeros(64, 64), torch.zeros(64)  # as DP counts it
    ropt.step()
    model = Two()
    model, opt = ramstream.wrap(
        model,
        torch.optim.AdamW(model.parameters(), lr=1e-2),
        device="cpu",
        offload=True,
        distributed=True,
        bucket_bytes=64 * 65 * 4,
        guard_params=False,
        eager_updates=False,
    )  # step() queues a's update, then b's
    assert [len(b.slots) for b in opt._engine.buckets] == [2, 2]
    model(inp[0], True).backward()
    opt.step()  # b's update job starts after a's, sleeps
    assert started.wait(5)
    model(inp[1], False).backward()  # b unused: a zero flush into b's landing buffer
    opt.step()
    opt.synchronize()
    for p, q in zip(opt.master_weights(), ref.parameters()):
        assert (p - q.detach()).abs().max() < 1e-6
