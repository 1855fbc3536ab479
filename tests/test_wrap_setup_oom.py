"""wrap() running out of device memory while it sets up (moving the weights, laying out the
optimizer's flat buffers) gives the model back as it came and raises a MemoryError with the
arithmetic, instead of torch's bare OutOfMemoryError with the weights left half moved."""

from __future__ import annotations

import importlib

import pytest
import torch

import ramstream
from ramstream.weights.setup import devices_of, move_back, move_resident

from _models import make_model

wrap_mod = importlib.import_module("ramstream.wrap")  # the module (ramstream.wrap is the function)


def _oom(*args, **kwargs):
    raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 64.00 MiB (injected)")


def _train_one(model, opt):
    dev = next(model.parameters()).device
    x, t = (torch.randint(0, 64, (2, 8), device=dev) for _ in range(2))
    model(x, t).backward()
    opt.step()


def test_an_out_of_memory_laying_out_the_optimizer_leaves_the_model_as_it_came(monkeypatch):
    model = make_model(0, n_blocks=2)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    monkeypatch.setattr(wrap_mod, "_make_optimizer", _oom)
    with pytest.raises(MemoryError, match=r"out of memory on cpu while laying out") as e:
        ramstream.wrap(model, torch.optim.AdamW(model.parameters(), lr=1e-3), device="cpu")
    nbytes = sum(t.numel() * t.element_size() for t in [*model.parameters(), *model.buffers()])
    assert f"take {nbytes / 2**30:.2f} GiB on cpu" in str(e.value) and "(injected)" in str(e.value)
    assert getattr(model, "_ramstream", None) is None
    after = model.state_dict()
    assert before.keys() == after.keys()
    assert all(torch.equal(before[k], after[k]) for k in before)
    monkeypatch.undo()  # the model is usable: wrap() again trains it as a fresh copy would be
    ref = make_model(0, n_blocks=2)
    for m in (model, ref):
        w, opt = ramstream.wrap(m, torch.optim.AdamW(m.parameters(), lr=1e-3), device="cpu")
        torch.manual_seed(3)
        _train_one(w, opt)
        opt.synchronize()
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), ref.parameters()))


@pytest.mark.cuda
def test_move_back_returns_every_tensor_to_its_device_unchanged():
    model = make_model(0, n_blocks=2)
    homes = devices_of(model)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    move_resident(model, torch.device("cuda"), {})
    assert all(p.is_cuda for p in model.parameters())
    move_back(model, homes)
    after = model.state_dict()
    assert all(after[k].device.type == "cpu" and torch.equal(before[k], after[k]) for k in before)


@pytest.mark.cuda
def test_an_out_of_memory_moving_the_weights_puts_back_what_moved(monkeypatch):
    model = make_model(0, n_blocks=2)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    real = wrap_mod.move_resident

    def half(m, device, streamed):  # moves the first block, then the device is full
        real(m.blocks[0], device, streamed)
        _oom()

    monkeypatch.setattr(wrap_mod, "move_resident", half)
    monkeypatch.setattr(wrap_mod, "check_weights_fit", lambda *a: None)
    with pytest.raises(MemoryError, match=r"out of memory on cuda.* while moving the weights"):
        ramstream.wrap(model, torch.optim.AdamW(model.parameters(), lr=1e-3), device="cuda")
    after = model.state_dict()
    assert all(after[k].device.type == "cpu" and torch.equal(before[k], after[k]) for k in before)
