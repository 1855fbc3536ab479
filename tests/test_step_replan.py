"""A step larger than the plan is re-planned, not only refused (issue 24, point 3): with
activation_checkpointing="auto" the step check, the first block's forward pre-hook, makes the fewest
more blocks recompute before any block ran, taken from the back of the stack, and records the change
in the plan history; the blocks after the first recompute from that very step, so the step goes on
and trains exactly as torch does. Only when the first block must recompute too (every block must)
does the step raise PlanOutOfMemoryError(replanned=True): weights and optimizer state untouched,
and re-running the same step trains as torch does. A step that cannot fit even with every block
recomputing is refused with replanned=False and the arithmetic. On the CPU engine, with the plan
made on an injected GPU profile and the check installed as wrap() installs it on a GPU
(runtime/apply.py check_steps)."""

from __future__ import annotations

import pickle

import pytest
import torch

import ramstream
from ramstream.blocks import ranges_text
from ramstream.planner import PlanError, plan_training
from ramstream.planner.replan import replan_recompute, replan_stream
from ramstream.runtime.apply import check_steps
from ramstream.runtime.history import PlanHistory
from ramstream.runtime.inspect import model_shape, plan_for
from ramstream.runtime.tokens import PlanOutOfMemoryError, StepCheck

from _models import batches, clone, gpu_profile, make_model, train_torch

GIB = 2**30
LR = 3e-3


def _profile(free_mib: int):
    """A GPU with `free_mib` MiB free (the H200's rates): the 8-block d=128 model's plan for
    2 x 8 tokens keeps every activation at 32 MiB; 64 x 8 needs 5 blocks recomputed, a batch
    between 128 and 512 every block (found by _every_block_batch), 512 x 8 does not fit even with
    every block recomputing."""
    return gpu_profile(free_mib)


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


def _check(model) -> StepCheck:
    return next(h for h in model.blocks[0]._forward_pre_hooks.values() if isinstance(h, StepCheck))


def _revision(check: StepCheck, b: int, t: int = 8) -> list[int]:
    """The blocks the step check's re-plan for a b x t step recomputes (the planner's answer, from
    the back of the stack, for the check's own shape, profile and fixed options)."""
    fixed = check._now()
    rest = {k: v for k, v in fixed.items() if k != "activation_checkpointing"}
    shape = check.shape.with_tokens(batch=b, seq=t)
    plan = replan_recompute(
        shape, check.profile, fixed["activation_checkpointing"] or [], order="back", **rest
    )
    return [i for i, m in enumerate(plan.activations) if m == "recompute"]


def _every_block_batch(check: StepCheck, t: int = 8) -> int:
    """The smallest batch that the applied plan refuses and that fits only with every block
    recomputing (the first block too), found with the planner on the check's shape and profile."""
    fixed = check._now()
    n = len(check.shape.blocks)
    for b in range(65, 512):
        try:
            plan_training(check.shape.with_tokens(batch=b, seq=t), check.profile, quantize="none",
                          _suggest=False, **fixed)  # fmt: skip
            continue
        except PlanError:
            pass
        try:
            if _revision(check, b, t) == list(range(n)):
                return b
        except PlanError:
            break
    raise AssertionError("no batch between 65 and 511 that fits only with every block recomputing")


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


def _fc1_calls(model) -> list[int]:
    """Per block, calls of its first linear layer (twice in a step when the block recomputes)."""
    calls = [0] * len(model.blocks)

    def hook(i):
        def count(*_):
            calls[i] += 1

        return count

    for i, b in enumerate(model.blocks):
        b.fc1.register_forward_hook(hook(i))
    return calls


