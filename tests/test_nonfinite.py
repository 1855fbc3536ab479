"""A step whose gradients hold NaN or Inf applies no update and leaves the run usable (CPU engine).

Reference: torch.optim.AdamW + clip_grad_norm_ trained on the same batches without the poisoned
one; the wrapped run must end where it ends (weights and step counts), whether the step raised
NonFiniteGradientError or was skipped with a warning.
"""

from __future__ import annotations

import math
import warnings

import pytest
import torch

import ramstream
from ramstream import NonFiniteGradientError

from _models import batches, clone, make_model, max_diff, train_torch

TOL = 1e-5
POISONED = "blocks.1.fc1.weight"


class Poison:
    """A gradient hook on one parameter that turns its gradient into `value` while armed."""

    def __init__(self, model, name: str = POISONED, value: float = float("nan")) -> None:
        self.armed, self.value = False, value
        dict(model.named_parameters())[name].register_hook(self._hook)

    def _hook(self, g):
        return torch.full_like(g, self.value) if self.armed else g


def _wrapped(value: float = float("nan"), **options):
    """A fresh TinyGPT (seed 0) with a Poison hook, wrapped on the CPU engine with `options`."""
    model = clone(make_model(0))
    poison = Poison(model, value=value)
    model, opt = ramstream.wrap(
        model, torch.optim.AdamW(model.parameters(), lr=3e-3), device="cpu", **options
    )
    return model, opt, poison


