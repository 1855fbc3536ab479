"""The `ramstream` command line: info, bench and demo run and report what they claim."""

from __future__ import annotations

import json
import re

import pytest
import torch

from ramstream.cli import main


def test_info_json_matches_the_native_library(capsys):
    from ramstream._native import lib

    assert main(["info", "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["isa"] == lib().active_isa() and d["threads"] == lib().num_threads()
    assert d["ram"]["total"] >= d["ram"]["available"] > 0
    assert d["torch"] == torch.__version__


def test_bench_reports_both_rates_and_their_ratio(capsys):
    assert main(["bench", "--params", "200000", "--repeat", "2"]) == 0
    out = capsys.readouterr().out
    rates = [float(x) for x in re.findall(r"([\d.]+) G params/s", out)]
    ratio = float(out.rsplit(":", 1)[1].strip().rstrip("x"))
    assert len(rates) >= 2 and all(r > 0 for r in rates) and ratio > 0


def test_demo_trains_both_alike_and_the_loss_falls(capsys):
    assert main(["demo", "--device", "cpu", "--steps", "6"]) == 0
    out = capsys.readouterr().out
    losses = {}
    for line in out.splitlines():
        parts = line.split()
        if parts and parts[0] in ("torch", "ramstream"):
            losses[parts[0]] = (float(parts[2]), float(parts[4]))
    assert losses["torch"] == losses["ramstream"]  # bit-identical training
    assert losses["torch"][1] < losses["torch"][0]  # a task it learns
    assert "(OK;" in out


@pytest.mark.parametrize(
    "argv", [["demo", "--device", "tpu"], ["demo", "--steps", "0"], ["bench", "--params", "0"], ["nope"]]
)
def test_bad_arguments_exit_with_a_usage_error(argv, capsys):
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2
    assert "error" in capsys.readouterr().err
