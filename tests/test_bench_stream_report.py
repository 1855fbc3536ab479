"""bench/train/stream_report.py: the planner's prediction recorded for a configuration (its shape
built like stream_models.py's model) and printed next to the measured step, on the CPU."""

from __future__ import annotations

import os
import sys

import pytest
import torch

TRAIN = os.path.join(os.path.dirname(__file__), os.pardir, "bench", "train")


@pytest.fixture
def report(monkeypatch, tmp_path):
    monkeypatch.setenv("RAMSTREAM_CACHE_DIR", str(tmp_path))
    monkeypatch.syspath_prepend(os.path.abspath(TRAIN))
    import stream_report

    yield stream_report
    sys.modules.pop("stream_report", None)


def _cfg(**kw):
    c = dict(name="X_defaults", row="X", seq=64, batch=2, loss="dense", options={}, ckpt=False, baseline=None,
             target=None, expect=None)  # fmt: skip
    c.update(kw)
    return c


def test_shape_matches_the_built_gpt(report):
    from gpt import GPT

    from ramstream.planner import ModelShape

    cfg = _cfg()
    s = report._shape(cfg, "gpt_tiny", False, None)
    model = GPT(vocab=512, d=128, layers=2, heads=4, ctx=1024)
    assert s.numel == sum(p.numel() for p in model.parameters())
    assert s.blocks[0].weight_bytes == sum(p.numel() * 4 for p in model.layers[0].parameters())
    assert isinstance(s, ModelShape) and s.autocast is None
    assert report._shape(cfg, "gpt_tiny", True, None).autocast == "bfloat16"


def test_prediction_recorded_and_printed(report):
    cfg = _cfg(options={"activation_checkpointing": True, "weight_window": 2, "verbose": False})
    pred = report.planner_prediction(cfg, "gpt_tiny", torch.device("cpu"))
    assert "predicted_error" not in pred, pred
    assert (
        pred["predicted_s"] > 0
        and pred["mode"] == "cpu"
        and pred["profile"]["source"] in ("measured", "cache")
    )
    bad = report.planner_prediction(_cfg(options={"param_offload": [99]}), "gpt_tiny", torch.device("cpu"))
    assert "predicted_error" in bad and "param_offload" in bad["predicted_error"]
    r = dict(name="X_defaults", status="OK", s_per_step=2 * pred["predicted_s"], peak_gib=None, planner=pred)
    lines = report.summarize([r], {"X_defaults": cfg})
    assert "planned" in lines[0] and "m/p" in lines[0]
    assert f"{pred['predicted_s']:8.3f}" in lines[1] and " 2.00 " in lines[1]
    assert r["measured_over_predicted"] == pytest.approx(2.0)
