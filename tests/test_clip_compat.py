"""Gradient clipping calls on a wrapped model (torch.nn.utils.clip_grad_norm_ / clip_grad_value_,
optimizer.clip_grad_norm_, Accelerate's) are never silently wrong: they clip by the true global
norm and return it, compared with torch's loop, or raise naming max_grad_norm=. Also step()
before any backward."""

from __future__ import annotations

import math
import warnings

import pytest
import torch

import ramstream
import ramstream.runtime.measure as measure_mod
from ramstream import clipping

from _models import batches, clone, make_model, max_diff

clipping.install()  # torch's own functions stay in clipping._originals

LR = 3e-3


def _torch_run(model, data, k, max_norm):
    """torch's loop: clip_grad_norm_ after the last micro-batch; returns the norms."""
    opt = torch.optim.AdamW(model.parameters(), lr=LR, foreach=False)
    norms = []
    for i in range(0, len(data), k):
        for x, y in data[i : i + k]:
            model(x, y).backward()
        norms.append(clipping._originals["clip_grad_norm_"](model.parameters(), max_norm))
        opt.step()
        opt.zero_grad()
    return norms


def _wrapped_run(model, opt, data, k, clip):
    norms = []
    for i in range(0, len(data), k):
        for x, y in data[i : i + k]:
            model(x, y).backward()
        norms.append(clip(model, opt))
        opt.step()
        opt.zero_grad()
    opt.synchronize()
    return norms


CLIPS = {
    "torch.nn.utils": lambda m, o, n: torch.nn.utils.clip_grad_norm_(m.parameters(), n),
    "clip_grad module": lambda m, o, n: torch.nn.utils.clip_grad.clip_grad_norm_(
        list(m.parameters()), max_norm=n, norm_type=2
    ),
    "optimizer": lambda m, o, n: o.clip_grad_norm_(n),
}


@pytest.fixture
def roomy(monkeypatch):
    monkeypatch.setattr(measure_mod, "device_memory", lambda d: {"usable": 1 << 40, "peak": 0, "now": 0})


@pytest.mark.parametrize("how", list(CLIPS))
@pytest.mark.parametrize(
    "options",
    [
        dict(max_grad_norm=0.5),
        dict(max_grad_norm=10.0),
        dict(eager_updates=False),
        dict(eager_updates=False, accumulation_steps=2),
        dict(max_grad_norm=0.5, accumulation_steps=3),
        dict(eager_updates=False, offload="auto"),
        dict(max_grad_norm=0.5, offload="auto"),
    ],
    ids=[
        "max_grad_norm",
        "max_grad_norm-replaced",
        "deferred",
        "deferred+accumulate",
        "max_grad_norm+accumulate",
        "deferred+resident",
        "max_grad_norm+resident",
    ],
)
def test_users_clip_call_equals_torchs_loop(how, options, roomy):
    """max_norm 0.5 clips (the norm is 2-4); the limit the call passes is the one applied."""
    k = options.get("accumulation_steps", 1)
    data = batches(5 * k, b=4)
    base = make_model(0)
    ref = clone(base)
    ref_norms = _torch_run(ref, data, k, 0.5)
    model, opt = ramstream.wrap(
        clone(base), lr=LR, device="cpu", bucket_bytes=1 << 14, **{"offload": True, **options}
    )
    norms = _wrapped_run(model, opt, data, k, lambda m, o: CLIPS[how](m, o, 0.5))
    assert opt.resident == (options.get("offload") == "auto")
    for a, b in zip(norms, ref_norms):
        assert a.dtype == torch.float32 and a.shape == () and a.device == b.device
        assert math.isclose(float(a), float(b), rel_tol=1e-5)
    assert min(float(n) for n in ref_norms) > 0.5  # every step was clipped
    assert max_diff(ref, model) < 1e-6


def test_infinite_limit_measures_without_clipping():
    data = batches(3, b=4)
    base = make_model(0)
    ref = clone(base)
    ref_norms = _torch_run(ref, data, 1, float("inf"))
    model, opt = ramstream.wrap(clone(base), lr=LR, device="cpu", eager_updates=False)
    norms = _wrapped_run(
        model, opt, data, 1, lambda m, o: torch.nn.utils.clip_grad_norm_(m.parameters(), math.inf)
    )
    assert all(math.isclose(float(a), float(b), rel_tol=1e-5) for a, b in zip(norms, ref_norms))
    assert max_diff(ref, model) < 1e-6


@pytest.mark.parametrize(
    "call",
    [
        lambda m, o: torch.nn.utils.clip_grad_norm_(m.parameters(), 1.0),
        lambda m, o: torch.nn.utils.clip_grad.clip_grad_norm_(m.parameters(), 1.0),
        lambda m, o: o.clip_grad_norm_(1.0),
    ],
    ids=["torch.nn.utils", "clip_grad", "optimizer"],
)
def test_eager_updates_without_max_grad_norm_raise(call):
    model, opt = ramstream.wrap(make_model(0), lr=LR, device="cpu")
    x, y = batches(1)[0]
    model(x, y).backward()
    with pytest.raises(RuntimeError, match=r"max_grad_norm=.*eager_updates=False"):
        call(model, opt)


@pytest.mark.parametrize("options", [{}, dict(max_grad_norm=1.0), dict(eager_updates=False)])
def test_clip_grad_value_raises_naming_max_grad_norm(options):
    model, opt = ramstream.wrap(make_model(0), lr=LR, device="cpu", **options)
    x, y = batches(1)[0]
    model(x, y).backward()
    for fn in (torch.nn.utils.clip_grad_value_, torch.nn.utils.clip_grad.clip_grad_value_):
        with pytest.raises(RuntimeError, match="max_grad_norm="):
            fn(model.parameters(), 0.1)


