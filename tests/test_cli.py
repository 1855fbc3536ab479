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


# ---- `ramstream plan --config`: the file checked before any work (issue 25 item 8) ----------------

_TINY = dict(model_type="qwen2", hidden_size=256, intermediate_size=512, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, vocab_size=1000, tie_word_embeddings=False)  # fmt: skip


@pytest.mark.parametrize(
    "make, says",
    [
        (lambda d: d / "nope.json", "--config '{p}' does not exist"),
        (lambda d: (d / "c.json").write_text("{oops") and d / "c.json", "--config '{p}' is not JSON: "),
        (lambda d: (d / "c.json").write_text("[]") and d / "c.json", "--config '{p}' holds a JSON list"),
        (lambda d: d, "--config folder '{p}' holds no config.json"),
    ],
)
def test_plan_config_that_is_missing_or_not_a_json_object_exits_2_naming_it(tmp_path, capsys, make, says):
    p = make(tmp_path)
    assert main(["plan", "--config", str(p), "--vram-gb", "24", "--ram-gb", "64"]) == 2
    err = capsys.readouterr().err
    assert says.format(p=p) in err and "Traceback" not in err, err


def test_plan_config_reads_the_file_named_not_its_folders_config_json(tmp_path, capsys):
    (tmp_path / "config.json").write_text(json.dumps(_TINY))
    (tmp_path / "deeper.json").write_text(json.dumps(dict(_TINY, num_hidden_layers=5)))
    args = ["--vram-gb", "24", "--ram-gb", "64", "--json"]
    assert main(["plan", "--config", str(tmp_path / "deeper.json"), *args]) == 0
    deeper = json.loads(capsys.readouterr().out)["plan"]
    assert main(["plan", "--config", str(tmp_path), *args]) == 0
    shallow = json.loads(capsys.readouterr().out)["plan"]
    assert deeper["weights"]["resident"] == [0, 1, 2, 3, 4]  # the 5 blocks of deeper.json
    assert shallow["weights"]["resident"] == [0, 1]
