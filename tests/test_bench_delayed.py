"""bench/train/bench_delayed.py's CPU smoke (--device cpu --tiny): both runs train, the delayed one
delays every step after its warm-up, the losses agree through the warm-up and differ after it."""

from __future__ import annotations

import importlib.util
import json
import os
import runpy
import sys

SCRIPT = os.path.join(os.path.dirname(__file__), os.pardir, "bench", "train", "bench_delayed.py")


def test_bench_delayed_cpu_smoke(tmp_path, monkeypatch):
    out, png = tmp_path / "delayed.json", tmp_path / "delayed.png"
    argv = [
        SCRIPT,
        "--device",
        "cpu",
        "--tiny",
        "--steps",
        "8",
        "--warmup",
        "2",
        "--out",
        str(out),
    ]
    plots = importlib.util.find_spec("matplotlib") is not None  # an optional extra: not in CI
    if plots:
        argv += ["--plot", str(png)]
    monkeypatch.setattr(sys, "argv", argv)
    main = runpy.run_path(SCRIPT)["main"]  # on the CPU both variants run in this process
    assert main() == 0
    r = json.loads(out.read_text())
    plain, delayed = r["plain"], r["delayed"]
    assert plain["delayed_steps"] == 0 and delayed["delayed_steps"] == 6
    assert len(plain["losses"]) == len(delayed["losses"]) == 8
    # steps 1-3 read the same weights (step 3 reads update 2, the last undelayed one)
    assert plain["losses"][:3] == delayed["losses"][:3]
    assert plain["losses"][3:] != delayed["losses"][3:]
    assert r["ratio_step_s"] > 0
    assert not plots or png.stat().st_size > 0


def test_runs_in_separate_calls_combine_to_the_same_comparison(tmp_path, monkeypatch):
    """--variants plain / --variants delayed (one device call each), then --combine: the same losses
    as the run with both, and the ratio of the two runs' s/step."""
    base = [SCRIPT, "--device", "cpu", "--tiny", "--steps", "6", "--warmup", "2"]
    main = runpy.run_path(SCRIPT)["main"]
    paths = {}
    for name in ("plain", "delayed", "plain,delayed"):
        paths[name] = tmp_path / f"{name}.json"
        monkeypatch.setattr(sys, "argv", base + ["--variants", name, "--out", str(paths[name])])
        assert main() == 0
    one = json.loads(paths["plain"].read_text())
    assert "delayed" not in one and "ratio_step_s" not in one
    joined = tmp_path / "joined.json"
    monkeypatch.setattr(
        sys, "argv", [SCRIPT, "--combine", str(paths["plain"]), str(paths["delayed"]), "--out", str(joined)]
    )
    assert main() == 0
    j, both = json.loads(joined.read_text()), json.loads(paths["plain,delayed"].read_text())
    for k in ("plain", "delayed"):
        assert j[k]["losses"] == both[k]["losses"]  # the CPU engine is deterministic
    assert j["ratio_step_s"] == j["delayed"]["step_s"] / j["plain"]["step_s"]
    monkeypatch.setattr(sys, "argv", [SCRIPT, "--combine", str(paths["plain"]), "--out", str(joined)])
    assert main() == 2  # a plain run alone compares nothing
    (tmp_path / "bad.json").write_text("[1, 2]")
    for bad in (tmp_path / "missing.json", tmp_path / "bad.json"):
        monkeypatch.setattr(sys, "argv", [SCRIPT, "--combine", str(paths["plain"]), str(bad)])
        assert main() == 2
