"""bench/train/bench_trainer.py --tiny on the CPU: each configuration in its own subprocess, the
OffloadTrainer's losses beside the stock Trainer's (the benchmark's own comparison), the JSON."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

import ramstream

pytest.importorskip("transformers")
SCRIPT = os.path.join(os.path.dirname(__file__), os.pardir, "bench", "train", "bench_trainer.py")


def test_bench_trainer_tiny_compares_the_two_trainers(tmp_path):
    out = tmp_path / "trainer.json"
    env = dict(os.environ, OMP_NUM_THREADS="2", CUDA_VISIBLE_DEVICES="")
    pkg = os.path.dirname(os.path.dirname(ramstream.__file__))
    env["PYTHONPATH"] = os.pathsep.join(p for p in (pkg, env.get("PYTHONPATH")) if p)
    cmd = [
        sys.executable,
        SCRIPT,
        "--tiny",
        "--only",
        "stock,ramstream",
        "--deadline",
        "280",
        "--out",
        str(out),
    ]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)
    assert p.returncode == 0, p.stderr[-3000:]
    res = {r["name"]: r for r in json.loads(out.read_text())}
    assert list(res) == ["stock", "ramstream"]
    stock, ours = res["stock"], res["ramstream"]
    assert stock["status"] == ours["status"] == "OK", (stock.get("error"), ours.get("error"))
    assert len(stock["losses"]) == len(ours["losses"]) == 10 and len(ours["step_s"]) == 10
    diff = max(abs(a - b) for a, b in zip(stock["losses"], ours["losses"]))
    assert ours["max_loss_diff"] == diff < 2e-4
    assert ours["losses_within_tol"] is True
    assert ours["step_time_ratio"] == pytest.approx(ours["s_per_step"] / stock["s_per_step"])
    assert ours["host_state_gib"] > 0 and ours["resident"] is False
    assert stock["losses"][-1] != stock["losses"][0]  # the learning rate moved the weights
    assert "ramstream" in p.stdout and "loss diff" in p.stdout  # the summary table
