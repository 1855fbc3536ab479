"""bench/train/bench_offload_model.py --tiny runs on the CPU in seconds: the ramstream row has
its step times, memory and the simulator's prediction from a traced step, the ramstream_hostopt
row (the host optimizer) the same losses and its step against the ramstream row's; RamTorch, when it
does not import, is reported as such (never needed by the tests); --deadline bounds the run."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

SCRIPT = os.path.join(os.path.dirname(__file__), os.pardir, "bench", "train", "bench_offload_model.py")


def _run(args, timeout=300):
    env = {k: v for k, v in os.environ.items()}
    return subprocess.run(
        [sys.executable, SCRIPT, *args], capture_output=True, text=True, timeout=timeout, env=env
    )


def test_tiny_run_reports_the_ramstream_row_and_the_prediction(tmp_path):
    out = tmp_path / "om.json"
    p = _run(["--tiny", "--impls", "ramstream,ramstream_hostopt,ramtorch", "--out", str(out)])
    assert p.returncode == 0, p.stderr[-3000:]
    doc = json.loads(out.read_text())
    rows = {r["impl"]: r for r in doc["rows"]}
    s = rows["ramstream"]
    assert s["fwd_bwd_s"] > 0 and s["step_s"] >= s["fwd_bwd_s"] and s["peak_rss_gib"] > 0
    assert len(s["losses"]) == 2 and all(math.isfinite(v) for v in s["losses"])
    assert s["predicted_s"] > 0 and 0 < s["predicted_utilisation"] <= 1
    assert len(s["chunk_times"]["tf"]) == 4  # embedding, 2 blocks, head: one chunk each
    # window 2 (RamTorch's meaning): the running chunk and one ahead, in the simulator and measured
    assert s["predicted_peak_chunks"] == 2
    assert s["pinned"] == [] and 0 < s["peak_loaded_gib"] <= s["window_bound_gib"]
    t = rows["ramtorch"]
    if "error" in t:
        assert "does not import" in t["error"]
    else:  # the same chunks and data: the same losses
        assert t["losses"] == s["losses"] and s["speedup_vs_ramtorch"]["fwd_bwd_s"] > 0
    assert "simulator:" in p.stdout and p.stdout.startswith("config tiny 2x64 window=2 pin=0")
    # the host optimizer's row: the same losses (fp32 moments: torch's fused AdamW bit for bit), its
    # step against the torch-AdamW row of the same run, and where its host time went
    h = rows["ramstream_hostopt"]
    assert h["losses"] == s["losses"] and h["moment_dtype"] == "float32"
    assert h["step_speedup_vs_ramstream"] == s["step_s"] / h["step_s"]
    assert h["host_update_s_per_step"] > 0 and h["load_wait_s_per_step"] >= 0
    assert "predicted_s" not in h and "host optimizer (float32 moments)" in p.stdout


def test_tiny_bf16_moments_row(tmp_path):
    out = tmp_path / "om.json"
    p = _run(["--tiny", "--impls", "ramstream_hostopt_bf16", "--host-threads", "1", "--out", str(out)])
    assert p.returncode == 0, p.stderr[-3000:]
    (h,) = json.loads(out.read_text())["rows"]
    assert (
        h["impl"] == "ramstream_hostopt_bf16" and h["moment_dtype"] == "bfloat16" and h["host_threads"] == 1
    )
    assert len(h["losses"]) == 2 and all(math.isfinite(v) for v in h["losses"])
    assert "step_speedup_vs_ramstream" not in h  # no torch-AdamW row in this run


def test_deadline_and_bad_impl():
    p = _run(["--tiny", "--impls", "ramstream", "--deadline", "0.5"])
    assert p.returncode == 1 and "deadline" in p.stdout
    p = _run(["--tiny", "--impls", "deepspeed"])
    assert (
        p.returncode != 0
        and "accepted: ramstream, ramstream_hostopt, ramstream_hostopt_bf16, ramtorch" in p.stderr
    )
