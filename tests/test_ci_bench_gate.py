""".ci/bench_gate.py fails below 0.9x torch's fused CPU AdamW and passes above, from JSON files
shaped as pytest-benchmark writes them."""

from __future__ import annotations

import json
import os
import subprocess
import sys

GATE = os.path.join(os.path.dirname(__file__), "..", ".ci", "bench_gate.py")


def _gate(tmp_path, ours: float, theirs: float) -> subprocess.CompletedProcess:
    rows = [
        ("test_ramstream_fp32", ours),
        ("test_torch_fused_fp32", theirs),
        ("test_torch_foreach_fp32", 1.0),
    ]
    path = tmp_path / "bench_adamw.json"
    path.write_text(
        json.dumps({"benchmarks": [{"name": n, "stats": {"min": t, "median": 2 * t}} for n, t in rows]})
    )
    return subprocess.run([sys.executable, GATE, str(path)], capture_output=True, text=True)


def test_gate_passes_at_or_above_0_9x_and_fails_below(tmp_path):
    assert _gate(tmp_path, ours=0.010, theirs=0.0091).returncode == 0  # 0.91x
    slow = _gate(tmp_path, ours=0.010, theirs=0.0089)
    assert slow.returncode == 1 and "FAIL" in slow.stdout and "0.89x" in slow.stdout


def test_gate_fails_when_a_row_is_missing(tmp_path):
    path = tmp_path / "bench_adamw.json"
    path.write_text(json.dumps({"benchmarks": [{"name": "test_torch_fused_fp32", "stats": {"min": 1.0}}]}))
    p = subprocess.run([sys.executable, GATE, str(path)], capture_output=True, text=True)
    assert p.returncode == 1 and "lacks" in p.stdout
