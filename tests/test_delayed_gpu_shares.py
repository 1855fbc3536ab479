"""delayed_update with the GPU's shares (engine/delayed.py): buckets the GPU updates (mapped, in
VRAM) are updated at once, the host-updated rest one step late; a bucket moved between the host
and the GPU gains or loses its delay; wrap() hands the plan's split to the optimizer. Bit for bit
against the rule in plain torch with ramstream's CUDA kernel for the GPU-updated parameters
(_delayed_reference.py)."""

from __future__ import annotations

import pytest
import torch

import ramstream
from ramstream.runtime import delayed_split
from ramstream.runtime.delayed_split import host_share, planned_mapped

from _delayed_reference import LR, WD, DelayedReference, _assert_equal, _train
from _models import batches, clone, make_model


@pytest.mark.cuda
@pytest.mark.parametrize("dtype, moments", [(torch.float32, "float32"), (torch.bfloat16, "bfloat16")])
def test_a_mapped_share_is_updated_at_once_and_the_host_share_delayed(monkeypatch, dtype, moments):
    """optimizer_mode="auto" on a GPU: the buckets the GPU updates over PCIe ("mapped": half of the
    parameters here) are not delayed, the host-updated rest is. Bit for bit against the rule in
    plain torch with ramstream's CUDA kernel for the mapped half; and neither the all-delayed nor
    the undelayed rule gives these numbers."""
    from ramstream.runtime import optimizer_split

    real = optimizer_split.choose_mapped_fraction
    monkeypatch.setattr(
        optimizer_split, "choose_mapped_fraction", lambda **kw: (0.5, {**real(**kw)[1], "fraction": 0.5})
    )
    monkeypatch.setattr(delayed_split, "planned_mapped", lambda plan, opts: None)  # no plan's split
    ref_model = make_model(0, dtype=dtype, n_blocks=4).cuda()
    model, start = clone(ref_model), clone(ref_model)
    model, opt = ramstream.wrap(
        model,
        torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WD),
        device="cuda",
        delayed_update=2,
        moment_dtype=moments,
        bucket_bytes=1 << 14,
        offload=True,  # no VRAM share: the split stays half and half
    )
    opt._refiner = None  # the split stays as placed (the refiner's windows would install early)
    placements = [b.placement for b in opt._engine.buckets]
    assert "mapped" in placements and "host" in placements, placements
    offsets = [p._ramstream_slot.bucket.state_offset + p._ramstream_slot.offset for p in model.parameters()]
    bf16 = offsets if moments == "bfloat16" else None
    ref = DelayedReference(ref_model, 2, bf16_offsets=bf16, engine=opt._engine)
    assert 0 < len(ref.undelayed) < len(ref.params)
    data = batches(10, device="cuda")
    _assert_equal(model, opt, ref, *_train(model, opt, ref, data))
    assert opt.stats()["delayed_steps"] == 8 and opt.stats()["gpu_updates"] > 0
    for other in (DelayedReference(clone(start), 2, bf16_offsets=bf16),  # every parameter delayed
                  DelayedReference(clone(start), 10**9, bf16_offsets=bf16, engine=opt._engine)):  # fmt: skip
        for x, y in data:
            other.model(x, y).backward()
            other.step()
        other.install()
        assert not all(torch.equal(a, b) for a, b in zip(other.params, ref.params))


def test_wrap_hands_the_plans_mapped_share_to_the_optimizer_with_delay_only():
    from types import SimpleNamespace as NS

    plan = NS(mode="offload", optimizer={"split": {"device": 0.25, "mapped": 0.35, "host": 0.4}})
    opts = NS(delayed_update=40, optimizer_mode="auto")
    assert planned_mapped(plan, opts) == 0.6  # the VRAM share starts mapped (vram_share moves it)
    assert planned_mapped(plan, NS(delayed_update=False, optimizer_mode="auto")) is None
    assert planned_mapped(plan, NS(delayed_update=40, optimizer_mode="cpu")) is None
    assert planned_mapped(None, opts) is None
    assert planned_mapped(NS(mode="resident", optimizer=plan.optimizer), opts) is None
    # the side buffers wrap()'s host check counts: the plan's host share, else every element
    assert host_share(plan, opts) == 0.4
    assert host_share(plan, NS(delayed_update=40, optimizer_mode="cpu")) is True
    assert host_share(plan, NS(delayed_update=False, optimizer_mode="auto")) is False


@pytest.mark.cuda
def test_the_optimizer_takes_the_planned_mapped_share():
    model = make_model(0, n_blocks=4).cuda()
    opt = ramstream.OffloadAdamW(
        model.parameters(), lr=LR, mode="auto", delayed_update=2, bucket_bytes=1 << 14, _planned_mapped=0.5
    )
    e = opt._engine
    total = sum(b.numel for b in e.buckets)
    assert opt.split_info["reason"] == "delayed_update: the plan's split"
    assert abs(e.mapped_numel / total - 0.5) < 0.2
    assert {b.placement for b in e.buckets} == {"mapped", "host"}


@pytest.mark.cuda
def test_a_bucket_moved_between_host_and_gpu_gains_or_loses_its_delay(monkeypatch):
    """The refiner or the watchdog (any relocate between steps) moves a host bucket to the GPU's
    mapped placement mid-run: from then on it is updated at once, and its side buffers are
    released; a mapped bucket moved to the host gets them and is delayed from then on. Bit for bit
    against the reference whose parameters switch rule at the same steps, their AdamW state
    carried over."""
    from ramstream.engine.layout import relocate
    from ramstream.runtime import optimizer_split

    real = optimizer_split.choose_mapped_fraction
    monkeypatch.setattr(
        optimizer_split, "choose_mapped_fraction", lambda **kw: (0.5, {**real(**kw)[1], "fraction": 0.5})
    )
    monkeypatch.setattr(delayed_split, "planned_mapped", lambda plan, opts: None)  # no plan's split
    ref_model = make_model(0, n_blocks=4).cuda()
    model = clone(ref_model)
    model, opt = ramstream.wrap(
        model, torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WD), device="cuda", delayed_update=1,
        bucket_bytes=1 << 14,
        offload=True,
    )  # fmt: skip
    opt._refiner = None  # the moves below are the test's (the refiner's windows would install early)
    e = opt._engine
    ref = DelayedReference(ref_model, 1, engine=e)
    data = batches(14, device="cuda")
    losses, ref_losses = _train(model, opt, ref, data[:5])
    opt.synchronize()  # the moves need a quiescent engine (the refiner and the watchdog sync too)
    ref.install()
    b = next(b for b in e.buckets if b.placement == "host")
    assert b.dpu_out is not None
    relocate(e, b, "mapped")
    assert b.dpu_out is None and b.dpu_landing is None
    ref._follow_placements()  # b's parameters: the GPU kernel from now on, their state carried
    more = _train(model, opt, ref, data[5:10])
    losses, ref_losses = losses + more[0], ref_losses + more[1]
    opt.synchronize()
    ref.install()
    m = next(b for b in e.buckets if b.placement == "mapped")
    relocate(e, m, "host")
    assert m.dpu_out is not None and m.dpu_landing is not None
    ref._follow_placements()  # m's parameters: the host AdamW again, delayed
    more = _train(model, opt, ref, data[10:])
    _assert_equal(model, opt, ref, losses + more[0], ref_losses + more[1])
