"""bench/train/bench_nvme.py's CPU smoke (--device cpu --tiny): the run with the optimizer state,
a frozen base's streamed weights or OffloadModel's chunks on disk trains to the same losses as the
one in RAM (the disk tier is bit-exact, and so is the RAM run's control on the CPU), the bytes per
step count the timed steps only (not the state's first write at wrap()), and the summary's
arithmetic follows from them."""

from __future__ import annotations

import json
import os
import runpy
import sys

import pytest
import torch

SCRIPT = os.path.join(os.path.dirname(__file__), os.pardir, "bench", "train", "bench_nvme.py")


def _run(tmp_path, monkeypatch, *extra) -> tuple[dict, object]:
    """The script's CPU smoke (4 steps) into a fresh scratch folder: (its JSON, the folder)."""
    out = tmp_path / "nvme.json"
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    argv = [
        SCRIPT,
        "--device",
        "cpu",
        "--tiny",
        "--steps",
        "4",
        *extra,
        "--dir",
        str(scratch),
        "--out",
        str(out),
    ]
    monkeypatch.setattr(sys, "argv", argv)
    assert runpy.run_path(SCRIPT)["main"]() == 0
    return json.loads(out.read_text()), scratch


def test_bench_nvme_cpu_smoke(tmp_path, monkeypatch):
    r, scratch = _run(tmp_path, monkeypatch)
    ram, disk, s = r["ram"], r["disk"], r["summary"]
    assert s["losses_equal"] and len(disk["losses"]) == 4
    assert r["ram_control"]["losses"] == ram["losses"] and s["ram_vs_ram_max_dloss"] == 0
    assert s["disk_vs_ram_max_dloss"] == 0 and s["verdict"] == "losses bit-equal (disk vs RAM)"
    assert ram["disk_state_bytes"] == 0 and ram["disk_read_per_step"] == 0
    state = disk["disk_state_bytes"]
    assert state > 0 and disk["timed_steps"] == 4 - r["config"]["skip"]
    # every timed step reads and writes the whole state once; the state's write at wrap() and
    # the warm-up's I/O are not counted
    assert disk["disk_written_per_step"] == disk["disk_read_per_step"] == state
    m = r["disk_measured"]
    disk_s = disk["disk_read_per_step"] / (m["read_gbps"] * 1e9) + disk["disk_written_per_step"] / (
        m["write_gbps"] * 1e9
    )
    assert s["disk_time_at_measured_rates_s"] == pytest.approx(disk_s)
    assert s["bound_s"] == pytest.approx(max(ram["step_s"], disk_s))
    assert s["ratio_to_bound"] == pytest.approx(disk["step_s"] / s["bound_s"])
    assert os.listdir(scratch) == []  # every scratch file removed


def test_bench_nvme_weights_cpu_smoke(tmp_path, monkeypatch):
    """--what weights: a frozen base's streamed weights on disk (nvme_weights) train to the same
    losses as in RAM, nothing is written per step, and each step reads every disk block once or
    twice (forward, and backward unless it stayed loaded). --no-control: one RAM run, no spread;
    --deterministic is recorded in every variant and torch's setting restored after (the CPU runs
    share this process)."""
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)  # restored after the test
    r, scratch = _run(tmp_path, monkeypatch, "--what", "weights", "--no-control", "--deterministic")
    ram, disk, s = r["ram"], r["disk"], r["summary"]
    assert s["losses_equal"] and len(disk["losses"]) == 4
    assert "ram_control" not in r and s["ram_vs_ram_max_dloss"] is None
    assert ram["disk_state_bytes"] == 0 and ram["disk_read_per_step"] == 0
    on_disk = disk["disk_state_bytes"]
    assert on_disk > 0 and disk["disk_written_per_step"] == 0
    assert on_disk <= disk["disk_read_per_step"] <= 2 * on_disk
    assert r["deterministic"]["CUBLAS_WORKSPACE_CONFIG"] == ":4096:8"
    assert ram["deterministic_algorithms"] and disk["deterministic_algorithms"]
    assert not torch.are_deterministic_algorithms_enabled()
    assert torch.backends.cuda.flash_sdp_enabled() and torch.backends.cuda.mem_efficient_sdp_enabled()
    assert os.listdir(scratch) == []


def test_bench_nvme_offload_cpu_smoke(tmp_path, monkeypatch):
    """--what offload: OffloadModel's frozen chunks all on disk train the embedding and head to the
    same losses as with the chunks in RAM; each step reads every disk chunk once or twice, writes
    nothing, and the read rate's ratio follows from the bytes."""
    r, scratch = _run(tmp_path, monkeypatch, "--what", "offload")
    ram, disk, s = r["ram"], r["disk"], r["summary"]
    assert s["losses_equal"] and len(disk["losses"]) == 4 and s["verdict"].startswith("losses bit-equal")
    assert r["ram_control"]["losses"] == ram["losses"]
    assert ram["disk_state_bytes"] == 0 and ram["disk_read_per_step"] == 0 and ram["nvme_loads"] == 0
    on_disk = disk["disk_state_bytes"]
    assert on_disk > 0 and disk["chunks"] == disk["share"] == 2 and disk["disk_written_per_step"] == 0
    assert on_disk <= disk["disk_read_per_step"] <= 2 * on_disk
    gbps = disk["disk_read_per_step"] / disk["step_s"] / 1e9
    assert s["read_rate_ratio"] == pytest.approx(gbps / r["disk_measured"]["read_gbps"])
    assert s["read_rate_target_met"] == (s["read_rate_ratio"] >= 0.8)
    assert r["deterministic"] is False and not disk["deterministic_algorithms"]
    assert os.listdir(scratch) == []


def test_bench_nvme_verdict():
    """The verdict line: bit-equal, within the RAM run's run-to-run spread, of its order, or beyond."""
    ns = runpy.run_path(SCRIPT)
    verdict, max_dloss = ns["verdict"], ns["max_dloss"]
    assert max_dloss([1.0, 2.0], [1.0, 2.5]) == 0.5 and max_dloss([1.0], [float("nan")]) == float("inf")
    assert verdict(0.0, None) == "losses bit-equal (disk vs RAM)"
    assert "within the run-to-run spread 2e-05" in verdict(1e-5, 2e-5)
    assert "the order of the run-to-run spread 1e-05" in verdict(2e-5, 1e-5)
    assert "beyond the run-to-run spread 1e-05" in verdict(5e-5, 1e-5)
    assert "beyond" in verdict(1e-7, 0.0) and "not measured" in verdict(1e-5, None)
