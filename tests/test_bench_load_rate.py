"""bench/train/stream_models.load_rate: the weight loads' rate from a trace, overlaps counted once."""

import json
import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "bench" / "train"))
from stream_models import load_rate  # noqa: E402


def _x(name, cat, ts, dur, nbytes=None):
    e = {"name": name, "cat": cat, "ph": "X", "ts": ts, "dur": dur, "pid": 1, "tid": 2}
    if nbytes is not None:
        e["args"] = {"bytes": nbytes}
    return e


def test_load_rate_counts_overlapping_loads_once_and_ignores_other_lanes(tmp_path):
    events = [
        _x("load 0", "h2d", 0.0, 100.0, 5_000_000),  # 0..100 us
        _x("load 1", "h2d", 50.0, 100.0, 5_000_000),  # 50..150: overlaps by 50
        _x("load 2", "h2d", 300.0, 50.0, 2_500_000),  # 300..350
        _x("weights", "h2d", 400.0, 500.0, 10**9),  # the engine's weight refresh, not a block load
        _x("block 0", "compute", 0.0, 1000.0),
    ]
    path = tmp_path / "t.json"
    path.write_text(json.dumps({"traceEvents": events}))
    r = load_rate(str(path))
    assert r["loads"] == 3 and r["bytes"] == 12_500_000
    assert abs(r["busy_s"] - 200e-6) < 1e-12  # 150 us + 50 us
    assert abs(r["gbps"] - 12_500_000 / 200e-6 / 1e9) < 1e-9


def test_load_rate_without_loads(tmp_path):
    path = tmp_path / "t.json"
    path.write_text(json.dumps({"traceEvents": [_x("block 0", "compute", 0.0, 10.0)]}))
    assert load_rate(str(path)) == {"loads": 0, "bytes": 0, "busy_s": 0.0, "gbps": None}


def test_load_rate_splits_loads_by_whether_a_gradient_copy_shared_the_bus(tmp_path):
    events = [
        _x("load 0", "h2d", 0.0, 100.0, 5_000_000),  # alone: 50 GB/s
        _x("load 1", "h2d", 200.0, 100.0, 4_000_000),  # beside "grad 0": 40 GB/s
        _x("load 2", "h2d", 400.0, 100.0, 4_500_000),  # touches "grad 1" only at its end: alone
        _x("grad 0", "d2h", 250.0, 100.0, 1_000_000),
        _x("grad 1", "d2h", 500.0, 10.0, 1_000_000),
    ]
    path = tmp_path / "t.json"
    path.write_text(json.dumps({"traceEvents": events}))
    r = load_rate(str(path))
    assert r["loads"] == 3 and r["bytes"] == 13_500_000
    assert r["alone"]["loads"] == 2 and r["alone"]["bytes"] == 9_500_000
    assert abs(r["alone"]["gbps"] - 9_500_000 / 200e-6 / 1e9) < 1e-9
    assert r["beside_d2h"]["loads"] == 1 and abs(r["beside_d2h"]["gbps"] - 40.0) < 1e-9
