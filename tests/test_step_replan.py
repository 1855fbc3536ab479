"""A step larger than the plan is re-planned, not only refused (issue 24, point 3): with
activation_checkpointing="auto" the step check makes more blocks recompute before anything ran,
records the change in the plan history and raises PlanOutOfMemoryError(replanned=True); the
weights and the optimizer state are untouched, and re-running the same step trains exactly as torch
does. A step that cannot fit even with every block recomputing is refused with replanned=False and
the arithmetic. On the CPU engine, with the plan made on an injected GPU profile and the check
installed as wrap() installs it on a GPU (runtime/apply.py check_steps)."""

from __future__ import annotations

import pickle

import pytest
import torch

import ramstream
from ramstream.planner.profile import HardwareProfile
from ramstream.planner.replan import replan_recompute
from ramstream.runtime.apply import check_steps
from ramstream.runtime.inspect import model_shape, plan_for
from ramstream.runtime.tokens import PlanOutOfMemoryError, StepCheck

from _models import batches, clone, make_model, train_torch

GIB = 2**30
LR = 3e-3


def _profile(free_mib: int) -> HardwareProfile:
    """A GPU with `free_mib` MiB free (the H200's rates): the 8-block d=128 model's plan for
    2 x 8 tokens keeps every activation at 32 MiB; 64 x 8 needs blocks 0-4 recomputed, 512 x 8
    does not fit even with every block recomputing."""
    return HardwareProfile(
        device="cuda", vram_total=4 * GIB, vram_free=free_mib << 20, ram_total=64 * GIB,
        ram_available=64 * GIB, pin_budget=32 * GIB, h2d_gbps=54.9, d2h_gbps=55.0, duplex_gbps=49.5,
        adamw_gbps=127.7, matmul_tflops=790.0, source="given",
    )  # fmt: skip


def _wrapped(ref, prof, **options):
    """A clone of `ref` wrapped on the CPU engine with the plan for 2 x 8 tokens on `prof`, and the
    step check wrap() installs on a GPU."""
    plan_opts = {k: options[k] for k in ("param_offload",) if k in options}
    plan = plan_for(ref, profile=prof, batch=2, seq=8, **plan_opts)
    shape = model_shape(ref, list(ref.blocks), batch=2, seq=8, loss="dense")
    model = clone(ref)
    wrap_opts = {k: v for k, v in options.items() if k != "param_offload"}
    model, opt = ramstream.wrap(
        model, torch.optim.AdamW(model.parameters(), lr=LR), device="cpu", plan=plan, **wrap_opts
    )
    w = model._ramstream
    check_steps(model, w, plan, shape, prof, w.options, w.log)
    return model, opt, plan


def _weights(model) -> dict:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _state(opt) -> dict:
    sd = opt.state_dict()
    return {
        k: {n: t.clone() if torch.is_tensor(t) else t for n, t in st.items()} for k, st in sd["state"].items()
    }