def _run(model, opt, data, poison, bad: set[int], accumulation: int = 1) -> list:
    """Trains over `data` in steps of `accumulation` micro-batches; the micro-batches whose index
    is in `bad` get a poisoned gradient. Returns what each step() raised (None or the error)."""
    out = []
    for i in range(len(data) // accumulation):
        for j in range(accumulation):
            poison.armed = i * accumulation + j in bad
            x, y = data[i * accumulation + j]
            model(x, y).backward()
        poison.armed = False
        try:
            opt.step()
            out.append(None)
        except NonFiniteGradientError as err:
            out.append(err)
        opt.zero_grad(set_to_none=True)
    return out


def _reference(data, skip_steps: set[int], accumulation: int = 1, max_grad_norm=1.0, lr=3e-3):
    ref = make_model(0)
    kept = [
        b for i, b in enumerate(data) if i // accumulation not in skip_steps
    ]  # the skipped steps' micro-batches, left out
    opt = torch.optim.AdamW(ref.parameters(), lr=lr, foreach=False)
    train_torch(ref, opt, kept, accumulation=accumulation, max_grad_norm=max_grad_norm)
    return ref, opt


def _steps_of(opt) -> set[int]:
    return {int(v["step"]) for v in opt.state_dict()["state"].values()}


@pytest.mark.parametrize("value", [float("nan"), float("inf"), -float("inf")])
def test_nonfinite_step_raises_names_the_parameter_and_changes_nothing(value):
    data = batches(6)
    model, opt, poison = _wrapped(value, max_grad_norm=1.0)
    errors = _run(model, opt, data, poison, bad={2})
    assert [e is None for e in errors] == [True, True, False, True, True, True]
    err = errors[2]
    assert isinstance(err, RuntimeError) and not math.isfinite(err.norm)
    assert err.parameters == [POISONED]  # only the poisoned one, by its name in the model
    assert err.step == 3 and POISONED in str(err) and "max_grad_norm=1" in str(err)
    opt.synchronize()
    ref, ref_opt = _reference(data, skip_steps={2})
    assert max_diff(ref, model) < TOL
    assert _steps_of(opt) == _steps_of(ref_opt) == {5}
    assert opt.stats()["skipped_steps"] == 1 and opt.stats()["steps"] == 5
    # the run is not wedged: state_dict, the report and unwrap all work
    assert opt.state_dict()["state"]
    assert ramstream.memory_report(model)["optimizer"]["stats"]["skipped_steps"] == 1
    plain = ramstream.unwrap(model)
    assert all(torch.isfinite(p).all() for p in plain.parameters())


def test_skip_nonfinite_warns_once_per_skipped_step_and_trains_on():
    data = batches(7)
    model, opt, poison = _wrapped(max_grad_norm=1.0, skip_nonfinite=True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        errors = _run(model, opt, data, poison, bad={1, 4})
    skipped = [w for w in caught if "skipped" in str(w.message)]
    assert errors == [None] * 7
    assert len(skipped) == 2 and all(issubclass(w.category, RuntimeWarning) for w in skipped)
    assert all(w.filename == __file__ for w in skipped)  # points at the caller's step()
    opt.synchronize()
    ref, ref_opt = _reference(data, skip_steps={1, 4})
    assert max_diff(ref, model) < TOL
    assert _steps_of(opt) == _steps_of(ref_opt) == {5}
    assert opt.stats()["skipped_steps"] == 2


def test_accumulation_a_poisoned_micro_batch_drops_the_whole_step():
    data = batches(8)
    model, opt, poison = _wrapped(max_grad_norm=1.0, accumulation_steps=2, skip_nonfinite=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        _run(model, opt, data, poison, bad={2}, accumulation=2)  # step 1's first micro-batch
    opt.synchronize()
    ref, ref_opt = _reference(data, skip_steps={1}, accumulation=2)
    assert max_diff(ref, model) < TOL
    assert _steps_of(opt) == _steps_of(ref_opt) == {3}


def test_clip_grad_norm_returns_the_nan_and_step_raises():
    """eager_updates=False without max_grad_norm: torch.nn.utils.clip_grad_norm_ (the guard)
    returns the non-finite norm as torch would, and step() applies nothing."""
    data = batches(4)
    model, opt, poison = _wrapped(eager_updates=False)
    before = [p.detach().clone() for p in model.parameters()]
    for i, (x, y) in enumerate(data[:2]):
        poison.armed = i == 1
        model(x, y).backward()
        poison.armed = False
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        if i == 0:
            opt.step()
            opt.synchronize()
            before = [p.detach().clone() for p in model.parameters()]
            opt.zero_grad()
            continue
        assert torch.isnan(norm)
        with pytest.raises(NonFiniteGradientError, match=r"clip_grad_norm_\(1\)") as info:
            opt.step()
        assert info.value.parameters == [POISONED]
    opt.synchronize()
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    opt.zero_grad()
    x, y = data[2]
    model(x, y).backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()  # trains again
    opt.synchronize()
    assert not all(torch.equal(a, b) for a, b in zip(before, model.parameters()))


def test_max_grad_norm_inf_checks_without_clipping():
    """max_grad_norm=float('inf'): equal to torch without clipping on clean data, and a poisoned
    step is refused."""
    data = batches(5)
    model, opt, poison = _wrapped(max_grad_norm=float("inf"))
    errors = _run(model, opt, data, poison, bad={3})
    assert [e is None for e in errors] == [True, True, True, False, True]
    opt.synchronize()
    ref, _ = _reference(data, skip_steps={3}, max_grad_norm=None)
    assert max_diff(ref, model) < TOL


def test_without_a_norm_nan_reaches_the_weights_as_with_torch():
    """No max_grad_norm, eager updates (the default): gradients are not checked (that would cost
    a pass over them); as with torch.optim.AdamW the poisoned parameter becomes NaN."""
    data = batches(2)
    ref = make_model(0)
    ref_poison = Poison(ref)
    model = clone(ref)
    poison = Poison(model)
    model, opt = ramstream.wrap(model, torch.optim.AdamW(model.parameters(), lr=3e-3), device="cpu")
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=3e-3, foreach=False)
    for (x, y), o, m, p in ((data[0], ref_opt, ref, ref_poison), (data[0], opt, model, poison)):
        p.armed = True
        m(x, y).backward()
        p.armed = False
        o.step()
        o.zero_grad()
    opt.synchronize()
    for name in (POISONED, "blocks.0.fc1.weight"):
        a, b = dict(ref.named_parameters())[name], dict(model.named_parameters())[name]
        assert torch.isnan(a).all() == torch.isnan(b).all()
    assert torch.isnan(dict(model.named_parameters())[POISONED]).all()


def test_skip_nonfinite_is_checked():
    model = make_model(0)
    with pytest.raises(ValueError, match="skip_nonfinite"):
        ramstream.wrap(model, torch.optim.AdamW(model.parameters()), device="cpu", skip_nonfinite=1)


def test_resident_optimizer_skips_the_same_way(monkeypatch):
    """offload="auto" after the switch to the device-side AdamW (taken on the CPU by pretending the
    device has room, as tests/test_wrap_resident.py does)."""
    import ramstream.runtime.measure as measure_mod

    monkeypatch.setattr(measure_mod, "device_memory", lambda d: {"usable": 1 << 40, "peak": 0, "now": 0})
    data = batches(6)
    model, opt, poison = _wrapped(max_grad_norm=1.0, offload="auto")
    errors = _run(model, opt, data, poison, bad={4})
    assert opt.resident
    assert [e is None for e in errors] == [True, True, True, True, False, True]
    assert errors[4].parameters == [POISONED] and errors[4].step == 5
    ref, ref_opt = _reference(data, skip_steps={4})
    assert max_diff(ref, model) < TOL
    assert _steps_of(opt) == _steps_of(ref_opt) == {5}


@pytest.mark.cuda
@pytest.mark.parametrize("mode", ["gpu", "cpu"])
def test_cuda_nonfinite_step_changes_nothing(mode):
    """The GPU engine: mapped slots (optimizer_mode="gpu": gradients wait in .grad, norms on the
    device) and host buckets; the reference is torch on the same device."""
    data = batches(5, device="cuda")
    ref = make_model(0).cuda()
    model = clone(ref)
    poison = Poison(model)
    model, opt = ramstream.wrap(
        model,
        torch.optim.AdamW(model.parameters(), lr=3e-3),
        max_grad_norm=1.0,
        optimizer_mode=mode,
        offload=True,
    )
    errors = _run(model, opt, data, poison, bad={2})
    assert [e is None for e in errors] == [True, True, False, True, True]
    assert errors[2].parameters == [POISONED]
    opt.synchronize()
    kept = [b for i, b in enumerate(data) if i != 2]
    train_torch(ref, torch.optim.AdamW(ref.parameters(), lr=3e-3, foreach=False), kept, max_grad_norm=1.0)
    assert max_diff(ref, model) < 1e-5
    assert opt.stats()["skipped_steps"] == 1


def test_offload_model_optimizer_skips_a_nonfinite_step():
    """OffloadModel's host optimizer is the same engine: the poisoned step is skipped, the
    streamed chunks' weights at home stay as they were, and training goes on."""
    torch.manual_seed(0)
    chunks = [torch.nn.Linear(16, 16) for _ in range(4)]
    model = ramstream.OffloadModel(chunks, device="cpu", window=2)
    opt = model.optimizer(lr=1e-2, max_grad_norm=1.0, skip_nonfinite=True)
    x, y = torch.randn(8, 16), torch.randn(8, 16)
    model.step(x, targets=y)
    opt.step()
    opt.zero_grad()
    opt.synchronize()
    before = [p.detach().clone() for p in model.parameters()]
    bad = x.clone()
    bad[0, 0] = float("nan")
    model.step(bad, targets=y)
    with pytest.warns(RuntimeWarning, match="skipped"):
        opt.step()
    opt.zero_grad()
    opt.synchronize()
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    model.step(x, targets=y)
    opt.step()
    opt.synchronize()
    assert all(torch.isfinite(p).all() for p in model.parameters())
    assert not all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    assert opt.stats()["skipped_steps"] == 1 and opt.stats()["steps"] == 2
    model.close()
