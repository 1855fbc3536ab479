"""wrap(delayed_update=...)'s check (planner/policy.py delayed_verdict, runtime/apply.py
_check_delayed): delayed_update keeps the whole optimizer state on the host, so where the plan
without it updates a share on the GPU it can be slower; wrap() says so with both predictions. The
verdict is checked against the two plans' own predictions on injected profiles."""

from __future__ import annotations

import types
import warnings

import pytest

from ramstream.planner import HardwareProfile, ModelShape, plan_training
from ramstream.planner.policy import delayed_verdict
from ramstream.planner.rules import DELAYED_SLOWER

G = 2**30
SHAPE = ModelShape.gpt("6.85b", batch=8, seq=512, dtype="bf16")


def prof(vram_gib=24):
    return HardwareProfile(device="cuda:0", vram_total=vram_gib * G, vram_free=vram_gib * G, ram_total=120 * G,
                           ram_available=120 * G, pin_budget=60 * G, h2d_gbps=55.0, d2h_gbps=55.0,
                           duplex_gbps=50.0, adamw_gbps=115.0, matmul_tflops=790.0)  # fmt: skip


def plans(**kw):
    return (
        plan_training(SHAPE, prof(), delayed_update=True, **kw),
        plan_training(SHAPE, prof(), delayed_update=False, **kw),
    )


def test_where_the_plan_shares_the_update_with_the_gpu_delayed_is_predicted_slower_and_said():
    delayed, plain = plans(moment_dtype="bfloat16")
    split = plain.optimizer["split"]
    assert split["device"] + split["mapped"] > 0.2 and delayed.optimizer["split"]["host"] == 1.0
    d, p = delayed.predicted["step_s"], plain.predicted["step_s"]
    assert d > p * (1 + DELAYED_SLOWER)  # the premise, from the planner's own timing
    text = delayed_verdict(delayed, plain)
    assert f"{d:.3f} s/step with it" in text and f"{p:.3f} s without it" in text
    assert f"{split['device'] + split['mapped']:.0%} of it on the GPU" in text


def test_where_the_host_updates_everything_anyway_nothing_is_said():
    delayed, plain = plans(moment_dtype="bfloat16", optimizer_mode="cpu")
    assert plain.optimizer["split"]["host"] == 1.0
    assert delayed.predicted["step_s"] <= plain.predicted["step_s"] * (1 + DELAYED_SLOWER)
    assert delayed_verdict(delayed, plain) is None


def test_wrap_warns_and_logs_with_the_plan_without_delay(monkeypatch):
    from ramstream.runtime import apply, inspect

    delayed, plain = plans(moment_dtype="bfloat16")
    seen = {}

    def fake_plan_model(model, blocks, profile, **kw):
        seen.update(kw)
        return plain, SHAPE

    monkeypatch.setattr(inspect, "plan_model", fake_plan_model)
    opts = types.SimpleNamespace(batch=8, seq=512, loss="chunked", delayed_update=40)
    logged = []
    with pytest.warns(UserWarning, match="delayed_update is predicted slower"):
        apply._check_delayed(None, None, [], prof(), opts, {"delayed_update": 40}, delayed, logged.append)
    assert seen["delayed_update"] is False and seen["loss"] == "chunked"
    assert logged and "s/step with it" in logged[0]
    # a plan without delay that is not faster: silent
    monkeypatch.setattr(inspect, "plan_model", lambda *a, **k: (delayed, SHAPE))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        apply._check_delayed(None, None, [], prof(), opts, {"delayed_update": 40}, delayed, logged.append)
    assert len(logged) == 1
