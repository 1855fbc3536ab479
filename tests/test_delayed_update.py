"""Delayed parameter update (wrap(delayed_update=...), engine/delayed.py) equals its plain-torch
reference bit for bit: after the warm-up, step t's forward and backward run on the weights of
update t-2 (the update of step t-1 is still pending) and w[t] = AdamW(w[t-1], g(w[t-2])). With
clipping, accumulation, bf16 moments, streamed blocks, OffloadModel's host optimizer, skipped
non-finite steps and a failed backward; step() returns before the host update ran."""

from __future__ import annotations

import threading
import time
import warnings

import pytest
import torch

import ramstream

from _delayed_reference import LR, WD, DelayedReference, _assert_equal, _train
from _models import Boom, batches, clone, make_model

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)]


class Poison:
    """Turns one weight's gradient into NaN while armed (a tensor hook: the engine takes .grad)."""

    def __init__(self, model):
        self.armed = False
        model.blocks[1].fc1.weight.register_hook(
            lambda g: torch.full_like(g, float("nan")) if self.armed else g
        )


def _wrapped(device="cpu", warmup=2, **options):
    ref_model = make_model(0).to(device)
    model = clone(ref_model)
    model, opt = ramstream.wrap(
        model,
        torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WD),
        device=device,
        delayed_update=warmup,
        **options,
    )
    return model, opt, ref_model


@pytest.mark.parametrize("device", DEVICES)
def test_delayed_update_equals_its_plain_torch_reference(device):
    model, opt, ref_model = _wrapped(device)
    ref = DelayedReference(ref_model, 2, engine=opt._engine)  # a mapped share (GPU "auto") undelayed
    losses, ref_losses = _train(model, opt, ref, batches(10, device=device))
    st = opt.stats()
    # on a GPU "auto" may leave nothing to the host (the tiny model's state fits in VRAM): nothing
    # delayed then, and the reference follows the same placements
    host = any(b.placement == "host" for b in opt._engine.buckets)
    assert st["steps"] == 10 and st["delayed_steps"] == (8 if host else 0)
    assert st["eager_updates"] > 0 or not host  # warm-up: eager
    _assert_equal(model, opt, ref, losses, ref_losses)
    if not host:
        return  # nothing was delayed: the run is plain AdamW (the reference checked that too)
    # and it is not plain AdamW: the same run undelayed ends elsewhere
    plain = DelayedReference(make_model(0).to(device), 10**9)
    for x, y in batches(10, device=device):
        plain.model(x, y).backward()
        plain.step()
    assert not all(torch.equal(a, b) for a, b in zip(plain.params, ref.params))


def test_no_warmup_and_the_default_warmup():
    model, opt, ref_model = _wrapped(warmup=0)
    ref = DelayedReference(ref_model, 0)
    _assert_equal(model, opt, ref, *_train(model, opt, ref, batches(6)))
    assert opt.stats()["delayed_steps"] == 6
    model, opt, ref_model = _wrapped(warmup=True)  # ZeRO-Offload's 40 undelayed steps
    assert opt._delayed_update == 40
    ref = DelayedReference(ref_model, 40)
    _assert_equal(model, opt, ref, *_train(model, opt, ref, batches(5)))
    assert opt.stats()["delayed_steps"] == 0


@pytest.mark.parametrize("max_norm", [0.05, 1e3])
def test_with_clipping_the_norm_of_the_stale_gradients(max_norm):
    model, opt, ref_model = _wrapped(max_grad_norm=max_norm)
    ref = DelayedReference(ref_model, 2, max_grad_norm=max_norm)
    _assert_equal(model, opt, ref, *_train(model, opt, ref, batches(10)))


def test_with_accumulation():
    model, opt, ref_model = _wrapped(accumulation_steps=2)
    ref = DelayedReference(ref_model, 2)
    _assert_equal(model, opt, ref, *_train(model, opt, ref, batches(20), accumulation=2))
    assert opt.stats()["delayed_steps"] == 8


