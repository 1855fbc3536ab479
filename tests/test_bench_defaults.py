"""bench/train/bench_defaults.py (issue 24's matrix) on the CPU with its tiny models: the runs, their JSON, the table."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import pytest

TRAIN = os.path.join(os.path.dirname(__file__), os.pardir, "bench", "train")
SCRIPT = os.path.join(TRAIN, "bench_defaults.py")


@pytest.fixture
def bench(monkeypatch):
    monkeypatch.syspath_prepend(os.path.abspath(TRAIN))
    import bench_defaults

    yield bench_defaults
    sys.modules.pop("bench_defaults", None)


def _run(args: list[str]) -> subprocess.CompletedProcess:
    cmd = [sys.executable, SCRIPT, "--tiny", "--device", "cpu", *args]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=240)
    assert p.returncode == 0, p.stderr[-3000:]
    return p


def test_tiny_matrix_trains_like_plain_torch(tmp_path):
    out = tmp_path / "d.jsonl"
    p = _run(["--rows", "R6,R1", "--caps", "8", "--steps", "3", "--out", str(out)])
    runs = [json.loads(x) for x in out.read_text().splitlines()]
    # FIRST's order (R1@8 before R6), R6 uncapped with stock, R1 with the hand options, no stock
    assert [(r["row"], r["cap_gib"], r["variant"]) for r in runs] == [
        ("R1", 8.0, "defaults"),
        ("R1", 8.0, "hand"),
        ("R6", 0.0, "defaults"),
        ("R6", 0.0, "stock"),
    ]
    printed = [json.loads(x) for x in p.stdout.splitlines() if x.startswith("{")]
    assert [r["pid"] for r in printed] == [r["pid"] for r in runs] and len({r["pid"] for r in runs}) == 4
    for r in runs:
        assert r["status"] == "ok", r.get("error")
        assert r["steps"] == 3 and len(r["step_times"]) == 3 and len(r["losses"]) == 3
        assert all(math.isfinite(v) for v in r["losses"])
        assert r["s_per_step"] > 0 and r["setup_s"] >= 0 and r["build_s"] > 0
        assert r["to_settled_s"] is None or r["to_settled_s"] > 0
        assert r["peak_gib"] is None and r["moment_dtype"] == "float32"
        assert r["model_tflops"] > 0 and r["params"] == r["trained_params"] > 0
    d, hand = runs[0], runs[1]
    assert d["options"] == {} and hand["options"]["param_offload"] is True
    assert hand["plan"]["weights"]["streamed"] == [0, 1] and hand["plan"]["recompute"] == [0, 1]
    for r in (d, hand, runs[2]):
        assert len(json.dumps(r["plan"])) < 4500 and r["optimizer"]["mode"] == "auto"
        assert any("wrapped:" in e for e in r["events"])
    # same weights, data and AdamW: ramstream's defaults and hand options train as torch does
    assert d["losses"] == pytest.approx(hand["losses"], rel=1e-4)
    assert runs[2]["losses"] == pytest.approx(runs[3]["losses"], rel=1e-4)
    table = [x for x in p.stdout.splitlines() if x.startswith("|")]
    assert len(table) == 2 + 4 and "| R6 | none | defaults | ok |" in table[4]
    assert table[2].endswith("(hand) |") and table[4].endswith("(stock) |")
    again = subprocess.run([sys.executable, SCRIPT, "--summarize", str(out)], capture_output=True, text=True)
    assert again.stdout.splitlines() == table


def test_deadline_stops_launching_and_still_prints_the_table():
    p = _run(["--rows", "R1", "--caps", "8", "--deadline", "1"])
    assert "stopped after" in p.stdout and "| row | cap GiB |" in p.stdout
    assert not [x for x in p.stdout.splitlines() if x.startswith("{")]


def test_order_variants_and_plan_compaction(bench):
    cells = bench.order(["R6", "R2", "R1", "R3", "R5", "R4"], [24, 8, 12, 16])
    assert cells[:7] == bench.FIRST
    assert len(cells) == 5 * 4 + 1 and cells.count(("R6", 0)) == 1
    assert bench.variants_of("R6", 0, ["defaults", "hand", "stock"]) == ["defaults", "stock"]
    assert bench.variants_of("R1", 8, ["defaults", "hand", "stock"]) == ["defaults", "hand"]
    plan = {"weights": {"streamed": list(range(48))}, "history": [{"predicted_s_after": 0.5}] * 9,
            "optimizer": {"split": {"predicted_host_s": 0.25}}, "big": [{"k": "x" * 200}] * 40, "odd": object()}  # fmt: skip
    c = bench.compact_plan(plan)
    json.dumps(c)
    assert len(json.dumps(c)) < 4500 and c["weights"]["streamed"] == list(range(48))
    assert c["predicted_all"]["optimizer.split.predicted_host_s"] == 0.25 and len(c["history"]) == 4
    assert isinstance(c["big"], str) and len(c["big"]) <= 203 and c["odd"].startswith("<object")
