"""wrap(delayed_update=...)'s check (planner/policy.py delayed_verdict, runtime/apply.py
_check_delayed) and the delayed plan's split (planner/delayed_split.py): only host-updated
parameters are delayed and there is no resident plan with it, so where the GPU would update
everything there is nothing to delay, and wrap() says so; with optimizer_mode="auto" the delayed
plan keeps the VRAM share and chooses the GPU's mapped share (not delayed) for the delay. Checked
against the plans' own predictions on injected profiles."""

from __future__ import annotations

import types
import warnings

import pytest

from ramstream.planner import HardwareProfile, ModelShape, plan_training
from ramstream.planner.policy import delayed_verdict
from ramstream.planner.rules import DELAYED_SLOWER

G = 2**30
SHAPE = ModelShape.gpt("6.85b", batch=8, seq=512, dtype="bf16")
SMALL = ModelShape.gpt("1.8b", batch=8, seq=512, dtype="bf16")


def prof(vram_gib=24):
    return HardwareProfile(device="cuda:0", vram_total=vram_gib * G, vram_free=vram_gib * G, ram_total=120 * G,
                           ram_available=120 * G, pin_budget=60 * G, h2d_gbps=55.0, d2h_gbps=55.0,
                           duplex_gbps=50.0, adamw_gbps=115.0, matmul_tflops=790.0)  # fmt: skip


def plans(shape=SHAPE, vram_gib=24, **kw):
    return (
        plan_training(shape, prof(vram_gib), delayed_update=True, **kw),
        plan_training(shape, prof(vram_gib), delayed_update=False, **kw),
    )


def test_where_the_gpu_updates_everything_delayed_has_nothing_to_delay_and_says_so():
    """1.82B on an 80 GiB GPU: without delay the plan is resident; with it (no resident switch) the
    VRAM share takes every parameter, so nothing is host-updated and nothing is delayed."""
    delayed, plain = plans(SMALL, vram_gib=80, moment_dtype="bfloat16")
    assert plain.mode == "resident" and delayed.mode == "offload"
    assert delayed.optimizer["split"]["host"] == 0.0
    text = delayed_verdict(delayed, plain)
    assert text.startswith("delayed_update has nothing to delay") and "100% of the state in VRAM" in text


def test_a_plan_without_delay_predicted_faster_is_said_with_both_numbers():
    """The verdict's arithmetic on given predictions (the planner's own plans with delay are not
    slower where they share the update: the next test)."""
    from types import SimpleNamespace as NS

    split = {"device": 0.25, "mapped": 0.25, "host": 0.5}
    delayed = NS(predicted={"step_s": 1.2, "bound": "host_adamw"}, bounds={"host_adamw_s": 1.1},
                 optimizer={"split": split}, mode="offload")  # fmt: skip
    plain = NS(
        predicted={"step_s": 1.0, "bound": "gpu_compute"},
        bounds={},
        optimizer={"split": split},
        mode="offload",
    )
    text = delayed_verdict(delayed, plain)
    assert "1.200 s/step with it" in text and "1.000 s without it" in text and "50% of the parameters" in text
    plain.predicted["step_s"] = 1.2 / (1 + DELAYED_SLOWER)  # within the margin: silent
    assert delayed_verdict(delayed, plain) is None


def test_auto_keeps_an_undelayed_mapped_share_balanced_for_the_delay(monkeypatch):
    """6.85B and 1.82B at 24 GiB: with "auto" the delayed plan keeps the VRAM share of the plan
    without delay and a mapped share (both the GPU's, undelayed) sized so that the GPU lane and the
    host AdamW, which now runs beside the next step, balance: it beats every other share of the
    grid and the all-host (optimizer_mode="cpu") delayed plan, and is faster than the plan without
    delay."""
    from ramstream.planner.rules import DELAYED_SPLIT_STEPS

    for shape in (SHAPE, SMALL):
        delayed, plain = plans(shape, moment_dtype="bfloat16")
        ds, ps = delayed.optimizer["split"], plain.optimizer["split"]
        assert (
            ds["device"] == ps["device"] and ds["mapped"] > 0 and ds["host"] > 0 and delayed.mode == "offload"
        )
        b = delayed.bounds
        assert b["host_lane_s"] == pytest.approx(b["host_adamw_s"])  # the host lane: the update alone
        cpu = plan_training(shape, prof(), delayed_update=True, moment_dtype="bfloat16", optimizer_mode="cpu")
        assert delayed.predicted["step_s"] < cpu.predicted["step_s"]
        assert delayed.predicted["step_s"] < plain.predicted["step_s"]
        assert delayed_verdict(delayed, plain) is None
    # the grid's other shares predict no shorter step (the same planner, its own step function)
    from ramstream.planner import delayed_split

    seen = []
    real = delayed_split.choose

    def checked(split, streamed_trained, step_s, cap):
        out = real(split, streamed_trained, step_s, cap)
        seen.append(step_s(out))
        rest = split["mapped"] + split["host"]
        for k in (0, DELAYED_SPLIT_STEPS // 4, DELAYED_SPLIT_STEPS // 2, DELAYED_SPLIT_STEPS):
            m = (rest - streamed_trained) * k // DELAYED_SPLIT_STEPS
            t = step_s(cap({**split, "mapped": m, "host": rest - m}))
            assert seen[-1] <= t * (1 + 1e-9), (k, seen[-1], t)
        return out

    monkeypatch.setattr(delayed_split, "choose", checked)
    plan_training(SHAPE, prof(), delayed_update=True, moment_dtype="bfloat16")
    assert seen


def test_where_the_host_updates_everything_anyway_nothing_is_said():
    delayed, plain = plans(moment_dtype="bfloat16", optimizer_mode="cpu")
    assert plain.optimizer["split"]["host"] == 1.0
    assert delayed.predicted["step_s"] <= plain.predicted["step_s"] * (1 + DELAYED_SLOWER)
    assert delayed_verdict(delayed, plain) is None


def test_wrap_warns_and_logs_with_the_plan_without_delay(monkeypatch):
    from ramstream.runtime import apply, inspect

    delayed, plain = plans(SMALL, vram_gib=80, moment_dtype="bfloat16")
    seen = {}

    def fake_plan_model(model, blocks, profile, **kw):
        seen.update(kw)
        return plain, SMALL

    monkeypatch.setattr(inspect, "plan_model", fake_plan_model)
    opts = types.SimpleNamespace(batch=8, seq=512, loss="chunked", delayed_update=40)
    logged = []
    with pytest.warns(UserWarning, match="delayed_update has nothing to delay"):
        apply._check_delayed(None, None, [], prof(), opts, {"delayed_update": 40}, delayed, logged.append)
    assert seen["delayed_update"] is False and seen["loss"] == "chunked"
    assert logged and "leave delayed_update=False" in logged[0]
    # a delayed plan with a host share, not slower than the plan without delay: silent
    delayed, plain = plans(SMALL, moment_dtype="bfloat16")
    assert delayed.optimizer["split"]["host"] > 0
    monkeypatch.setattr(inspect, "plan_model", lambda *a, **k: (plain, SMALL))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        apply._check_delayed(None, None, [], prof(), opts, {"delayed_update": 40}, delayed, logged.append)
    assert len(logged) == 1
