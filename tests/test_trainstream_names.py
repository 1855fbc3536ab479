"""TrainStream's public names (issue 9): OffloadAdamW.attach, stats(), memory_report, master state."""

from __future__ import annotations

import pytest
import torch

import ramstream

from _models import batches, clone, make_model, max_diff, train_torch

HP = dict(lr=3e-3, weight_decay=0.05)


def _exact(a: torch.nn.Module, b: torch.nn.Module) -> bool:
    return all(torch.equal(x.detach(), y.detach()) for x, y in zip(a.parameters(), b.parameters()))


def _attach_loop(device: str) -> None:
    ref = make_model(0).to(device)
    wrapped, attached = clone(ref), clone(ref)
    data = batches(8, device=device)
    train_torch(ref, torch.optim.AdamW(ref.parameters(), foreach=False, **HP), data)
    wrapped, w_opt = ramstream.wrap(wrapped, torch.optim.AdamW(wrapped.parameters(), **HP), offload=True)
    opt = ramstream.OffloadAdamW(attached.parameters(), **HP)
    assert not opt.attached
    assert opt.attach(attached) is attached
    assert opt.attached and w_opt.attached
    assert opt.eager_active and opt.accumulation_steps == 1 and opt.max_grad_norm is None
    try:
        train_torch(wrapped, w_opt, data)
        train_torch(attached, opt, data)
        opt.synchronize()
        w_opt.synchronize()
        assert _exact(wrapped, attached)  # the same engine and hooks as wrap()
        assert max_diff(ref, attached) < 1e-5
        assert not opt.resident
        assert opt.stats()["steps"] == w_opt.stats()["steps"] == 8
    finally:
        ramstream.unwrap(attached)
        ramstream.unwrap(wrapped)
    assert not opt.attached


def test_attach_trains_as_wrap_and_torch():
    _attach_loop("cpu")


@pytest.mark.cuda
def test_attach_trains_as_wrap_and_torch_cuda():
    _attach_loop("cuda")


def test_attach_properties_and_errors():
    model = make_model(0)
    opt = ramstream.OffloadAdamW(model.parameters(), max_grad_norm=1.0, accumulation_steps=2)
    assert opt.max_grad_norm == 1.0 and opt.accumulation_steps == 2 and not opt.eager_active
    with pytest.raises(TypeError, match="model must be a torch.nn.Module"):
        opt.attach(object())
    with pytest.raises(ValueError, match="does not hold this optimizer's parameters"):
        opt.attach(make_model(1))
    opt.attach(model)
    with pytest.raises(RuntimeError, match="already attached"):
        opt.attach(model)
    with pytest.raises(ValueError, match="already wrapped"):
        ramstream.wrap(model)
    assert any("attached" in e for e in ramstream.memory_report(model)["events"])
    ramstream.unwrap(model)
    assert not ramstream.OffloadAdamW(make_model(0).parameters(), eager_updates=False).eager_active
