"""bench/train/defaults_report.py: the table of bench_defaults.py's runs (issue 24's matrix report),
fast, without running the matrix (tests/test_bench_defaults.py runs it, marked slow)."""

from __future__ import annotations

import os
import sys

import pytest

TRAIN = os.path.join(os.path.dirname(__file__), os.pardir, "bench", "train")


@pytest.fixture
def report(monkeypatch):
    monkeypatch.syspath_prepend(os.path.abspath(TRAIN))
    import defaults_report

    yield defaults_report
    sys.modules.pop("defaults_report", None)


def test_table_shows_the_applied_plan_and_its_predictions(report):
    """The table puts the applied plan's predicted step and peak beside the measured ones (issue
    24: predicted vs measured for every cell), from the run's compact plan."""
    plan = {"planner": {"mode": "offload", "batch": 16, "seq": 2048, "streamed": list(range(16, 32)),
                        "recompute": list(range(32)), "predicted_step_s": 3.474, "predicted_vram_bytes": 21.41 * 2**30}}  # fmt: skip
    run = dict(row="R5", cap_gib=24.0, variant="defaults", status="ok", s_per_step=3.668, peak_gib=21.86,
               setup_s=43.0, to_settled_s=55.9, model_tflops=368.0, moment_dtype="float32", plan=report.compact_plan(plan))  # fmt: skip
    bare = dict(run, variant="hand32", plan={"weights": {}}, s_per_step=3.609)
    head, _, row, row2 = report.table([run, bare])
    cols = [c.strip() for c in head.strip("|").split("|")]
    got = dict(zip(cols, [c.strip() for c in row.strip("|").split("|")]))
    assert got["predicted s/step"] == "3.474" and got["s/step"] == "3.668"
    assert got["predicted peak GiB"] == "21.41" and got["peak GiB"] == "21.86"
    assert got["plan"] == "offload 16x2048: 16 streamed, 32 recompute"
    assert got["defaults/ref"] == f"{3.668 / 3.609:.2f} (hand32)"
    other = dict(zip(cols, [c.strip() for c in row2.strip("|").split("|")]))
    assert other["predicted s/step"] == other["plan"] == "-"
