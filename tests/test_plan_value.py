"""The plan is a value (issue 24): ramstream.plan_for() returns the Plan wrap() applies, wrap(plan=)
applies a pinned one exactly, the planner counts the dense loss's logits and either fits every cell
of the 8-24 GiB matrix or refuses with the arithmetic, a step larger than the plan is refused before
it runs, and a resident switch gives back fp32 moments that host RAM alone had made bf16."""

from __future__ import annotations

import pytest
import torch

import ramstream
import ramstream.runtime.measure as measure_mod
from ramstream.planner import PlanError, plan_training
from ramstream.planner.profile import HardwareProfile
from ramstream.planner.shape import ModelShape
from ramstream.runtime.history import PlanHistory
from ramstream.runtime.inspect import model_shape, plan_for
from ramstream.runtime.tokens import PlanOutOfMemoryError, StepCheck, step_tokens

from _models import batches, clone, make_model, max_diff, train_torch

GIB = 2**30
LR = 3e-3


def _h200(vram_gib: float, ram_gib: float = 120.0) -> HardwareProfile:
    """The H200 machine's rates (planner/cli_plan.py DEFAULT_RATES) under a VRAM cap."""
    v = int(vram_gib * GIB)
    return HardwareProfile(device="cuda", gpu_name="H200 (injected)", vram_total=v, vram_free=v,
                           ram_total=int(ram_gib * GIB), ram_available=int(ram_gib * GIB), pin_budget=int(ram_gib * GIB) // 2,
                           h2d_gbps=54.9, d2h_gbps=55.0, duplex_gbps=49.5, adamw_gbps=127.7, matmul_tflops=790.0,
                           source="given")  # fmt: skip


def _tight_profile(model, blocks_resident: float) -> HardwareProfile:
    """A GPU profile with room for about `blocks_resident` of the model's weights (and its tiny
    activations), so that the plan streams the rest."""
    w = sum(p.numel() * p.element_size() for p in model.parameters())
    free = int((w * blocks_resident + (2 << 20)) / 0.9)  # + gradients in flight (>= 1 MiB), slack
    return HardwareProfile(
        device="cuda", vram_total=4 * w, vram_free=free, ram_total=64 * GIB,
        ram_available=64 * GIB, pin_budget=32 * GIB, h2d_gbps=54.9, d2h_gbps=55.0, duplex_gbps=49.5,
        adamw_gbps=127.7, matmul_tflops=790.0, source="given",
    )  # fmt: skip


# ---- the matrix, as injected profiles -----------------------------------------------------------
ROWS = {
    "gpt1.8b fp32 autocast 8x512": lambda: ModelShape.gpt(
        "1.8b", batch=8, seq=512, dtype="float32", autocast="bf16"
    ),
    "gpt6.85b bf16 8x512": lambda: ModelShape.gpt("6.85b", batch=8, seq=512),
    "gpt6.85b bf16 16x2048 chunked": lambda: ModelShape.gpt("6.85b", batch=16, seq=2048, loss="chunked"),
}


@pytest.mark.parametrize("cap", [8, 12, 16, 24])
@pytest.mark.parametrize("row", sorted(ROWS))
def test_matrix_plans_fit_their_budget_with_the_loss_counted_or_refuse_with_arithmetic(row, cap):
    shape = ROWS[row]()
    prof = _h200(cap)
    try:
        plan = plan_training(shape, prof)
    except PlanError as e:
        assert "does not fit" in str(e) and e.arithmetic["vram"]["budget"] == int(cap * GIB * 0.9)
        return
    vram = plan.memory["vram"]
    assert vram["total"] <= vram["budget"] == int(cap * GIB * 0.9)
    if shape.loss == "dense":  # the logits, their fp32 copy and gradient are part of the forward peak
        expected = shape.tokens * shape.vocab * (shape.act_elem_bytes + 8)
        assert vram.get("logits") == expected or vram.get("gradients_in_flight", 0) >= expected


def test_the_default_step_halves_until_it_fits_and_says_so():
    model = make_model(0, n_blocks=4, vocab=512, d=32)
    w = sum(p.numel() * p.element_size() for p in model.parameters())
    # room for the weights and the logits of about 2 x 512 tokens, not of 8 x 512
    logits_per_token = 512 * (4 + 8)
    prof = _tight_profile(model, 1.0)
    prof.vram_free = int((w * 1.2 + 2.5 * 512 * logits_per_token) / 0.9)
    plan = plan_for(model, profile=prof)
    assert plan.shape["batch"] * plan.shape["seq"] < 8 * 512
    assert any("does not fit" in r and "pass batch= and seq=" in r for r in plan.reasons)
    big = plan_for(model, profile=prof, batch=1, seq=256)
    assert (big.shape["batch"], big.shape["seq"]) == (1, 256)