def test_with_bf16_moments():
    model, opt, ref_model = _wrapped(moment_dtype="bfloat16")
    offsets = [p._ramstream_slot.bucket.state_offset + p._ramstream_slot.offset for p in model.parameters()]
    ref = DelayedReference(ref_model, 2, bf16_offsets=offsets)
    _assert_equal(model, opt, ref, *_train(model, opt, ref, batches(10)))


@pytest.mark.parametrize("device", DEVICES)
def test_bf16_weights_bf16_moments_and_many_buckets(device):
    """The GPU bench's configuration (bf16 weights with fp32 masters, bf16 moments, the state in
    many buckets, every update installed by H2D) on a model small enough to check bit for bit."""
    ref_model = make_model(0, dtype=torch.bfloat16, n_blocks=4).to(device)
    model = clone(ref_model)
    model, opt = ramstream.wrap(
        model,
        torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WD),
        device=device,
        delayed_update=2,
        moment_dtype="bfloat16",
        bucket_bytes=1 << 14,
        optimizer_mode="cpu",  # every update on the host, delayed, installed by H2D
    )
    assert len(opt._engine.buckets) > 4
    offsets = [p._ramstream_slot.bucket.state_offset + p._ramstream_slot.offset for p in model.parameters()]
    ref = DelayedReference(ref_model, 2, bf16_offsets=offsets, engine=opt._engine)
    _assert_equal(model, opt, ref, *_train(model, opt, ref, batches(12, device=device)))
    assert opt.stats()["delayed_steps"] == 10


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_with_streamed_blocks(dtype):
    ref_model = make_model(0, dtype=dtype, n_blocks=4)
    model = clone(ref_model)
    model, opt = ramstream.wrap(
        model,
        torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WD),
        device="cpu",
        param_offload=True,
        delayed_update=1,
        bucket_bytes=1 << 14,
    )
    streamed = [b for b in opt._engine.buckets if b.streamed]
    assert streamed
    # an fp32 block's home is no longer its master: loads must read the weights before the update
    assert all(b.master.data_ptr() != b.slab.home.data_ptr() for b in streamed)
    ref = DelayedReference(ref_model, 1)
    _assert_equal(model, opt, ref, *_train(model, opt, ref, batches(8)))
    assert opt.stats()["delayed_steps"] == 7


def test_offload_model_host_optimizer():
    import torch.nn as nn
    import torch.nn.functional as F

    from _offload_optim_ref import make_chunks, make_data, two_groups

    chunks = make_chunks()
    ref_model = nn.Sequential(*[clone(c) for c in chunks])
    model = ramstream.OffloadModel(chunks, device="cpu", window=2, pin_layers=[0, 3])
    opt = model.optimizer(two_groups(list(model.parameters())), lr=1e-2, delayed_update=1)
    ref = DelayedReference(ref_model, 1, groups=two_groups, lr=1e-2)
    for x, y in make_data(6):
        model.step(x, targets=y)
        opt.step()
        opt.zero_grad()
        F.mse_loss(ref.model(x), y).backward()
        ref.step()
    opt.synchronize()
    ref.install()
    for i, (a, b) in enumerate(zip(model.parameters(), ref.params)):
        assert torch.equal(a.detach(), b.detach()), f"parameter {i} differs"
    assert opt.stats()["delayed_steps"] == 5
    model.close()


def test_step_returns_before_the_host_update_ran():
    """The engine thread is held by a job that waits for an event: a step() that waited for its
    update would not return before the event is set (a timer sets it after 5 s)."""
    model, opt, _ = _wrapped(warmup=0)
    before = [p.detach().clone() for p in model.parameters()]
    gate = threading.Event()
    timer = threading.Timer(5.0, gate.set)
    timer.start()
    try:
        x, y = batches(1)[0]
        model(x, y).backward()
        opt._engine.worker.submit(gate.wait, priority=-1)
        t0 = time.perf_counter()
        opt.step()
        returned = time.perf_counter() - t0
        assert returned < 2.0 and not gate.is_set()  # step() did not wait for the AdamW
        e = opt._engine
        assert e.delayed.pending and not any(e.worker._finished(b.dpu_seq) for b in e.buckets)
        # the next forward reads the weights as they were, without waiting
        assert all(torch.equal(a, b) for a, b in zip(model.parameters(), before))
        opt.zero_grad()  # called every step: it does not install (nor wait)
        assert e.delayed.pending and not gate.is_set()
        model(x, y).backward()  # the backward lands in the other gradient buffers, no wait either
        assert not gate.is_set()
    finally:
        gate.set()
        timer.cancel()
    opt.step()  # installs update 1 (waits for it), queues update 2
    assert not all(torch.equal(a, b) for a, b in zip(model.parameters(), before))


