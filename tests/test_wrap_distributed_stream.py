"""Data parallel with streamed weights (wrap(param_offload=...)), gloo and the CPU engine: each
streamed bucket's owner broadcasts its updated home to the other ranks' homes; two ranks train
bit for bit as the same two ranks with every weight resident, which equal one process on the
full batch. The scenarios run in one spawn of two ranks (_dist_stream_helpers.py)."""

from __future__ import annotations

import pytest
import torch

from _dist_edge_helpers import LR, WD, run_ranks
from _dist_stream_helpers import KINDS, OFFLOADS, STEPS, check_streamed_equals_resident, get, identical
from _models import batches, make_model, train_torch


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    res = run_ranks(
        tmp_path_factory.mktemp("dpstream"),
        2,
        [f"{k}@cpu" for k in KINDS],
        timeout_s=300,
        module="_dist_stream_helpers",
    )
    return lambda kind: get(res, f"{kind}@cpu")


def test_fp32_streamed_equals_resident_and_one_process(runs):
    ranks = runs("fp32")
    check_streamed_equals_resident(ranks, ("all", "one"))
    assert ranks[0]["one"]["streamed"] < ranks[0]["all"]["streamed"]
    ref = make_model(0, n_blocks=3)
    train_torch(
        ref, torch.optim.AdamW(ref.parameters(), lr=LR, weight_decay=WD, foreach=False), batches(STEPS, b=8)
    )
    for a, r in zip(ranks[0]["all"]["params"], ref.parameters()):
        assert (a - r.detach()).abs().max() < 1e-5
    assert all(float(st["step"]) == STEPS for st in ranks[0]["all"]["state"].values())
    # each rank keeps the state of the buckets it owns; an fp32 streamed master is its home
    state = {k: [r[k]["host_state_bytes"] for r in ranks] for k in OFFLOADS}
    assert sum(state["all"]) == sum(state["off"]) == sum(state["one"]) and min(state["all"]) > 0


def test_bf16_weights_with_fp32_masters(runs):
    ranks = runs("bf16")
    check_streamed_equals_resident(ranks)
    run = ranks[0]["all"]
    assert all(p.dtype == torch.bfloat16 for p in run["params"])
    assert all(m.dtype == torch.float32 for m in run["masters"])
    assert all(torch.equal(p, m.to(torch.bfloat16)) for p, m in zip(run["params"], run["masters"]))
    assert any(not torch.equal(m, m.to(torch.bfloat16).float()) for m in run["masters"])


def test_clipping_and_accumulation(runs):
    check_streamed_equals_resident(runs("clip_accum"))


def test_window_of_one_block(runs):
    check_streamed_equals_resident(runs("window1"))


def test_loads_wait_for_late_broadcasts(runs):
    check_streamed_equals_resident(runs("slow"))


def test_state_dicts_resume_exactly(runs):
    ranks = runs("resume")
    for r in ranks:
        for k in ("resumed", "full"):
            assert all(torch.equal(a, b) for a, b in zip(r["all"][k], r["off"][k]))
        assert all(torch.equal(a, b) for a, b in zip(r["all"]["resumed"], r["all"]["full"]))
        assert r["all"]["osd"]["state"].keys() == r["off"]["osd"]["state"].keys()
        for i, st in r["all"]["osd"]["state"].items():
            for n in ("exp_avg", "exp_avg_sq"):
                assert torch.equal(st[n], r["off"]["osd"]["state"][i][n])
    assert all(torch.equal(a, b) for a, b in zip(ranks[0]["all"]["full"], ranks[1]["all"]["full"]))


def test_auto_on_the_cpu_engine_streams_nothing(runs):
    ranks = runs("auto")
    assert all(r["auto"]["streamed"] == 0 for r in ranks)
    identical(ranks[0]["auto"], ranks[1]["auto"], keys=("params", "masters"))
