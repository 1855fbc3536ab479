"""offload="auto": the switch to an on-device fused AdamW after two steps, when it fits."""
from __future__ import annotations

import pytest
import torch

import ramstream
import ramstream.engine.resident as resident_mod
from _models import batches, clone, make_model, max_diff, train_master_reference, train_torch


@pytest.fixture
def roomy(monkeypatch):
    """Pretend the (CPU) device has memory to spare, so the CPU engine takes the switch."""
    monkeypatch.setattr(resident_mod, "device_memory", lambda d: {"usable": 1 << 40, "peak": 0})


def _groups(model):
    decay = [p for p in model.parameters() if p.dim() >= 2]
    rest = [p for p in model.parameters() if p.dim() < 2]
    return [{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}]


def test_switch_keeps_training_exact_with_scheduler_and_clipping(roomy):
    ref = make_model(0)
    model = clone(ref)
    data = batches(12)
    ropt = torch.optim.AdamW(_groups(ref), lr=3e-3, foreach=False)
    rs = torch.optim.lr_scheduler.StepLR(ropt, step_size=3, gamma=0.5)
    train_torch(ref, ropt, data, scheduler=rs, max_grad_norm=0.1)
    model, opt = ramstream.wrap(model, torch.optim.AdamW(_groups(model), lr=3e-3),
                                max_grad_norm=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.5)
    train_torch(model, opt, data[:2], scheduler=sched)
    assert opt.resident
    assert any("switching to fused AdamW" in e for e in ramstream.memory_report(model)["events"])
    assert all(type(p) is torch.nn.Parameter for p in model.parameters())   # no guard needed
    train_torch(model, opt, data[2:], scheduler=sched)
    assert max_diff(ref, model) < 1e-5
    sd = opt.state_dict()      # torch's format from the device-side state
    plain = clone(ref)
    topt = torch.optim.AdamW(_groups(plain), lr=3e-3, foreach=False)
    topt.load_state_dict(sd)
    assert float(topt.state_dict()["state"][0]["step"]) == 12.0


def test_switch_keeps_bf16_model_masters_and_bf16_moments(roomy):
    ref = make_model(0, dtype=torch.bfloat16)
    model = clone(ref)
    data = batches(8)
    masters_ref = train_master_reference(ref, data, lr=2e-3, weight_decay=0.01)
    model, opt = ramstream.wrap(model, torch.optim.AdamW(model.parameters(), lr=2e-3,
                                                         weight_decay=0.01))
    train_torch(model, opt, data)
    assert opt.resident
    got = opt.master_weights()
    assert max(float((a - b).abs().max()) for a, b in zip(got, masters_ref)) < 1e-5
    for m, p in zip(got, model.parameters()):
        assert torch.equal(p.detach(), m.to(torch.bfloat16).view_as(p))
    # bf16 moments after the switch: the same stochastic-rounding kernel keeps running
    m2 = make_model(0)
    m2, opt2 = ramstream.wrap(m2, lr=1e-3, moment_dtype="bf16")
    train_torch(m2, opt2, batches(4))
    assert opt2.resident and opt2.state_dict()["state"][0]["exp_avg"].dtype == torch.float32


def test_no_switch_when_it_does_not_fit_or_offload_true(monkeypatch):
    monkeypatch.setattr(resident_mod, "device_memory", lambda d: {"usable": 1 << 10, "peak": 0})
    model, opt = ramstream.wrap(make_model(0), lr=1e-3)
    train_torch(model, opt, batches(3))
    assert not opt.resident
    assert any("keep offloading" in e for e in ramstream.memory_report(model)["events"])
    monkeypatch.setattr(resident_mod, "device_memory", lambda d: {"usable": 1 << 40, "peak": 0})
    model, opt = ramstream.wrap(make_model(0), lr=1e-3, offload=True)
    train_torch(model, opt, batches(3))
    assert not opt.resident


def test_cpu_engine_never_switches_by_itself():
    model, opt = ramstream.wrap(make_model(0), lr=1e-3)
    train_torch(model, opt, batches(3))
    assert not opt.resident


def test_resident_half_and_back_keeps_fp32_master(roomy):
    ref = make_model(0)
    model = clone(ref)
    data = batches(6)
    train_torch(ref, torch.optim.AdamW(ref.parameters(), lr=3e-3, foreach=False), data)
    model, opt = ramstream.wrap(model, torch.optim.AdamW(model.parameters(), lr=3e-3))
    train_torch(model, opt, data[:3])
    assert opt.resident
    before = [m.clone() for m in opt.master_weights()]
    model.half()
    model.float()
    for m, p in zip(before, model.parameters()):
        assert torch.equal(p.detach(), m.view_as(p))
    train_torch(model, opt, data[3:])
    assert max_diff(ref, model) < 1e-5
