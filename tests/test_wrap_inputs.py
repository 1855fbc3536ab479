"""Inputs wrap() and `ramstream plan` check where they enter (issue 25, items 5, 7 and 8): a model
without parameters or on the meta device, an optimizer over another model's parameters, and the
plan CLI's numbers and its GPU memory when no GPU is visible."""

from __future__ import annotations

import pytest
import torch

import ramstream
from ramstream.cli import main

from _models import batches, make_model, train_torch


def test_a_model_without_parameters_is_refused():
    with pytest.raises(ValueError, match=r"wrap\(\): the model \(Module\) has no parameters"):
        ramstream.wrap(torch.nn.Module(), device="cpu")


def test_a_meta_device_model_is_refused_before_anything_changes():
    with torch.device("meta"):
        model = make_model(0)
    with pytest.raises(ValueError, match="on the meta device"):
        ramstream.wrap(model, device="cpu")
    assert getattr(model, "_ramstream", None) is None


def test_an_optimizer_over_another_model_is_refused_and_the_right_one_trains():
    model, other = make_model(0), make_model(1)
    with pytest.raises(ValueError, match=r"21 of the optimizer's 21 trainable parameters are not parameters"):
        ramstream.wrap(model, torch.optim.AdamW(other.parameters()), device="cpu")
    assert getattr(model, "_ramstream", None) is None
    before = [p.detach().clone() for p in model.parameters()]
    model, opt = ramstream.wrap(model, torch.optim.AdamW(model.parameters(), lr=1e-2), device="cpu")
    train_torch(model, opt, batches(2))
    opt.synchronize()
    assert any(not torch.equal(a, b.detach()) for a, b in zip(before, model.parameters()))


@pytest.mark.parametrize("flag, value", [("--vram-gb", "nan"), ("--vram-gb", "-1"), ("--ram-gb", "0"),
                                         ("--h2d-gbps", "inf"), ("--tflops", "-5")])  # fmt: skip
def test_plan_cli_rejects_numbers_that_are_not_finite_and_positive(flag, value, capsys):
    assert main(["plan", "--gpt", "125m", "--vram-gb", "24", flag, value]) == 2
    assert f"{flag} must be a finite number > 0" in capsys.readouterr().err


def test_plan_cli_asks_for_the_gpu_memory_when_no_gpu_is_visible(capsys, monkeypatch, tmp_path):
    import ramstream.planner.profile as profile_mod

    monkeypatch.setenv("RAMSTREAM_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(profile_mod, "cached_profile", lambda *a, **k: None)  # no GPU profile, even on a GPU
    assert main(["plan", "--gpt", "125m"]) == 2
    assert "pass --vram-gb" in capsys.readouterr().err
    assert main(["plan", "--gpt", "125m", "--vram-gb", "24", "--ram-gb", "64"]) == 0
