"""bench/train/bench_dp.py on the CPU: two gloo ranks (FileStore rendezvous) vs one process."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

BENCH = Path(__file__).resolve().parents[1] / "bench" / "train" / "bench_dp.py"


def _bench_module():
    spec = importlib.util.spec_from_file_location("bench_dp", BENCH)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def driver_result(tmp_path_factory):
    """The driver: single process, full-batch reference, two ranks that meet through a FileStore
    in the test's folder (--rendezvous file: torchrun --standalone would take a free TCP port
    that another process may grab first); tiny GPT, buckets small enough that both ranks own
    some."""
    tmp = tmp_path_factory.mktemp("bench_dp")
    cmd = [
        sys.executable,
        str(BENCH),
        "--nproc",
        "2",
        "--device",
        "cpu",
        "--model",
        "tiny",
        "--batch",
        "2",
        "--seq",
        "32",
        "--steps",
        "3",
        "--warmup",
        "1",
        "--options",
        json.dumps({"bucket_bytes": 1 << 18}),
        "--check",
        "--rendezvous",
        "file",
        "--workdir",
        str(tmp / "runs"),
        "--timeout",
        "120",
        "--out",
        str(tmp / "dp.json"),
    ]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=tmp)
    assert p.returncode == 0, p.stderr[-3000:]
    res = json.loads((tmp / "dp.json").read_text())
    for r in res["runs"]:
        assert r.get("ok"), f"{r['name']}: {r.get('error')}"
    return {r["name"]: r for r in res["runs"]}, res["summary"], p.stdout


def test_two_ranks_match_one_process_on_the_global_batch(driver_result):
    runs, summary, _ = driver_result
    ref, dp = runs["reference"], runs["dp"]
    assert dp["world"] == 2 and dp["backend"] == "gloo" and dp["data_parallel"]
    assert ref["world"] == 1 and not ref["data_parallel"]
    assert dp["global_batch"] == ref["global_batch"] == 4 and dp["trained_steps"] == 4
    assert dp["parity_max_abs_diff"] < 1e-5 and dp["parity_ok"]
    assert summary["parity_max_abs_diff"] == dp["parity_max_abs_diff"]
    assert abs(dp["loss"] - ref["loss"]) < 1e-4  # the mean of the ranks' losses
    assert dp["replicas_identical"] and summary["replicas_identical"]
    assert len(set(dp["param_sha256_by_rank"])) == 1


def test_each_rank_holds_its_share_of_the_host_state(driver_result):
    runs, summary, _ = driver_result
    single = runs["single"]["host_state_bytes_by_rank"][0]
    per_rank = runs["dp"]["host_state_bytes_by_rank"]
    assert len(per_rank) == 2 and sum(per_rank) == single
    assert max(per_rank) < 0.6 * single  # balanced owners: about half each
    assert summary["host_state_sum_equals_single"]
    assert summary["host_state_max_rank_fraction"] == pytest.approx(max(per_rank) / single)


def test_throughput_figures_are_consistent(driver_result):
    runs, summary, stdout = driver_result
    for name in ("single", "dp"):
        r = runs[name]
        assert r["s_per_step"] > 0
        assert r["tokens_per_s"] == pytest.approx(r["global_batch"] * r["seq"] / r["s_per_step"])
    assert summary["scaling"] == pytest.approx(runs["dp"]["tokens_per_s"] / runs["single"]["tokens_per_s"])
    assert "summary {" in stdout


def test_reference_comparison_sees_a_difference_and_refuses_another_run(tmp_path):
    bench = _bench_module()
    sys.path.insert(0, str(BENCH.parent))
    from gpt import CONFIGS, GPT

    torch.manual_seed(0)
    model = GPT(**CONFIGS["tiny"], ctx=64)
    meta = {
        "model": "tiny",
        "global_batch": 4,
        "seq": 32,
        "trained_steps": 4,
        "seed": 0,
        "lr": 1e-3,
        "amp": "off",
        "device_type": "cpu",
    }
    path = str(tmp_path / "ref.pt")
    bench._save_reference(model, path, meta)
    assert bench._compare_with_reference(model, path, meta)["parity_max_abs_diff"] == 0.0
    with torch.no_grad():
        model.layers[1].fc.weight[3, 5] += 0.25
    got = bench._compare_with_reference(model, path, meta)
    assert got["parity_max_abs_diff"] == pytest.approx(0.25, rel=1e-6)
    assert got["parity_worst_param"] == "layers.1.fc.weight"
    with pytest.raises(SystemExit, match="global_batch: reference 4 != this run 8"):
        bench._compare_with_reference(model, path, {**meta, "global_batch": 8})