@pytest.mark.parametrize("device", DEVICES)
def test_the_forward_after_an_install_does_not_wait_for_the_next_update(device):
    """Step 2's step() installs update 1 (the forward of step 3 waits for its copy) and queues
    update 2: that forward must not wait for update 2, which the engine thread holds here (a
    timer releases it after 5 s). Found on the GPU: the forward waited for it (the bucket's
    update job was the delayed one), so the update never overlapped the next step."""
    model, opt, _ = _wrapped(device, warmup=0, optimizer_mode="cpu")  # every bucket host-updated
    e = opt._engine
    data = batches(3, device=device)
    model(*data[0]).backward()
    opt.step()  # queues update 1
    opt.zero_grad()
    for b in e.buckets:
        e.worker.wait(b.dpu_seq)  # update 1 ran
    model(*data[1]).backward()
    gate = threading.Event()
    timer = threading.Timer(5.0, gate.set)
    timer.start()
    try:
        e.worker.submit(gate.wait, priority=-1)
        opt.step()  # installs update 1, queues update 2 (behind the gate)
        opt.zero_grad()
        # on a GPU the installed weights are on their way (H2D: the forward waits for the copy);
        # the CPU engine copied them already
        assert e.delayed.pending and any(b.pending for b in e.buckets) == (device == "cuda")
        t0 = time.perf_counter()
        model(*data[2]).backward()  # reads update 1's weights
        assert time.perf_counter() - t0 < 2.0 and not gate.is_set()
    finally:
        gate.set()
        timer.cancel()
    opt.step()


def test_synchronize_and_state_dict_install_the_pending_update():
    model, opt, ref_model = _wrapped(warmup=0)
    ref = DelayedReference(ref_model, 0)
    _train(model, opt, ref, batches(3))
    assert opt._engine.delayed.pending
    sd = opt.state_dict()  # waits and installs: nothing is lost
    assert not opt._engine.delayed.pending
    ref.install()
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), ref.params))
    masters = opt.master_weights()
    assert all(torch.equal(a, b) for a, b in zip(masters, ref.masters))
    assert sd["state"][0]["step"] == 3
    ramstream.unwrap(model)  # closing after another delayed step installs it too
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), ref.params))


def test_skipped_nonfinite_step_installs_the_pending_update_and_queues_none():
    model, opt, ref_model = _wrapped(warmup=1, max_grad_norm=float("inf"), skip_nonfinite=True)
    ref = DelayedReference(ref_model, 1, max_grad_norm=float("inf"))
    poison = [Poison(model), Poison(ref.model)]
    losses, ref_losses = [], []
    for i, (x, y) in enumerate(batches(8)):
        for h in poison:
            h.armed = i == 4
        for m, out in ((model, losses), (ref.model, ref_losses)):
            loss = m(x, y)
            loss.backward()
            out.append(loss.item())
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)
            opt.step()
        opt.zero_grad()
        assert ref.step() == (i != 4)
    assert opt.stats()["skipped_steps"] == 1
    _assert_equal(model, opt, ref, losses, ref_losses)


