"""planner/revise.py revise() decides, runtime/session.py PlanSession applies (issue 24, point 2):
the revision of an applied plan for a measured step, checked against plan_training itself (a step
that fits changes nothing; one that does not recomputes the fewest more blocks from the back; one
that every block recomputing cannot fit streams the fewest more blocks from the back, never below
`first`), and the session applying it through its levers and writing the only record."""

from __future__ import annotations

import pytest

from ramstream.planner import PlanError, plan_training
from ramstream.planner.revise import Measured, RevisionError, revise
from ramstream.runtime.history import PlanHistory
from ramstream.runtime.inspect import model_shape
from ramstream.runtime.session import PlanSession

from _models import gpu_profile, make_model

APPLIED = {
    "param_offload": [],
    "activation_checkpointing": [],
    "activation_offload": False,
    "moment_dtype": "float32",
}


def _shape(d=128):
    ref = make_model(0, n_blocks=8, d=d)
    return model_shape(ref, list(ref.blocks), batch=2, seq=8, loss="dense")


def _fits(shape, prof, batch, **options) -> bool:
    try:
        plan_training(shape.with_tokens(batch=batch, seq=8), prof, quantize="none", _suggest=False, **options)
        return True
    except PlanError:
        return False


def test_a_step_that_fits_changes_nothing_and_a_larger_one_recomputes_from_the_back():
    shape, prof = _shape(), gpu_profile(32)
    rev = revise(shape, prof, APPLIED, Measured(2, 8))
    assert rev.changed == {} and rev.shape.batch == 2
    rev = revise(shape, prof, APPLIED, Measured(64, 8))
    rc = rev.changed["activation_checkpointing"]
    assert rc and rc[-1] == 7 and rc == list(range(8 - len(rc), 8))  # a run from the back
    assert _fits(shape, prof, 64, **{**APPLIED, "activation_checkpointing": rc})
    assert not _fits(shape, prof, 64, **{**APPLIED, "activation_checkpointing": rc[1:]})  # the fewest
    assert "param_offload" not in rev.changed


def test_where_every_block_recomputing_does_not_fit_the_fewest_blocks_stream_from_the_back():
    shape, prof = _shape(256), gpu_profile(48)
    applied = {**APPLIED, "activation_checkpointing": list(range(8))}
    with pytest.raises(RevisionError) as e:
        revise(shape, prof, applied, Measured(128, 8), levers=("recompute",))
    assert e.value.tried == ("recompute",) and "every block recomputing" in e.value.why
    rev = revise(shape, prof, applied, Measured(128, 8))
    st = rev.changed["param_offload"]
    assert st and st[-1] == 7 and st == list(range(8 - len(st), 8))
    assert rev.changed["activation_checkpointing"] == list(range(8))
    assert _fits(shape, prof, 128, **{**applied, "param_offload": st})
    assert not _fits(shape, prof, 128, **{**applied, "param_offload": st[1:]})
    # never the blocks before `first`: where all but block 0 streaming is not enough, nothing fits
    n_all = revise(shape, prof, applied, Measured(128, 8), first=1).changed["param_offload"]
    assert 0 not in n_all


def test_no_lever_only_checks_and_bad_levers_are_named():
    shape, prof = _shape(), gpu_profile(32)
    with pytest.raises(RevisionError) as e:
        revise(shape, prof, APPLIED, Measured(64, 8), levers=())
    assert e.value.tried == () and isinstance(e.value, MemoryError) and e.value.arithmetic
    with pytest.raises(ValueError, match="levers must be among"):
        revise(shape, prof, APPLIED, Measured(2, 8), levers=("swap",))


def test_the_session_applies_a_revision_through_its_levers_and_records_it():
    shape, prof = _shape(256), gpu_profile(48)
    state = {"recompute": list(range(8)), "streamed": []}
    calls, plans, history = [], [], PlanHistory()

    class Recompute:
        def recomputed(self):
            return list(state["recompute"])

        def recompute(self, idx, plan):
            calls.append(("recompute", list(idx)))
            state["recompute"] = list(idx)

    class Stream:
        def streamed(self):
            return list(state["streamed"])

        def usable(self):
            return True

        def stream(self, idx, plan):
            calls.append(("stream", list(idx)))
            state["streamed"] = list(idx)

    session = PlanSession(
        shape,
        prof,
        dict(APPLIED),
        print,
        history,
        recompute=Recompute(),
        streams=Stream(),
        on_plan=plans.append,
    )
    assert session.levers() == ("recompute", "stream")
    rev = session.revise(Measured(128, 8), first=0)
    assert calls == [] and history == []  # revise() decides only
    change = session.apply(rev)
    assert calls == [("stream", rev.changed["param_offload"])]  # every block recomputes already
    assert change == {
        "recompute": list(range(8)), "was": list(range(8)),
        "streamed": rev.changed["param_offload"], "streamed_was": [],
    }  # fmt: skip
    assert plans == [rev.plan] and session.shape.batch == 128
    assert session.applied()["param_offload"] == rev.changed["param_offload"]
    assert session.revise(Measured(128, 8), first=0).changed == {}  # applied: it fits now
    session.record({"change": "x"})
    assert history == [{"change": "x"}]


def test_the_eleventh_sessions_step0_refusal_r5_now_streams_blocks_from_the_back():
    """Row R5 of the defaults matrix (GPT 6.85B, bf16 weights, chunked loss, 24 GiB): wrap() planned
    for the default 8 x 512 (every block recomputing, none streamed: bench/data/defaults-2026-12-05
    .jsonl), then a 16 x 2048 step came and was refused at step 0. Its revision now streams the fewest
    blocks from the back and fits the same VRAM budget (the profile: that record's, injected)."""
    from ramstream.planner import HardwareProfile
    from ramstream.planner.shape import ModelShape

    gib = 2**30
    prof = HardwareProfile(
        device="cuda:0", gpu_name="NVIDIA H200", vram_total=150109880320, vram_free=24 * gib,
        ram_total=135129063424, ram_available=133514338304, pin_budget=67564531712, h2d_gbps=54.305566,
        d2h_gbps=54.839555, duplex_gbps=49.129558, adamw_gbps=138.735255, matmul_tflops=759.465505,
        source="given",
    )  # fmt: skip
    shape = ModelShape.gpt("6.85b", batch=8, seq=512, dtype="bfloat16", loss="chunked")
    wrapped = plan_training(shape, prof)
    rc = [i for i, m in enumerate(wrapped.activations) if m == "recompute"]
    assert wrapped.weights["streamed"] == [] and rc == list(range(32))  # as the record says
    applied = {
        "param_offload": [],
        "activation_checkpointing": rc,
        "moment_dtype": wrapped.optimizer["moment_dtype"],
    }
    with pytest.raises(RevisionError):  # what the eleventh session's check could do: refuse
        revise(shape, prof, applied, Measured(16, 2048), levers=("recompute",))
    rev = revise(shape, prof, applied, Measured(16, 2048))
    st = rev.changed["param_offload"]
    assert st and st[-1] == 31 and st == list(range(32 - len(st), 32))
    vram = rev.plan.memory["vram"]
    assert vram["total"] <= vram["budget"]
    assert rev.shape.batch == 16 and rev.shape.seq == 2048