@pytest.mark.parametrize("param_offload", ["auto", [0, 1]], ids=["resident", "streamed"])
def test_a_larger_step_recomputes_more_blocks_from_the_back_and_goes_on_as_torch(param_offload):
    ref = make_model(0, n_blocks=8, d=128)
    prof = _profile(32)
    model, opt, plan = _wrapped(ref, prof, param_offload=param_offload)
    assert "recompute" not in plan.activations, "the plan for 2 x 8 tokens keeps every activation"
    small, big = batches(2, b=2, t=8), batches(1, b=64, t=8, seed=2)
    want = train_torch(ref, torch.optim.AdamW(ref.parameters(), lr=LR, fused=True), small + big)
    got = train_torch(model, opt, small)
    rc = _revision(_check(model), 64)
    assert rc == [3, 4, 5, 6, 7] and 0 not in rc  # the planner's 5 blocks of 8, from the back
    calls = _fc1_calls(model)
    got += train_torch(model, opt, big)  # no re-run: the step goes on under the revised plan
    assert calls == [1 if i not in rc else 2 for i in range(8)]  # recomputed in that very step
    assert got == want
    for a, b in zip(ref.parameters(), model.parameters()):
        assert torch.equal(a.detach(), b.detach())  # recompute is bit-exact on the CPU
    rep = ramstream.memory_report(model)["plan"]
    last = rep["history"][-1]
    what = f"now recomputing blocks {ranges_text(rc)} (was none)"
    assert what == "now recomputing blocks 3-7 (was none)"
    assert last["change"] == "re-planned: " + what
    assert last["recompute"] == rc and last["was"] == [] and last["step_tokens"] == 64 * 8
    assert rep["recompute"] == rc == rep["planner"]["recompute"]
    assert ["forward" in b.__dict__ for b in model.blocks] == [i in rc for i in range(8)]  # checkpointed
    assert rep["planner"]["batch"] == 64 and rep["planner"]["streamed"] == plan.weights["streamed"]
    events = ramstream.memory_report(model)["events"]
    assert any("revised before it ran: " + what in e and e.endswith("the step goes on") for e in events)
    if param_offload != "auto":  # the streamed blocks stay streamed: only the recompute changed
        assert plan.weights["streamed"] == [0, 1]
        assert ramstream.memory_report(model)["plan"]["weights"]["streamed"] == [0, 1]
    calls[:] = [0] * 8
    train_torch(model, opt, big)  # the same size again: checked already, nothing more changes
    assert calls == [1 if i not in rc else 2 for i in range(8)]
    assert ramstream.memory_report(model)["plan"]["history"][-1] == last
    ramstream.unwrap(model)
    assert all("forward" not in b.__dict__ for b in model.blocks)  # the added recomputes are undone too


def test_a_step_that_needs_every_block_recomputed_is_refused_replanned_and_its_rerun_trains_as_torch():
    """The first block must recompute too: when the model's forward is run directly (as peft's
    LoraModel runs its base model's), only the first block's check sees the step, and that block's
    forward was read before the check ran, so the step raises replanned=True before anything ran and
    the re-run (docs/planning.md's loop) recomputes every block."""
    ref = make_model(0, n_blocks=8, d=128)
    model, opt, _ = _wrapped(ref, _profile(32))
    b = _every_block_batch(_check(model))
    small, big = batches(2, b=2, t=8), batches(1, b=b, t=8, seed=6)
    want = train_torch(ref, torch.optim.AdamW(ref.parameters(), lr=LR, fused=True), small + big)
    got = train_torch(model, opt, small)
    weights, state = _weights(model), _state(opt)
    x, y = big[0]
    with pytest.raises(PlanOutOfMemoryError) as e:
        model.forward(x, y)  # not model(...): the model's own pre-hook does not run
    err = e.value
    assert isinstance(err, torch.OutOfMemoryError) and isinstance(err, MemoryError)
    assert err.replanned is True
    assert err.change == {"recompute": list(range(8)), "was": []}
    msg = str(err)
    assert "now recomputing blocks 0-7 (was none)" in msg and "re-run the same step" in msg
    assert "Every block must recompute, the first too" in msg
    assert pickle.loads(pickle.dumps(err)).replanned is True
    _assert_same(_weights(model), weights)  # nothing ran: weights and optimizer state as before
    _assert_same(_state(opt), state)
    rep = ramstream.memory_report(model)["plan"]
    assert rep["history"][-1]["change"] == "re-planned: now recomputing blocks 0-7 (was none)"
    assert rep["history"][-1]["step_tokens"] == b * 8
    assert rep["recompute"] == list(range(8)) == rep["planner"]["recompute"]
    events = ramstream.memory_report(model)["events"]
    assert not any(e.endswith("the step goes on") for e in events)
    calls = _fc1_calls(model)
    del e, err
    got += train_torch(model, opt, big)  # the same step, as is
    assert calls == [2] * 8  # every block recomputes, the first too
    assert got == want
    for p, q in zip(ref.parameters(), model.parameters()):
        assert torch.equal(p.detach(), q.detach())


