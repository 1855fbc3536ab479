"""bench/train/bench_quant.py --tiny on the CPU: every row runs in its own process, the streamed
70B-shaped run carries its packed codes in pinned slabs, and load_model packs the same NF4 bytes
as from_pretrained + quantize_model of the same checkpoint."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

SCRIPT = os.path.join(os.path.dirname(__file__), os.pardir, "bench", "train", "bench_quant.py")


def test_bench_quant_tiny_runs_every_row(tmp_path):
    pytest.importorskip("transformers")
    pytest.importorskip("peft")
    out = tmp_path / "q.json"
    cmd = [sys.executable, SCRIPT, "--tiny", "--device", "cpu", "--steps", "1", "--warmup", "1"]
    cmd += ["--rows", "Q14,G70,LOAD", "--deadline", "280", "--out", str(out), "--ckpt", str(tmp_path / "ck")]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    res = {r["name"]: r for r in json.loads(out.read_text())}
    assert sorted(res) == ["G70_L2", "G70_L3", "LOAD_hf", "LOAD_ramstream", "LOAD_write", "Q14_nf4"]
    bad = {n: r.get("error") for n, r in res.items() if r["status"] != "OK"}
    assert not bad, bad
    q = res["Q14_nf4"]
    assert q["quantize"]["format"] == "nf4" and q["streamed_blocks"] == 0 and q["s_per_step"] > 0
    for n in ("G70_L2", "G70_L3"):  # every block streamed, its NF4 codes at home in the slabs
        r = res[n]
        assert r["streamed_blocks"] == r["layers"] and r["plan_weights"]["packed_bytes"] > 0
        assert r["weights_h2d_per_step"] >= r["plan_weights"]["streamed_bytes"]  # each block visits
        assert r["loss_last"] == r["loss_last"]  # not NaN
    w, a, b = res["LOAD_write"], res["LOAD_ramstream"], res["LOAD_hf"]
    assert w["shards"] > 1  # a sharded checkpoint with its index
    assert a["quantized_modules"] == b["quantized_modules"] == 2 * 7
    assert a["digest"] == b["digest"]
    assert "G70 at 80 layers, extrapolated linearly from [2, 3] layers" in p.stdout
    assert not (tmp_path / "ck").exists()  # the checkpoint is removed after the run
