"""bench/train/bench_pipeline.py --device cpu --tiny runs every row (P2, P4 per schedule, P2GPU)
on the CPU in seconds: finite step times, the ratios computed from the measured steps, the
simulator's prediction from the traced per-op times; RamTorch, when it does not import, is
reported as such (never needed by the tests)."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

SCRIPT = os.path.join(os.path.dirname(__file__), os.pardir, "bench", "train", "bench_pipeline.py")


def _ok(m) -> bool:
    return (
        "error" not in m
        and math.isfinite(m["step_s"])
        and m["step_s"] > 0
        and m["tokens_per_s"] == 8 * 64 / m["step_s"]
        and len(m["losses"]) == 2
        and all(math.isfinite(v) for v in m["losses"])
    )


def _ramtorch(m, ref) -> None:
    if "error" in m:
        assert "does not import" in m["error"]
    else:  # the same chunks, data and microbatches: the same losses
        assert _ok(m) and m["losses"] == ref["losses"]


def test_tiny_cpu_runs_every_row(tmp_path):
    out = tmp_path / "pipe.json"
    p = subprocess.run(
        [sys.executable, SCRIPT, "--device", "cpu", "--tiny", "--eager", "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert p.returncode == 0, p.stderr[-3000:] + p.stdout[-3000:]
    rows = json.loads(out.read_text())["rows"]
    assert [(r["row"], r.get("schedule")) for r in rows] == [
        ("P2", None),
        ("P4", "gpipe"),
        ("P4", "1f1b"),
        ("P4", "interleaved"),
        ("P2GPU", None),
    ]
    p2, p2gpu = rows[0], rows[4]
    s, o = p2["ramstream"], p2["offload"]
    assert _ok(s) and _ok(o) and s["devices"] == "cpu,cpu" and o["devices"] == "cpu"
    assert p2["vs_offload"] == s["step_s"] / o["step_s"]
    assert max(abs(a - b) for a, b in zip(s["losses"], o["losses"])) < 1e-3  # the same model and data
    assert s["schedule"] == "gpipe" and p2["ramstream_1f1b"]["schedule"] == "1f1b"
    assert _ok(p2["ramstream_1f1b"]) and p2["ramstream_1f1b"]["losses"] == s["losses"]  # chunk-major: exact
    _ramtorch(p2["ramtorch"], s)
    # the eager floors: the unsplit model over the same microbatches and over the whole batch (the
    # same losses up to rounding: the mean of the microbatches' losses, the whole batch's)
    em, ew = p2["eager_mb"], p2["eager_whole"]
    assert _ok(em) and _ok(ew) and em["microbatches"] == 4 and ew["microbatches"] == 1
    assert all(abs(a - b) < 1e-3 for a, b in zip(em["losses"], s["losses"]))
    assert "forward+backward s: ramstream" in p.stdout
    _ramtorch(p2["ramtorch_gpipe"], s)
    rt = [m["step_s"] for m in (p2["ramtorch"], p2["ramtorch_gpipe"]) if "error" not in m]
    if rt:
        assert p2["speedup_vs_ramtorch"] == min(rt) / s["step_s"]
    else:
        assert p2["speedup_vs_ramtorch"] is None
    for r in rows[1:4]:
        m = r["ramstream"]
        assert _ok(m) and m["schedule"] == r["schedule"]
        assert len(m["tf"]) == len(m["tb"]) == (4 if r["schedule"] == "interleaved" else 2)
        assert all(math.isfinite(t) and t > 0 for t in m["tf"] + m["tb"])
        assert math.isfinite(r["predicted_s"]) and r["predicted_s"] > 0
        assert r["prediction_error"] == r["predicted_s"] / m["pipeline_s"] - 1  # without the optimizer
        # both stages on the CPU: the shared-device model, fed each op's time alone (at most its span)
        assert all(0 < a <= t for a, t in zip(m["tf_alone"] + m["tb_alone"], m["tf"] + m["tb"]))
        assert r["own_devices_error"] == m["predicted_own_devices_s"] / m["pipeline_s"] - 1
        assert 0 < m["pipeline_s"] < m["step_s"] and 0 < m["optimizer_s"] < m["step_s"]
        assert r["keep_activations"] == ("checkpoint" if r["schedule"] == "gpipe" else "true")
        assert m["losses"] == s["losses"]  # every schedule: the same gradients, the same steps
    g = p2gpu["ramstream"]
    assert _ok(g) and p2gpu["one_gpu"] == s
    assert p2gpu["throughput_vs_one_gpu"] == s["step_s"] / g["step_s"]
    _ramtorch(p2gpu["ramtorch"], s)
    assert p.stdout.startswith("config tiny 8x64 microbatches=4 window=2 pin=0 device=cpu")
    assert "simulator" in p.stdout and "throughput vs 1 GPU" in p.stdout
