"""The end-to-end benchmark scripts run (on the CPU, tiny model) and their variants train alike.

The scripts are what produce bench/RESULTS.md on the GPU machine; this keeps them from rotting
between GPU runs, and checks that the variants they compare compute the same training run.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

TRAIN = os.path.join(os.path.dirname(__file__), os.pardir, "bench", "train")


def _run(script: str, args: list[str], out) -> list[dict]:
    cmd = [
        sys.executable,
        os.path.join(TRAIN, script),
        "--device",
        "cpu",
        "--model",
        "tiny",
        "--seq",
        "64",
        "--steps",
        "2",
        "--warmup",
        "1",
        "--out",
        str(out),
        *args,
    ]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    with open(out) as f:
        return json.load(f)


def test_bench_offload_variants_train_the_same_model(tmp_path):
    names = ["stock_capped", "ramstream_cpu", "ramstream_auto_act2", "ramstream_auto_chunked"]
    res = {
        r["name"]: r
        for r in _run(
            "bench_offload.py", ["--batch", "2", "--variants", ",".join(names)], tmp_path / "offload.json"
        )
    }
    assert list(res) == names
    for r in res.values():
        assert r["ok"], r.get("error")
        assert r["s_per_step"] > 0 and r["peak_vram_gib"] is None
    ref = res["stock_capped"]["loss"]
    # same seed, data and AdamW: after 3 steps the losses agree (fp32 on the CPU)
    for name in names[1:]:
        assert res[name]["loss"] == pytest.approx(ref, rel=1e-4), name
        assert res[name]["stats"]["steps"] == 3
    assert res["ramstream_auto_chunked"]["loss_fn"] == "chunked"
    # the time split covers the timed steps only: every step moves each gradient to the host once
    split = res["ramstream_cpu"]["time_split"]
    grad_gb = res["ramstream_cpu"]["params"] * 4 / 1e9
    assert split["d2h_gb"] == pytest.approx(grad_gb, rel=0.01)
    assert split["host_adamw_s"] > 0


def test_bench_offload_rejects_an_unknown_variant(tmp_path):
    cmd = [sys.executable, os.path.join(TRAIN, "bench_offload.py"), "--variants", "nope"]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert p.returncode != 0 and "unknown variant 'nope'" in p.stderr


def test_bench_activations_reports_every_mode(tmp_path):
    rows = _run("bench_activations.py", ["--batches", "1,2", "--cap-gib", "0"], tmp_path / "act.json")
    modes = {(r["variant"], r["mode"], r["batch"]) for r in rows}
    for batch in (1, 2):
        assert {
            ("stock", "stock", batch),
            ("ramstream", "unpaged", batch),
            ("ramstream", "all_paged", batch),
            ("ramstream", "planner", batch),
        } <= modes
    for r in rows:
        assert r["ok"], r.get("error")
        assert r["tokens_per_s"] == pytest.approx(r["batch"] * 64 / r["s_per_step"])
    paged = [r for r in rows if r["mode"] == "all_paged"]
    assert all(r["paged_blocks"] == 2 for r in paged)  # both blocks of the tiny GPT
    # every configuration ran in a fresh process: nothing carried over from the one before
    assert len({r["pid"] for r in rows}) == len(rows) == 8
    # same seed and data in every process: the same training run whatever the paging
    for batch in (1, 2):
        losses = {r["loss"] for r in rows if r["batch"] == batch and r["variant"] == "ramstream"}
        assert len(losses) == 1, losses


def test_bench_activations_an_oom_configuration_does_not_stop_the_next(tmp_path):
    rows = _run(
        "bench_activations.py",
        [
            "--batches",
            "1,2",
            "--cap-gib",
            "0",
            "--variants",
            "ramstream",
            "--inject-oom",
            "unpaged@1,all_paged@2",
        ],
        tmp_path / "act.json",
    )
    got = [(r["mode"], r["batch"], r["ok"], r.get("error")) for r in rows]
    # unpaged@1 runs out of memory, all_paged@1 still runs (no planner without the unpaged
    # figures); at batch 2 all_paged fails too, which ends the walk up the batch list
    assert got == [
        ("unpaged", 1, False, "oom"),
        ("all_paged", 1, True, None),
        ("unpaged", 2, True, None),
        ("all_paged", 2, False, "oom"),
    ]
    assert len({r["pid"] for r in rows}) == 4