def test_plan_for_is_the_planner_on_the_live_shape():
    model = make_model(0, n_blocks=8, d=128)
    prof = _tight_profile(model, 0.5)
    got = plan_for(model, profile=prof, batch=2, seq=8)
    shape = model_shape(model, list(model.blocks), batch=2, seq=8, loss="dense")
    want = plan_training(shape, prof, quantize="none")
    assert got.to_dict() == want.to_dict()


def test_wrap_applies_a_pinned_plan_exactly_and_trains_as_torch():
    ref = make_model(0, n_blocks=8, d=128)
    prof = _tight_profile(ref, 0.6)
    plan = plan_for(ref, profile=prof, batch=4, seq=8, activation_checkpointing=[1, 3])
    assert plan.weights["streamed"], "the tight profile must make the plan stream"
    model = clone(ref)
    data = batches(4)
    train_torch(
        ref, torch.optim.AdamW(ref.parameters(), lr=LR, fused=True), data
    )  # the host kernel's contract
    model, opt = ramstream.wrap(model, torch.optim.AdamW(model.parameters(), lr=LR), device="cpu", plan=plan)
    rep = ramstream.memory_report(model)["plan"]
    assert rep["weights"]["streamed"] == plan.weights["streamed"]
    assert rep["planner"]["streamed"] == plan.weights["streamed"]
    assert rep["recompute"] == [1, 3] == rep["planner"]["recompute"]
    train_torch(model, opt, data)
    assert max_diff(ref, model) == 0.0  # streaming and recompute are bit-exact


def test_a_pinned_plan_for_another_model_is_refused():
    plan = plan_for(make_model(0, n_blocks=4), profile=_h200(24), batch=1, seq=8)
    model = make_model(0, n_blocks=3)
    with pytest.raises(ValueError, match="plan was made for 4 blocks, but this model has 3"):
        ramstream.wrap(model, device="cpu", plan=plan)


@pytest.mark.parametrize(
    "opt, err",
    [
        ({"batch": 0}, ValueError),
        ({"seq": 1.5}, ValueError),
        ({"loss": "sparse"}, ValueError),
        ({"plan": {"mode": "offload"}}, TypeError),
    ],
)
def test_bad_plan_options_name_the_option(opt, err):
    with pytest.raises(err, match=next(iter(opt))):
        ramstream.wrap(make_model(0), device="cpu", **opt)


def test_plan_for_rejects_bad_arguments():
    model = make_model(0)
    with pytest.raises(ValueError, match="unknown option"):
        plan_for(model, profile=_h200(8), lr=1.0)
    with pytest.raises(ValueError, match="batch=0"):
        plan_for(model, profile=_h200(8), batch=0)
    with pytest.raises(TypeError, match="profile must be a HardwareProfile"):
        plan_for(model, profile={"vram_free": 1})
    with pytest.raises(TypeError, match="model must be"):
        plan_for("model")


# ---- a step larger than the plan ------------------------------------------------------------------
def test_step_tokens_reads_ids_and_embeddings():
    ids = torch.zeros(3, 7, dtype=torch.long)
    assert step_tokens((ids,), {}) == (3, 7)
    assert step_tokens((), {"input_ids": ids}) == (3, 7)
    assert step_tokens((torch.zeros(2, 5, 16),), {}) == (2, 5)
    assert step_tokens((torch.zeros(4),), {}) is None