def _assert_same(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for k in a:
        if isinstance(a[k], dict):
            _assert_same(a[k], b[k])
        elif torch.is_tensor(a[k]):
            assert torch.equal(a[k], b[k]), k
        else:
            assert a[k] == b[k], k


@pytest.mark.parametrize("param_offload", ["auto", [0, 1]], ids=["resident", "streamed"])
def test_a_larger_step_recomputes_more_blocks_and_its_rerun_trains_as_torch(param_offload):
    ref = make_model(0, n_blocks=8, d=128)
    prof = _profile(32)
    model, opt, plan = _wrapped(ref, prof, param_offload=param_offload)
    assert "recompute" not in plan.activations, "the plan for 2 x 8 tokens keeps every activation"
    small, big = batches(2, b=2, t=8), batches(1, b=64, t=8, seed=2)
    want = train_torch(ref, torch.optim.AdamW(ref.parameters(), lr=LR, fused=True), small + big)
    got = train_torch(model, opt, small)
    weights, state = _weights(model), _state(opt)
    x, y = big[0]
    with pytest.raises(PlanOutOfMemoryError) as e:
        model(x, y)
    err = e.value
    assert isinstance(err, torch.OutOfMemoryError) and isinstance(err, MemoryError)
    assert err.replanned is True
    assert err.change == {"recompute": [0, 1, 2, 3, 4], "was": []}
    assert "now recomputing blocks 0-4 (was none)" in str(err) and "re-run the same step" in str(err)
    assert pickle.loads(pickle.dumps(err)).replanned is True
    _assert_same(_weights(model), weights)  # nothing ran: weights and optimizer state as before
    _assert_same(_state(opt), state)
    rep = ramstream.memory_report(model)["plan"]
    last = rep["history"][-1]
    assert last["change"] == "re-planned: now recomputing blocks 0-4 (was none)"
    assert last["recompute"] == [0, 1, 2, 3, 4] and last["was"] == [] and last["step_tokens"] == 64 * 8
    assert rep["recompute"] == [0, 1, 2, 3, 4] == rep["planner"]["recompute"]
    assert ["forward" in b.__dict__ for b in model.blocks] == [True] * 5 + [False] * 3  # checkpointed
    assert rep["planner"]["batch"] == 64 and rep["planner"]["streamed"] == plan.weights["streamed"]
    assert any("revised before it ran" in line for line in ramstream.memory_report(model)["events"])
    got += train_torch(model, opt, big)  # the same step, as is
    assert got == want
    for a, b in zip(ref.parameters(), model.parameters()):
        assert torch.equal(a.detach(), b.detach())  # recompute is bit-exact on the CPU
    if param_offload != "auto":  # the streamed blocks stay streamed: only the recompute changed
        assert plan.weights["streamed"] == [0, 1]
        assert ramstream.memory_report(model)["plan"]["weights"]["streamed"] == [0, 1]
    ramstream.unwrap(model)
    assert all("forward" not in b.__dict__ for b in model.blocks)  # the added recomputes are undone too


def test_a_step_that_cannot_fit_even_recomputing_every_block_is_refused_with_the_arithmetic():
    ref = make_model(0, n_blocks=8, d=128)
    model, opt, _ = _wrapped(ref, _profile(32))
    x, y = batches(1, b=512, t=8, seed=3)[0]
    weights = _weights(model)
    for _ in range(2):  # the second time from the refused cache, the same answer
        with pytest.raises(PlanOutOfMemoryError, match="batch 512 x seq 8 does not fit") as e:
            model(x, y)
        assert e.value.replanned is False and e.value.change is None
        msg = str(e.value)
        assert "not even with every block recomputing" in msg and "VRAM" in msg
        assert "no plan fits this step on this machine with these options, not even re-wrapped with " in msg
        assert "wrap(..., batch=512, seq=8); re-wrapped, one of these would: batch=128" in msg
        assert "would fit:" not in msg  # the applied plan's arithmetic: no suggestions were tried there
    _assert_same(_weights(model), weights)
    rep = ramstream.memory_report(model)["plan"]
    assert rep["history"][-1]["change"] == "refused: does not fit the plan"
    assert "recompute" not in rep or rep["recompute"] == []  # nothing changed
    # a smaller step still re-plans, after which the refused one is checked again, not cached
    xs, ys = batches(1, b=64, t=8, seed=4)[0]
    with pytest.raises(PlanOutOfMemoryError) as e:
        model(xs, ys)
    assert e.value.replanned
    with pytest.raises(PlanOutOfMemoryError) as e:
        model(x, y)
    assert not e.value.replanned and "not even with every block recomputing" in str(e.value)
    train_torch(model, opt, [(xs, ys)])  # the re-run fits


def test_with_activation_checkpointing_given_the_recomputed_blocks_stay_and_the_step_is_refused():
    ref = make_model(0, n_blocks=8, d=128)
    model, _, _ = _wrapped(ref, _profile(32), activation_checkpointing=False)
    x, y = batches(1, b=64, t=8, seed=2)[0]
    with pytest.raises(PlanOutOfMemoryError) as e:
        model(x, y)
    assert e.value.replanned is False
    assert "activation_checkpointing=False was given" in str(e.value)
    assert "not even re-wrapped with wrap(..., batch=64, seq=8)" in str(e.value)  # without recompute
    assert model._ramstream.recompute is None


def test_the_step_check_re_plans_through_its_lever_and_clears_its_refusals():
    """StepCheck alone, with a stand-in lever: the re-plan asks the planner for the fewest blocks
    more, hands them to the lever, and a later step is checked against the revised plan."""
    ref = make_model(0, n_blocks=8, d=128)
    prof = _profile(32)
    shape = model_shape(ref, list(ref.blocks), batch=2, seq=8, loss="dense")
    applied = {"recompute": [], "plan": None}

    class Lever:
        def recomputed(self):
            return list(applied["recompute"])

        def recompute(self, idx, plan):
            applied.update(recompute=list(idx), plan=plan)

    fixed = {
        "param_offload": [],
        "activation_checkpointing": [],
        "activation_offload": False,
        "moment_dtype": "float32",
    }
    history, logs = [], []
    check = StepCheck(shape, prof, fixed, logs.append, history, lever=Lever())
    ids = lambda b: torch.zeros(b, 8, dtype=torch.long)  # noqa: E731
    with pytest.raises(PlanOutOfMemoryError):
        check(None, (ids(512),), {})
    assert check.refused and applied["recompute"] == []
    with pytest.raises(PlanOutOfMemoryError) as e:
        check(None, (ids(96),), {})
    assert e.value.replanned and applied["recompute"] == e.value.change["recompute"]
    want = replan_recompute(
        shape.with_tokens(batch=96, seq=8), prof, [], param_offload=[], moment_dtype="float32"
    )
    assert applied["recompute"] == [i for i, m in enumerate(want.activations) if m == "recompute"]
    assert applied["plan"].to_dict() == want.to_dict()
    assert not check.refused  # a step refused before the change is checked again
    assert check(None, (ids(96),), {}) is None and check(None, (ids(64),), {}) is None
    first = list(applied["recompute"])
    with pytest.raises(PlanOutOfMemoryError) as e:  # larger still: more blocks again
        check(None, (ids(128),), {})
    assert e.value.change["was"] == first and set(first) < set(applied["recompute"])
    assert [h["change"].split(":")[0] for h in history] == ["refused", "re-planned", "re-planned"]


def test_a_step_that_needs_more_streamed_blocks_is_refused_with_the_plan_a_re_wrap_would_apply():
    """Which blocks stream is decided at wrap() only (the engine's buckets are laid out then): every
    block recomputing already, a step that fits only with blocks streamed is refused, and the error
    says what a plan made for it streams."""
    ref = make_model(0, n_blocks=8, d=256)
    model, _, plan = _wrapped(ref, _profile(48))
    assert plan.activations == ["recompute"] * 8 and not plan.weights["streamed"]
    x, y = batches(1, b=128, t=8, seed=5)[0]
    with pytest.raises(PlanOutOfMemoryError) as e:
        model(x, y)
    assert e.value.replanned is False
    msg = str(e.value)
    assert "not even with every block recomputing" in msg
    assert (
        "re-wrap with wrap(..., batch=128, seq=8): that plan fits (streaming blocks 0-4, recomputing blocks 0-7)"
        in msg
    )
