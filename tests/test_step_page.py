"""A step that every block recomputing and every block it may stream still cannot fit, and that
paging the recomputed blocks' checkpointed inputs can, turns activation paging on when wrap() left it
off (the default activation_offload=False; planner/revise.py's third lever "page", runtime/apply.py
PageLever): the step goes on (or, when the first block was running already, is refused with
replanned=True and its re-run trains), bit for bit as torch, and the change is in the log, the plan
history and memory_report. Issue 24's R5 at 8-16 GiB was refused at step 0 for want of this. On the
CPU engine, with the plan made on an injected GPU profile (test_step_replan.py's setting)."""

from __future__ import annotations

import pytest
import torch

import ramstream
from ramstream.planner import ModelShape
from ramstream.planner.revise import Measured, RevisionError, revise
from ramstream.runtime.tokens import PlanOutOfMemoryError
from test_step_replan import LR, _check, _fc1_calls, _profile, _wrapped

from _models import batches, make_model, train_torch

BIG = 256  # x 8 tokens: on the 32 MiB GPU, fits only with every block recomputing and its input paged


def test_the_planner_pages_only_where_recompute_and_streaming_cannot_fit():
    ref = make_model(0, n_blocks=8, d=128)
    model, opt, _ = _wrapped(ref, _profile(32))
    check = _check(model)
    applied = check._now()
    assert applied["activation_offload"] is False
    with pytest.raises(RevisionError) as e:
        revise(check.shape, check.profile, applied, Measured(BIG, 8), levers=("recompute", "stream"))
    assert "page" not in e.value.tried
    rev = revise(check.shape, check.profile, applied, Measured(BIG, 8))
    assert rev.changed["activation_offload"] is True
    assert rev.changed["activation_checkpointing"] == list(range(8))
    vram = rev.plan.memory["vram"]
    assert vram["total"] <= vram["budget"] and rev.plan.memory["ram"]["paged_activations"] > 0
    # paging asked for already (True or "auto"): not a lever; the refusal says what was tried
    for ao in (True, "auto"):
        with pytest.raises(RevisionError) as e:
            revise(check.shape, check.profile, {**applied, "activation_offload": ao}, Measured(512, 8))
        assert "page" not in e.value.tried
    with pytest.raises(RevisionError) as e:
        revise(check.shape, check.profile, applied, Measured(512, 8))
    assert e.value.tried == ("recompute", "stream", "page") and "paged to host RAM" in e.value.why
    ramstream.unwrap(model)


def test_called_as_a_module_the_step_turns_paging_on_and_goes_on_as_torch():
    ref = make_model(0, n_blocks=8, d=128)
    model, opt, _ = _wrapped(ref, _profile(32))
    assert model._ramstream.activations is None  # wrap()'s default: no paging
    small, big = batches(2, b=2, t=8), batches(2, b=BIG, t=8, seed=6)
    want = train_torch(ref, torch.optim.AdamW(ref.parameters(), lr=LR, fused=True), small + big + small)
    got = train_torch(model, opt, small)
    calls = _fc1_calls(model)
    got += train_torch(model, opt, big)
    assert calls == [4] * 8  # two steps, every block recomputing, the first too
    got += train_torch(model, opt, small)
    assert got == want
    for p, q in zip(ref.parameters(), model.parameters()):
        assert torch.equal(p.detach(), q.detach())  # recompute and paging are bit-exact
    rep = ramstream.memory_report(model)
    hist = rep["plan"]["history"]
    entry = next(h for h in hist if h.get("activation_offload"))
    assert entry["change"].startswith("re-planned: now recomputing blocks 0-7 (was none)")
    assert "paging the recomputed blocks' inputs to host RAM" in entry["change"]
    assert entry["step_tokens"] == BIG * 8
    assert rep["activations"]["paged_blocks"] == list(range(8))
    assert rep["activations"]["packed_bytes"] > 0  # the inputs went to host memory and back
    assert rep["plan"]["activation_offload"] is True
    assert any(e.endswith("the step goes on") and "activation_offload=True" in e for e in rep["events"])
    assert _check(model)._now()["activation_offload"] is True  # later steps are planned with it
    plain = ramstream.unwrap(model)
    assert all(not b._forward_pre_hooks and not b._forward_hooks for b in plain.blocks)