def test_a_step_larger_than_the_plan_is_refused_before_it_runs_and_one_that_fits_passes():
    shape = ModelShape.gpt("1.8b", batch=8, seq=512, dtype="float32", autocast="bf16")
    prof = _h200(24)
    plan = plan_training(shape, prof)
    fixed = {"param_offload": plan.weights["streamed"],
             "activation_checkpointing": [i for i, m in enumerate(plan.activations) if m == "recompute"]}  # fmt: skip
    logs, history = [], PlanHistory()
    check = StepCheck(shape, prof, fixed, logs.append, history)
    ids = lambda b, s: torch.zeros(b, s, dtype=torch.long)  # noqa: E731
    assert check(None, (ids(4, 512),), {}) is None and not history  # smaller: nothing to check
    assert check(None, (ids(8, 1024),), {}) is None  # 2x the tokens: the VRAM share shrinks, it fits
    assert history[-1]["change"] == "checked: fits"
    with pytest.raises(PlanOutOfMemoryError, match="batch 64 x seq 2048 does not fit") as e:
        check(None, (ids(64, 2048),), {})
    assert isinstance(e.value, torch.OutOfMemoryError) and isinstance(e.value, MemoryError)
    assert "wrap(..., batch=64, seq=2048)" in str(e.value) and "VRAM" in str(e.value)
    with torch.no_grad():  # evaluation keeps no activations: not checked
        assert check(None, (ids(64, 2048),), {}) is None


# ---- precision: a resident switch gives back fp32 moments -------------------------------------------
@pytest.fixture
def roomy_short_ram(monkeypatch):
    """A device with room to spare (the CPU engine takes the resident switch) and host RAM so short
    that moment_dtype="auto" takes bf16 moments."""
    import ramstream.planner.profile as profile_mod

    monkeypatch.setattr(measure_mod, "device_memory", lambda d: {"usable": 1 << 40, "peak": 0, "now": 0})
    monkeypatch.setattr(profile_mod, "available_ram", lambda *a: {"total": 1 << 30, "available": 300_000})


def test_resident_switch_turns_ram_forced_bf16_moments_into_fp32(roomy_short_ram):
    data = batches(6)
    model = make_model(0, n_blocks=2)
    model, opt = ramstream.wrap(model, torch.optim.AdamW(model.parameters(), lr=LR))
    assert opt.param_groups and opt._moment_dtype == torch.bfloat16  # chosen for host RAM
    twin = make_model(0, n_blocks=2)
    twin, topt = ramstream.wrap(twin, torch.optim.AdamW(twin.parameters(), lr=LR), moment_dtype="bfloat16",
                                offload=True)  # fmt: skip
    train_torch(model, opt, data[:2])
    train_torch(twin, topt, data[:2])
    assert opt.resident
    events = "\n".join(ramstream.memory_report(model)["events"])
    assert "float32 again" in events
    sd, tsd = opt.state_dict(), topt.state_dict()
    for k, st in sd["state"].items():  # the exact upcast of the offloaded run's bf16 moments
        assert st["exp_avg"].dtype == torch.float32
        assert torch.equal(st["exp_avg"], tsd["state"][k]["exp_avg"].float())
        assert torch.equal(st["exp_avg_sq"], tsd["state"][k]["exp_avg_sq"].float())
    losses = train_torch(model, opt, data[2:])  # the fused fp32 update from here on
    assert all(torch.isfinite(torch.tensor(losses)))
    assert all(st["exp_avg"].dtype == torch.float32 for st in opt._resident.state.values())


def test_an_asked_for_bf16_moment_stays_bf16_after_the_switch(roomy_short_ram):
    model = make_model(0, n_blocks=2)
    model, opt = ramstream.wrap(model, torch.optim.AdamW(model.parameters(), lr=LR), moment_dtype="bfloat16",
                                check_memory=False)  # fmt: skip
    train_torch(model, opt, batches(3))
    assert opt.resident
    assert all(st["exp_avg"].dtype == torch.bfloat16 for st in opt._resident.state.values())


def test_with_activation_paging_a_larger_step_is_warned_about_not_refused():
    """The plan's model of paged recomputed blocks is coarse: with activation_offload asked for, a step
    that the plan says does not fit runs (with a warning and a history entry) instead of being refused."""
    shape = ModelShape.gpt("6.85b", batch=8, seq=512, loss="chunked")
    prof = _h200(24)
    fixed = {"param_offload": True, "activation_checkpointing": True, "activation_offload": True}
    logs, history = [], PlanHistory()
    check = StepCheck(shape, prof, fixed, logs.append, history, strict=False)
    with pytest.warns(RuntimeWarning, match="batch 64 x seq 4096 does not fit"):
        assert check(None, (torch.zeros(64, 4096, dtype=torch.long),), {}) is None
    assert history[-1]["change"] == "warned: may not fit the plan"
    strict = StepCheck(shape, prof, fixed, logs.append, PlanHistory())
    with pytest.raises(PlanOutOfMemoryError):
        strict(None, (torch.zeros(64, 4096, dtype=torch.long),), {})
