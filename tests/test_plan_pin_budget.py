"""The planner's mapped optimizer share under the page-lock budget (planner/host_fit.py
cap_mapped_to_pin): the runtime keeps a bucket on the host when the arena cannot page-lock its
mapped state (engine/layout.py), so the plan cuts the mapped share to what the budget holds beside
the landing buffers, says so, and times the host work that follows. Checked against the plan with a
budget that holds everything and against float64 arithmetic on the plan's own byte counts."""

from __future__ import annotations

import pytest

from ramstream.planner import HardwareProfile, ModelShape, plan_training

G = 2**30


def prof(pin_gib: float, ram_gib: float = 120.0) -> HardwareProfile:
    return HardwareProfile(device="cuda:0", vram_total=24 * G, vram_free=24 * G, ram_total=int(ram_gib * G),
                           ram_available=int(ram_gib * G), pin_budget=int(pin_gib * G), h2d_gbps=55.0,
                           d2h_gbps=55.0, duplex_gbps=50.0, adamw_gbps=115.0, matmul_tflops=790.0)  # fmt: skip


SHAPE = ModelShape.gpt("6.85b", batch=8, seq=512, dtype="bf16")


def _plan(pin_gib: float, **kw):
    return plan_training(SHAPE, prof(pin_gib), moment_dtype="bfloat16", **kw)


def _cut_reason(plan) -> list[str]:
    return [r for r in plan.reasons if "do" in r and "not fit the page-lock budget" in r]


def test_a_budget_that_holds_the_mapped_state_changes_nothing():
    plan = _plan(64)
    pinned = plan.memory["pinned"]
    assert plan.optimizer["split"]["mapped"] > 0.2  # the case the cut is about: a large mapped share
    assert pinned["total"] <= pinned["budget"]
    assert not _cut_reason(plan)


def test_a_smaller_budget_cuts_the_mapped_share_to_what_it_holds_and_says_so():
    big, small = _plan(64), _plan(20)
    pinned = small.memory["pinned"]
    assert pinned["total"] <= 20 * G
    m_big, m_small = big.optimizer["split"]["mapped"], small.optimizer["split"]["mapped"]
    assert 0 < m_small < m_big
    # every element the cut moves to the host adds its landing slot (2 B, bf16) and frees its
    # mapped master and moments (4 + 2 + 2 B): the pinned total fills the budget to within one
    # element's bytes
    assert 20 * G - pinned["total"] < 6
    n = SHAPE.trained_numel
    assert pinned["mapped_state"] == pytest.approx(m_small * n * 8.0, rel=1e-6)
    (reason,) = _cut_reason(small)
    assert "20.00 GiB" in reason and "RAMSTREAM_PIN_BUDGET" in reason
    # the host updates more: its predicted AdamW time grows, the step is not faster
    assert small.bounds["host_adamw_s"] > big.bounds["host_adamw_s"]
    assert small.predicted["step_s"] >= big.predicted["step_s"]


def test_a_budget_the_landing_buffers_already_fill_leaves_nothing_mapped():
    plan = _plan(12)
    assert plan.optimizer["split"]["mapped"] == 0.0
    assert plan.memory["pinned"]["mapped_state"] == 0
    assert _cut_reason(plan)
    # the landing buffers alone exceed it: said as before
    assert any("> the page-lock budget 12.00 GiB" in r for r in plan.reasons)


def test_optimizer_mode_gpu_keeps_every_element_off_the_host():
    plan = _plan(12, optimizer_mode="gpu")  # the GPU updates all of it: nothing to cut to
    split = plan.optimizer["split"]
    assert split["host"] == 0.0 and split["mapped"] + split["device"] == pytest.approx(1.0)
    assert not _cut_reason(plan)