def test_called_as_a_module_a_step_that_needs_every_block_recomputed_goes_on_as_torch():
    """model(...) runs the model's pre-hook first: the check re-plans before any block ran, so even
    the first block recomputes from this very step and nothing is refused."""
    ref = make_model(0, n_blocks=8, d=128)
    model, opt, _ = _wrapped(ref, _profile(32))
    b = _every_block_batch(_check(model))
    small, big = batches(2, b=2, t=8), batches(2, b=b, t=8, seed=6)
    want = train_torch(ref, torch.optim.AdamW(ref.parameters(), lr=LR, fused=True), small + big)
    got = train_torch(model, opt, small)
    calls = _fc1_calls(model)
    got += train_torch(model, opt, big)
    assert calls == [4] * 8  # two steps, every block recomputing, the first too
    assert got == want
    for p, q in zip(ref.parameters(), model.parameters()):
        assert torch.equal(p.detach(), q.detach())
    rep = ramstream.memory_report(model)["plan"]
    assert rep["history"][-1]["change"] == "re-planned: now recomputing blocks 0-7 (was none)"
    assert any(e.endswith("the step goes on") for e in ramstream.memory_report(model)["events"])


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
    # a smaller step still re-plans and goes on, after which the refused one is checked again
    xs, ys = batches(1, b=64, t=8, seed=4)[0]
    train_torch(model, opt, [(xs, ys)])
    assert ramstream.memory_report(model)["plan"]["history"][-1]["change"].startswith("re-planned")
    with pytest.raises(PlanOutOfMemoryError) as e:
        model(x, y)
    assert not e.value.replanned and "not even with every block recomputing" in str(e.value)
    train_torch(model, opt, [(xs, ys)])  # the smaller step still fits


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
    more from the back, hands them to the lever and lets the step go on; a later step is checked
    against the revised plan; one that needs the first block too raises replanned=True."""
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
    history, logs = PlanHistory(), []
    check = StepCheck(shape, prof, fixed, logs.append, history, lever=Lever())
    ids = lambda b: torch.zeros(b, 8, dtype=torch.long)  # noqa: E731
    with pytest.raises(PlanOutOfMemoryError):
        check(None, (ids(512),), {})
    assert check.refused and applied["recompute"] == []
    assert check(None, (ids(96),), {}) is None  # revised: the step goes on
    want = replan_recompute(
        shape.with_tokens(batch=96, seq=8), prof, [], order="back", param_offload=[], moment_dtype="float32"
    )
    first = [i for i, m in enumerate(want.activations) if m == "recompute"]
    assert applied["recompute"] == first and first[-1] == 7 and 0 not in first
    assert applied["plan"].to_dict() == want.to_dict()
    assert not check.refused  # a step refused before the change is checked again
    assert check(None, (ids(96),), {}) is None and check(None, (ids(64),), {}) is None
    assert check(None, (ids(128),), {}) is None  # larger still: more blocks again, from the back
    second = list(applied["recompute"])
    assert history[-1]["was"] == first and set(first) < set(second) and 0 not in second
    b = _every_block_batch(check)  # from here only the first block is left: every block must
    with pytest.raises(PlanOutOfMemoryError) as e:
        check(None, (ids(b),), {})
    assert e.value.replanned and e.value.change == {"recompute": list(range(8)), "was": second}
    assert applied["recompute"] == list(range(8))
    assert [h["change"].split(":")[0] for h in history] == ["refused"] + ["re-planned"] * 3
    assert sum("the step goes on" in line for line in logs) == 2


def test_replan_recompute_adds_blocks_from_the_front_by_default_and_from_the_back_when_asked():
    """The same fewest count from either end (the planner counts every block's activations the same
    at the peak, whatever its place); the first block only when every block must recompute."""
    ref = make_model(0, n_blocks=8, d=128)
    prof = _profile(32)
    shape = model_shape(ref, list(ref.blocks), batch=2, seq=8, loss="dense")
    kw = dict(param_offload=[], moment_dtype="float32")

    def rc(b, was=(), **order):
        plan = replan_recompute(shape.with_tokens(batch=b, seq=8), prof, list(was), **order, **kw)
        return [i for i, m in enumerate(plan.activations) if m == "recompute"]

    assert rc(64) == rc(64, order="front") == [0, 1, 2, 3, 4]
    assert rc(64, order="back") == [3, 4, 5, 6, 7]
    assert rc(64, was=[7], order="back") == [3, 4, 5, 6, 7]  # the ones recomputing already stay
    assert rc(64, was=[0], order="back") == [0, 4, 5, 6, 7]
    assert 0 not in rc(128, order="back") and rc(128, order="back")[-1] == 7
    with pytest.raises(ValueError, match="order must be"):
        rc(64, order="middle")


def test_a_step_that_needs_more_streamed_blocks_streams_them_from_the_back_and_trains_as_torch():
    """Every block recomputing already, a step that fits only with more blocks streaming their
    weights: before any block ran (the model's pre-hook), the fewest blocks from the back of the stack
    start streaming (their buckets become streamed, values unchanged: engine/restream.py), the step
    goes on, and the run equals torch's fused AdamW bit for bit, the steps after it too."""
    ref = make_model(0, n_blocks=8, d=256)
    model, opt, plan = _wrapped(ref, _profile(48))
    assert plan.activations == ["recompute"] * 8 and not plan.weights["streamed"]
    small, big = batches(2, b=2, t=8), batches(3, b=128, t=8, seed=5)
    want = train_torch(ref, torch.optim.AdamW(ref.parameters(), lr=LR, fused=True), small + big)
    got = train_torch(model, opt, small)
    got += train_torch(model, opt, big)
    assert got == want
    for p, q in zip(ref.parameters(), model.parameters()):
        assert torch.equal(p.detach(), q.detach())
    check = _check(model)
    shape = check.shape
    fixed = {k: v for k, v in check.fixed.items() if k not in ("activation_checkpointing", "param_offload")}
    expect = replan_stream(
        shape, check.profile, [], first=0, activation_checkpointing=list(range(8)), **fixed
    )
    streamed = list(expect.weights["streamed"])
    assert streamed and streamed[-1] == 7 and 0 < len(streamed) < 8  # the fewest, from the back
    rep = ramstream.memory_report(model)["plan"]
    assert rep["weights"]["streamed"] == streamed == rep["planner"]["streamed"]
    assert rep["history"][-1]["streamed"] == streamed and rep["history"][-1]["streamed_was"] == []
    assert f"streaming blocks {ranges_text(streamed)} (was none)" in rep["history"][-1]["change"]
    engine = opt._engine
    for b in engine.buckets:  # the streamed blocks' buckets stream, the others stay
        blk = engine.block_of.get(id(b.slots[0].param))
        assert b.streamed == (blk in set(streamed)), b.index
    w = model._ramstream.streamer
    assert sorted(blk.index for blk in w.blocks) == streamed and w.stats["loads"] > 0


def test_a_step_that_needs_more_streamed_blocks_is_refused_with_the_plan_a_re_wrap_would_apply():
    """With the recomputed blocks fixed by the user (activation_checkpointing=True), nothing may
    change between steps: a step that fits only with blocks streamed is refused, and the error says
    what a plan made for it streams."""
    ref = make_model(0, n_blocks=8, d=256)
    model, _, plan = _wrapped(ref, _profile(48), activation_checkpointing=True)
    assert plan.activations == ["recompute"] * 8 and not plan.weights["streamed"]
    x, y = batches(1, b=128, t=8, seed=5)[0]
    with pytest.raises(PlanOutOfMemoryError) as e:
        model(x, y)
    assert e.value.replanned is False
    msg = str(e.value)
    assert "activation_checkpointing=True was given" in msg
    assert (
        "re-wrap with wrap(..., batch=128, seq=8): that plan fits (streaming blocks 0-4, recomputing blocks 0-7)"
        in msg
    )