def test_plain_models_still_get_torchs_functions():
    ramstream.wrap(make_model(1), lr=LR, device="cpu")  # the guard is installed
    assert torch.nn.utils.clip_grad_norm_ is clipping._guarded_norm
    a, b = make_model(0), make_model(0)
    x, y = batches(1)[0]
    a(x, y).backward()
    b(x, y).backward()
    na = torch.nn.utils.clip_grad_norm_(a.parameters(), 0.3, error_if_nonfinite=True)
    nb = clipping._originals["clip_grad_norm_"](b.parameters(), 0.3)
    assert torch.equal(na, nb)
    torch.nn.utils.clip_grad_value_(a.parameters(), 1e-3)
    clipping._originals["clip_grad_value_"](b.parameters(), 1e-3)
    assert all(torch.equal(p.grad, q.grad) for p, q in zip(a.parameters(), b.parameters()))
    assert float(torch.nn.utils.clip_grad_norm_([], 1.0)) == 0.0


def test_subsets_mixes_and_bad_arguments_raise():
    model, opt = ramstream.wrap(make_model(0), lr=LR, device="cpu", max_grad_norm=1.0)
    other = torch.nn.Linear(2, 2)
    other(torch.ones(1, 2)).sum().backward()
    x, y = batches(1)[0]
    model(x, y).backward()
    with pytest.raises(ValueError, match="leave out 1 of its trainable"):
        torch.nn.utils.clip_grad_norm_(list(model.parameters())[1:], 1.0)
    with pytest.raises(ValueError, match="add 2 others"):
        torch.nn.utils.clip_grad_norm_(list(model.parameters()) + list(other.parameters()), 1.0)
    with pytest.raises(ValueError, match="norm_type=1"):
        opt.clip_grad_norm_(1.0, norm_type=1)
    with pytest.raises(ValueError, match="max_norm=-1"):
        torch.nn.utils.clip_grad_norm_(model.parameters(), -1)
    assert float(opt.clip_grad_norm_(torch.tensor(1.0))) > 0


def test_nonfinite_norm_raises_when_asked():
    model, opt = ramstream.wrap(make_model(0), lr=LR, device="cpu", max_grad_norm=1.0)
    x, y = batches(1)[0]
    (model(x, y) * float("inf")).backward()
    with pytest.raises(RuntimeError, match="non-finite"):
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0, error_if_nonfinite=True)


def test_a_backward_after_the_clip_call_is_refused_at_step():
    model, opt = ramstream.wrap(make_model(0), lr=LR, device="cpu", accumulation_steps=2, eager_updates=False)
    before = [m.clone() for m in opt.master_weights()]
    (x, y), (x2, y2) = batches(2)
    model(x, y).backward()
    opt.clip_grad_norm_(1.0)
    model(x2, y2).backward()
    with pytest.raises(RuntimeError, match="after clip_grad_norm_"):
        opt.step()
    opt.zero_grad()
    assert all(torch.equal(a, b) for a, b in zip(before, opt.master_weights()))


def test_called_twice_returns_the_same_norm_and_the_last_limit_applies():
    data = batches(2, b=4)
    base = make_model(0)
    ref = clone(base)
    _torch_run(ref, data, 1, 0.2)
    model, opt = ramstream.wrap(clone(base), lr=LR, device="cpu", max_grad_norm=5.0)

    def twice(m, o):
        n = o.clip_grad_norm_(math.inf)  # Trainer logs, then clips
        assert torch.equal(n, o.clip_grad_norm_(0.2))
        return n

    _wrapped_run(model, opt, data, 1, twice)
    assert max_diff(ref, model) < 1e-6


def test_accelerate_routes_to_ramstream():
    accelerate = pytest.importorskip("accelerate")
    acc = accelerate.Accelerator(cpu=True)
    data = batches(3, b=4)
    base = make_model(0)
    ref = clone(base)
    ref_norms = _torch_run(ref, data, 1, 0.5)
    model, opt = ramstream.wrap(clone(base), lr=LR, device="cpu", max_grad_norm=0.5)
    norms = _wrapped_run(model, opt, data, 1, lambda m, o: acc.clip_grad_norm_(m.parameters(), 0.5))
    assert all(math.isclose(float(a), float(b), rel_tol=1e-5) for a, b in zip(norms, ref_norms))
    assert max_diff(ref, model) < 1e-6


@pytest.mark.parametrize("offload", [True, "auto"])
def test_step_before_any_backward_warns_once_and_changes_nothing(offload):
    model, opt = ramstream.wrap(make_model(0), lr=LR, device="cpu", offload=offload)
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.warns(RuntimeWarning, match="before any backward pass"):
        opt.step()
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        opt.step()  # once per optimizer
        x, y = batches(1)[0]
        model(x, y).backward()
        opt.step()
    assert float(opt.state_dict()["state"][0]["step"]) == 1  # the empty steps took no AdamW step
    assert not all(torch.equal(a, p) for a, p in zip(before, model.parameters()))


def test_no_warning_when_the_first_step_has_gradients():
    model, opt = ramstream.wrap(make_model(0), lr=LR, device="cpu")
    x, y = batches(1)[0]
    model(x, y).backward()
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        opt.step()
        opt.step()  # no gradients now: torch is silent too
