"""Data parallel with streamed weights (wrap(param_offload=...)), gloo and the CPU engine: each
streamed bucket's owner broadcasts its updated home to the other ranks' homes; two ranks train
bit for bit as the same two ranks with every weight resident, which equal one process on the
full batch. The scenarios run in one spawn of two ranks (_dist_stream_helpers.py)."""

from __future__ import annotations

import pytest
import torch

from _dist_edge_helpers import LR, WD, run_ranks
from _dist_stream_helpers import KINDS, STEPS
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


def get(res: list[dict], name: str) -> list[dict]:
    out = [r[name] for r in res]
    for rank, r in enumerate(out):
        assert "error" not in r, f"rank {rank}, {name}:\n{r.get('error')}"
    return out


def identical(a: dict, b: dict, keys=("params", "masters", "losses")) -> None:
    """Two runs ended with the same weights, masters, optimizer state (and losses), bit for bit."""
    for key in keys:
        assert len(a[key]) == len(b[key])
        for x, y in zip(a[key], b[key]):
            assert x.dtype == y.dtype and torch.equal(x, y), key
    assert a["state"].keys() == b["state"].keys()
    for k in a["state"]:
        for n in ("step", "exp_avg", "exp_avg_sq"):
            assert torch.equal(a["state"][k][n], b["state"][k][n]), (k, n)


def check_streamed_equals_resident(ranks: list[dict], streamed=("all",)) -> None:
    for r in ranks:
        for k in streamed:
            run = r[k]
            assert run["streamed"] > 0 and run["loads"] > 0 and run["at_home"]
            # every rank owns some streamed buckets (it broadcasts them) and receives others
            assert 0 < run["owned_streamed"] < run["streamed"]
            identical(run, r["off"])
        assert r["off"]["streamed"] == 0
    for k in ("off", *streamed):  # the replicas (their losses are of their own shards)
        identical(ranks[0][k], ranks[1][k], keys=("params", "masters"))


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


def test_auto_on_the_cpu_engine_streams_nothing(runs):
    ranks = runs("auto")
    assert all(r["auto"]["streamed"] == 0 for r in ranks)
    identical(ranks[0]["auto"], ranks[1]["auto"], keys=("params", "masters"))