def test_failed_backward_keeps_the_pending_update():
    """A backward that raises drops its gradients (as without delay); update t stays pending and
    the next step() installs it."""
    import torch.nn as nn

    class WithBoom(nn.Module):
        def __init__(self, inner):
            super().__init__()
            self.inner = inner

        def forward(self, x, y):
            return Boom.apply(self.inner(x, y))

    ref_model = make_model(0)
    model = WithBoom(clone(ref_model))
    model, opt = ramstream.wrap(
        model, torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WD), device="cpu", delayed_update=1
    )
    ref = DelayedReference(WithBoom(ref_model), 1)
    data = batches(7)
    losses, ref_losses = [], []
    for i, (x, y) in enumerate(data):
        if i == 3:  # the failed step: nothing gathered survives, the pending update stays
            Boom.armed = True
            try:
                with pytest.raises(RuntimeError, match="injected"):
                    model(x, y).backward()
            finally:
                Boom.armed = False
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", RuntimeWarning)
                opt.zero_grad()
            assert opt._engine.delayed.pending
            continue
        for m, out in ((model, losses), (ref.model, ref_losses)):
            loss = m(x, y)
            loss.backward()
            out.append(loss.item())
        opt.step()
        opt.zero_grad()
        ref.step()
    _assert_equal(model, opt, ref, losses, ref_losses)


def test_bad_values_and_unsupported_combinations():
    for bad in (-1, 1.5, "yes", None):
        with pytest.raises(ValueError, match="delayed_update"):
            _wrapped(warmup=bad)
        with pytest.raises(ValueError, match="delayed_update"):
            ramstream.OffloadAdamW(make_model(0).parameters(), delayed_update=bad)
    with pytest.raises(ValueError, match="delayed_update.*optimizer_mode='gpu'"):
        _wrapped(optimizer_mode="gpu")
    with pytest.raises(ValueError, match="delayed_update.*mode='gpu'"):
        ramstream.OffloadAdamW(make_model(0).parameters(), mode="gpu", delayed_update=True)
    with pytest.raises(ValueError, match="delayed_update.*distributed=True"):
        _wrapped(distributed=True)
    # "auto" stays "auto" (a GPU's mapped and VRAM shares are not delayed; no resident switch);
    # the CPU engine updates everything on the host
    _, opt, _ = _wrapped(optimizer_mode="auto", offload="auto")
    assert opt.mode == "auto" and opt.offload == "auto"
    assert all(b.placement == "host" for b in opt._engine.buckets)
    _, opt, _ = _wrapped(optimizer_mode="cpu")
    assert opt.mode == "cpu"


def test_lr_scheduler_read_when_the_update_is_queued():
    """An LR scheduler stepped after each optimizer.step(): the delayed update of step t uses the
    learning rate of step t (read by step() when it queues the update), as torch does."""
    model, opt, ref_model = _wrapped(warmup=1)
    ref = DelayedReference(ref_model, 1)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))
    ref_sched = torch.optim.lr_scheduler.LambdaLR(ref.opt, lambda s: 1.0 / (1 + s))
    losses, ref_losses = [], []
    for x, y in batches(8):
        for m, out in ((model, losses), (ref.model, ref_losses)):
            loss = m(x, y)
            loss.backward()
            out.append(loss.item())
        opt.step()
        opt.zero_grad()
        ref.step()
        sched.step()
        ref_sched.step()
    _assert_equal(model, opt, ref, losses, ref_losses)


def test_host_memory_check_counts_the_delayed_buffers():
    """moment_dtype="auto": the pending weights and the second landing buffer (working dtype) and,
    with accumulation, the second accumulator count in the host budget."""
    from ramstream.planner.host_fit import pick_moment_dtype

    n = 1_000_000_000
    fp32 = n * (4 + 8 + 2)  # master, two fp32 moments, bf16 landing buffer
    lines = []

    def pick(delayed, accumulate=False, extra=0):
        return pick_moment_dtype(
            "auto",
            numel=n,
            working_bytes=2,
            accumulate=accumulate,
            streamed=0,
            check=True,
            log=lines.append,
            ram={"available": int((fp32 + extra) / 0.9) + 1, "cgroup_limit": None},
            delayed=delayed,
        )

    assert pick(False) == torch.float32
    assert pick(True) == torch.bfloat16 and "delayed update buffers" in lines[-1]
    assert pick(True, extra=4 * n) == torch.float32
    assert pick(True, accumulate=True, extra=12 * n) == torch.float32
    assert pick(True, accumulate=True, extra=12 * n - 4096) == torch.bfloat16
