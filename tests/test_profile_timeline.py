"""bench/train/profile_timeline.py: busy percent per window and lane, overlapping events counted once."""

from __future__ import annotations

import gzip
import json
import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "bench", "train"))
import profile_timeline as pt  # noqa: E402


def _ev(cat, name, tid, ts, dur):
    return {"ph": "X", "cat": cat, "name": name, "tid": tid, "ts": ts, "dur": dur}


def test_windows_and_lanes(tmp_path, capsys):
    events = [
        _ev("kernel", "gemm", 7, 0, 50),  # kernels on stream 7: [0, 50) and [25, 75) overlap
        _ev("kernel", "add", 7, 25, 50),
        _ev("gpu_memcpy", "Memcpy HtoD (Pinned -> Device)", 9, 100, 100),
        _ev("cpu_op", "aten::mm", 1, 0, 200),
        _ev("user_annotation", "ignored", 1, 0, 10),
    ]
    names, starts, busy = pt.timeline(events, 2)  # windows [0, 100) and [100, 200) microseconds
    assert starts == [0.0, 0.1]
    assert busy["gpu kernel s7"] == [75.0, 0.0]
    assert busy["gpu h2d s9"] == [0.0, 100.0]
    assert busy["host t1"] == [100.0, 100.0]
    assert names[0] == "host t1"
    path = tmp_path / "t.json.gz"
    with gzip.open(path, "wt") as f:
        json.dump({"traceEvents": events}, f)
    assert pt.main([str(path), "--windows", "2"]) == 0
    assert "gpu_kernel_s7" in capsys.readouterr().out


def test_an_empty_trace_and_bad_windows_are_refused(tmp_path):
    with pytest.raises(SystemExit, match="no kernel"):
        pt.timeline([_ev("user_annotation", "x", 1, 0, 1)], 4)
    p = tmp_path / "t.json"
    p.write_text(json.dumps([_ev("kernel", "k", 1, 0, 1)]))
    with pytest.raises(SystemExit, match="positive"):
        pt.main([str(p), "--windows", "0"])
