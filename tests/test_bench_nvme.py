"""bench/train/bench_nvme.py's CPU smoke (--device cpu --tiny): the run with the optimizer state on
disk trains to the same losses as the one in RAM (the disk tier is bit-exact), moves the state's
bytes through the disk once each way per timed step (the state's first write at wrap() not
counted), and the summary's arithmetic follows from them."""

from __future__ import annotations

import json
import os
import runpy
import sys

import pytest

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
    twice (forward, and backward unless it stayed loaded)."""
    r, scratch = _run(tmp_path, monkeypatch, "--what", "weights")
    ram, disk, s = r["ram"], r["disk"], r["summary"]
    assert s["losses_equal"] and len(disk["losses"]) == 4
    assert ram["disk_state_bytes"] == 0 and ram["disk_read_per_step"] == 0
    on_disk = disk["disk_state_bytes"]
    assert on_disk > 0 and disk["disk_written_per_step"] == 0
    assert on_disk <= disk["disk_read_per_step"] <= 2 * on_disk
    assert os.listdir(scratch) == []
