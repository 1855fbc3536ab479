"""wrap(delayed_update=...)'s check (planner/policy.py delayed_verdict, runtime/apply.py
_check_delayed) and the delayed plan's split (planner/plan.py _delayed_split): delayed_update keeps
the optimizer state out of VRAM, so where the plan without it keeps a share of the state in VRAM it
can be slower, and wrap() says so with both predictions; with optimizer_mode="auto" the GPU's
mapped share (not delayed) is chosen for the delay. Checked against the plans' own predictions on
injected profiles."""

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


def plans(shape=SHAPE, **kw):
    return (
        plan_training(shape, prof(), delayed_update=True, **kw),
        plan_training(shape, prof(), delayed_update=False, **kw),
    )


def test_where_the_plan_keeps_state_in_vram_delayed_is_predicted_slower_and_said():
    delayed, plain = plans(SMALL, moment_dtype="bfloat16")
    split, dsplit = plain.optimizer["split"], delayed.optimizer["split"]
    assert split["device"] > 0.2 and dsplit["device"] == 0.0  # delayed: no VRAM share
    d, p = delayed.predicted["step_s"], plain.predicted["step_s"]
    assert d > p * (1 + DELAYED_SLOWER)  # the premise, from the planner's own timing
    text = delayed_verdict(delayed, plain)
    assert f"{d:.3f} s/step with it" in text and f"{p:.3f} s without it" in text
    assert f"the state of {split['device']:.0%} in VRAM" in text
    assert f"{dsplit['mapped']:.0%} by the GPU over PCIe" in text


def test_auto_keeps_an_undelayed_mapped_share_balanced_for_the_delay():
    """6.85B at 24 GiB: no room for a VRAM share worth having; with "auto" the delayed plan keeps a
    mapped share (the GPU's, undelayed) sized so that the GPU lane and the host AdamW, which now
    runs beside the next step, balance: it beats every other share of the grid, the all-host
    (optimizer_mode="cpu") delayed plan, and is not slower than the plan without delay."""
    from ramstream.planner import plan as plan_mod
    from ramstream.planner.rules import DELAYED_SPLIT_STEPS

    delayed, plain = plans(moment_dtype="bfloat16")
    ds = delayed.optimizer["split"]
    assert ds["device"] == 0.0 and 0.1 < ds["mapped"] < 0.9 and delayed.mode == "offload"
    b = delayed.bounds
    assert b["host_lane_s"] == pytest.approx(b["host_adamw_s"])  # the host lane: the update alone
    cpu = plan_training(SHAPE, prof(), delayed_update=True, moment_dtype="bfloat16", optimizer_mode="cpu")
    assert delayed.predicted["step_s"] < cpu.predicted["step_s"]
    assert delayed.predicted["step_s"] <= plain.predicted["step_s"] * (1 + DELAYED_SLOWER)
    assert delayed_verdict(delayed, plain) is None
    # the grid's other shares predict no shorter step (the same planner with the share forced)
    seen = []
    real = plan_mod._delayed_split

    def forced(ctx, streamed, paged, modes, moment, split, streamed_tr):
        out = real(ctx, streamed, paged, modes, moment, split, streamed_tr)
        seen.append(plan_mod.step_of(plan_mod._times(ctx, streamed, paged, modes, moment, out))[0])
        for k in (0, DELAYED_SPLIT_STEPS // 4, DELAYED_SPLIT_STEPS // 2, DELAYED_SPLIT_STEPS):
            movable = split["mapped"] + split["host"] - streamed_tr
            m = movable * k // DELAYED_SPLIT_STEPS
            other = {**split, "mapped": m, "host": split["mapped"] + split["host"] - m}
            t = plan_mod.step_of(plan_mod._times(ctx, streamed, paged, modes, moment, other))[0]
            assert seen[-1] <= t * (1 + 1e-9), (k, seen[-1], t)
        return out

    plan_mod._delayed_split = forced
    try:
        plan_training(SHAPE, prof(), delayed_update=True, moment_dtype="bfloat16")
    finally:
        plan_mod._delayed_split = real
    assert seen


def test_where_the_host_updates_everything_anyway_nothing_is_said():
    delayed, plain = plans(moment_dtype="bfloat16", optimizer_mode="cpu")
    assert plain.optimizer["split"]["host"] == 1.0
    assert delayed.predicted["step_s"] <= plain.predicted["step_s"] * (1 + DELAYED_SLOWER)
    assert delayed_verdict(delayed, plain) is None


def test_wrap_warns_and_logs_with_the_plan_without_delay(monkeypatch):
    from ramstream.runtime import apply, inspect

    delayed, plain = plans(SMALL, moment_dtype="bfloat16")
    seen = {}

    def fake_plan_model(model, blocks, profile, **kw):
        seen.update(kw)
        return plain, SMALL

    monkeypatch.setattr(inspect, "plan_model", fake_plan_model)
    opts = types.SimpleNamespace(batch=8, seq=512, loss="chunked", delayed_update=40)
    logged = []
    with pytest.warns(UserWarning, match="delayed_update is predicted slower"):
        apply._check_delayed(None, None, [], prof(), opts, {"delayed_update": 40}, delayed, logged.append)
    assert seen["delayed_update"] is False and seen["loss"] == "chunked"
    assert logged and "s/step with it" in logged[0]
    # a plan without delay that is not faster: silent
    monkeypatch.setattr(inspect, "plan_model", lambda *a, **k: (delayed, SMALL))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        apply._check_delayed(None, None, [], prof(), opts, {"delayed_update": 40}, delayed, logged.append)
    assert len(logged) == 1