def test_from_the_first_block_the_step_is_refused_replanned_and_its_rerun_pages():
    """model.forward(...) directly: only the first block's check sees the step, inside that block's
    call, where hooks cannot be attached to it; the step raises replanned=True before anything ran,
    and the same step re-run trains as torch, paging."""
    ref = make_model(0, n_blocks=8, d=128)
    model, opt, _ = _wrapped(ref, _profile(32))
    small, big = batches(2, b=2, t=8), batches(1, b=BIG, t=8, seed=6)
    want = train_torch(ref, torch.optim.AdamW(ref.parameters(), lr=LR, fused=True), small + big)
    got = train_torch(model, opt, small)
    weights = {k: v.detach().clone() for k, v in model.state_dict().items()}
    x, y = big[0]
    with pytest.raises(PlanOutOfMemoryError) as e:
        model.forward(x, y)
    assert e.value.replanned is True and e.value.change.get("activation_offload") is True
    assert "Activation paging is attached to every block, the first too" in str(e.value)
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in weights.items())  # nothing ran
    del e
    got += train_torch(model, opt, big)  # the same step, as is
    assert got == want
    for p, q in zip(ref.parameters(), model.parameters()):
        assert torch.equal(p.detach(), q.detach())
    assert ramstream.memory_report(model)["activations"]["paged_blocks"] == list(range(8))
    ramstream.unwrap(model)


def test_issue_24s_r5_at_16_gib_is_revised_to_page_not_refused():
    """The 6.85B GPT as wrap()'s defaults apply it at 16 GiB for 8 x 512 (blocks 0-7 streamed, every
    block recomputing), then a 16 x 2048 step of the chunked loss: the GPU run refused it; the
    revision now pages the recomputed blocks' inputs (and streams what else it must)."""
    import dataclasses

    from _models import gpu_profile

    gib = 2**30  # the GPU machine's 125 GiB of RAM (gpu_profile's 64 GiB cannot hold the 6.85B's state)
    prof = dataclasses.replace(gpu_profile(16 * 1024), ram_total=125 * gib, ram_available=120 * gib)
    shape = ModelShape.gpt("6.85b", batch=8, seq=512, dtype="bfloat16", loss="chunked")
    applied = {"param_offload": list(range(8)), "activation_checkpointing": list(range(32)),
               "activation_offload": False, "moment_dtype": "float32"}  # fmt: skip
    with pytest.raises(RevisionError):
        revise(shape, prof, applied, Measured(16, 2048), levers=("recompute", "stream"))
    rev = revise(shape, prof, applied, Measured(16, 2048))
    assert rev.changed["activation_offload"] is True
    assert set(range(8)) <= set(rev.changed["param_offload"])
    assert rev.plan.memory["vram"]["total"] <= rev.plan.memory["vram"]["budget"]


@pytest.mark.cuda
def test_on_the_gpu_a_step_turns_paging_on_and_trains_as_torch():
    """The same on cuda:0 (the plan made on the injected 32 MiB profile, the check as wrap()
    installs it): paging attached between steps on the GPU engine, the run within float rounding of
    torch's fused AdamW (the CUDA update kernels differ from torch's in last bits)."""
    from ramstream.runtime.apply import check_steps
    from ramstream.runtime.inspect import model_shape, plan_for

    from _models import clone

    dev = torch.device("cuda:0")
    ref = make_model(0, n_blocks=8, d=128)
    prof = _profile(32)
    plan = plan_for(ref, profile=prof, batch=2, seq=8)
    shape = model_shape(ref, list(ref.blocks), batch=2, seq=8, loss="dense")
    model = clone(ref).to(dev)
    model, opt = ramstream.wrap(model, torch.optim.AdamW(model.parameters(), lr=LR), device=dev, plan=plan)
    w = model._ramstream
    check_steps(model, w, plan, shape, prof, w.options, w.log)
    ref = ref.to(dev)
    data = batches(2, b=2, t=8, device=dev) + batches(2, b=BIG, t=8, seed=6, device=dev)
    torch.use_deterministic_algorithms(True, warn_only=True)  # embedding backward: atomics
    try:
        want = train_torch(ref, torch.optim.AdamW(ref.parameters(), lr=LR, fused=True), data)
        got = train_torch(model, opt, data)
    finally:
        torch.use_deterministic_algorithms(False)
    assert max(abs(a - b) for a, b in zip(got, want)) < 1e-4
    assert (
        max(
            float((p.detach() - q.detach()).abs().max()) for p, q in zip(ref.parameters(), model.parameters())
        )
        < 1e-4
    )
    rep = ramstream.memory_report(model)
    assert rep["activations"]["paged_blocks"] == list(range(8)) and rep["activations"]["packed_bytes"] > 0
    assert rep["plan"]["activation_offload"] is True
    ramstream.unwrap(model)
