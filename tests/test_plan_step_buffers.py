"""The planner counts the host buffers of accumulation_steps and delayed_update (issue 24 point 1,
issue 29 point 2): wrap()'s host-RAM check (planner/host_fit.py) and the plan the planner makes for
wrap() agree, so a plan never picks a moment dtype that wrap() then refuses.

Found on the GPU machine (2026-12-05, bench_delayed.py, GPT 6.85B bf16, 24 GiB cap): the plan chose
fp32 moments without the delayed-update buffers, and wrap() refused the run with a MemoryError whose
arithmetic showed that bf16 moments fit."""

from __future__ import annotations

import pytest

from ramstream.planner import PlanError, plan_training
from ramstream.planner.host_fit import host_components, pick_moment_dtype
from ramstream.planner.shape import ModelShape
from ramstream.runtime.inspect import plan_for
from test_plan_value import _h200  # the H200 machine's rates under a cap

from _models import make_model

GIB = 2**30


def _gpt685():
    return ModelShape.gpt("6.85b", batch=8, seq=512, dtype="bf16", loss="chunked")


def _ram(plan) -> dict:
    return {k: v for k, v in plan.memory["ram"].items() if k not in ("total", "budget")}


@pytest.mark.parametrize("mode", ["cpu", "auto"])
def test_delayed_update_buffers_count_for_the_host_share_as_wraps_check_counts_them(mode):
    """optimizer_mode="cpu": every parameter is delayed, the buffers count for all of them and the
    fp32 moments no longer fit: bf16. "auto": only the host share is delayed (the GPU's VRAM and
    mapped shares are not), the buffers count for it alone. Either way wrap()'s own check, given
    the plan's host share (wrap.py _delayed_share), picks what the plan picked."""
    from types import SimpleNamespace as NS

    from ramstream.runtime.delayed_split import host_share

    shape, prof = _gpt685(), _h200(24)
    plain = plan_training(shape, prof, optimizer_mode=mode)
    delayed = plan_training(shape, prof, delayed_update=True, optimizer_mode=mode)
    assert "delayed_update_buffers" not in _ram(plain)
    n = shape.trained_numel
    host = delayed.optimizer["split"]["host"]
    assert (host == 1.0) == (mode == "cpu")
    got_bytes = _ram(delayed)["delayed_update_buffers"]
    assert abs(got_bytes - host * n * 2 * shape.elem_bytes) <= 2 * shape.elem_bytes * 2
    if mode == "cpu":  # with fp32 moments the delayed run's host state exceeds the RAM budget
        assert (
            plain.optimizer["moment_dtype"] == "float32" and delayed.optimizer["moment_dtype"] == "bfloat16"
        )
    share = host_share(delayed, NS(delayed_update=40, optimizer_mode=mode))
    assert share is True if mode == "cpu" else share == host
    got = pick_moment_dtype("auto", numel=n, working_bytes=shape.elem_bytes, accumulate=False, streamed=0,
                            check=True, log=lambda s: None, ram={"available": prof.ram_available},
                            delayed=share)  # fmt: skip
    assert str(got) == "torch." + delayed.optimizer["moment_dtype"]


@pytest.mark.parametrize("accum", [1, 4])
@pytest.mark.parametrize("delayed", [False, True])
@pytest.mark.parametrize("moment", ["float32", "bfloat16"])
def test_an_all_host_plan_counts_the_bytes_wraps_check_counts(accum, delayed, moment):
    """Every parameter updated on the host, no block streamed: the plan's RAM components add up to
    host_components' (the sum wrap() compares with the budget) for the same options."""
    shape = ModelShape.gpt("1.8b", batch=8, seq=512, dtype="bf16", loss="chunked")
    plan = plan_training(shape, _h200(24, ram_gib=400), optimizer_mode="cpu", param_offload=False,
                         activation_offload=False, moment_dtype=moment, accumulation_steps=accum,
                         delayed_update=delayed)  # fmt: skip
    mb = 2 if moment == "bfloat16" else 4
    want = host_components(shape.trained_numel, shape.elem_bytes, mb, accum > 1, 0, delayed)
    ram = _ram(plan)
    assert ram.get("accumulator", 0) == want.get("accumulator", 0)
    assert ram.get("delayed_update_buffers", 0) == want.get("delayed update buffers", 0)
    assert sum(ram.values()) == sum(want.values())


def test_the_first_steps_count_the_device_share_on_the_host():
    """optimizer state later moved into VRAM (vram_share after step 2) is on the host until then:
    the plan's RAM counts every trained element's master and moments, as wrap()'s check does."""
    shape = _gpt685()
    plan = plan_training(shape, _h200(24), moment_dtype="float32")
    assert plan.optimizer["split"]["device"] > 0  # some state goes to VRAM later
    n = shape.trained_numel
    assert _ram(plan)["optimizer_state"] >= n * (4 + 2 * 4)


def test_suggestions_keep_accumulation_and_delayed_update():
    """The refusal's "would fit" is tried with the run's own accumulation and delayed update: bf16
    moments alone do not fit here and are not offered."""
    shape, prof = _gpt685(), _h200(24)
    with pytest.raises(PlanError) as e:
        plan_training(shape, prof, delayed_update=True, accumulation_steps=2)
    text = str(e.value)
    assert "delayed_update_buffers" in text and "accumulator" in text
    assert "moment_dtype='bfloat16'" not in text.split("would fit:")[1]


@pytest.mark.parametrize(
    "opt, err",
    [({"accumulation_steps": 0}, "accumulation_steps=0"), ({"delayed_update": "yes"}, "delayed_update='yes'"),
     ({"delayed_update": -1}, "delayed_update=-1")],
)  # fmt: skip
def test_bad_values_name_the_option(opt, err):
    with pytest.raises(ValueError, match=err):
        plan_training(_gpt685(), _h200(24), **opt)


def test_plan_for_takes_the_options_and_counts_them():
    model = make_model(0, n_blocks=4, d=64)
    prof = _h200(1, ram_gib=64)
    plain = plan_for(model, profile=prof, batch=2, seq=8, optimizer_mode="cpu")
    both = plan_for(model, profile=prof, batch=2, seq=8, optimizer_mode="cpu", accumulation_steps=2,
                    delayed_update=3)  # fmt: skip
    n = sum(p.numel() for p in model.parameters())
    wb = next(model.parameters()).element_size()
    assert "accumulator" not in plain.memory["ram"]
    assert both.memory["ram"]["accumulator"] == n * 4
    assert both.memory["ram"]["delayed_update_buffers"] == n * (2 * wb + 4)


def test_delayed_update_plans_as_wrap_runs_it():
    """wrap(delayed_update=...): no resident switch, so never a resident plan; "cpu" updates every
    parameter on the host; "auto" keeps the VRAM share of the plan without delay and a mapped
    share (both not delayed); the GPU optimizer alone cannot be delayed."""
    big = ModelShape.gpt("1.8b", batch=8, seq=512, dtype="bf16", loss="chunked")
    assert plan_training(big, _h200(80)).mode == "resident"
    assert plan_training(big, _h200(80), delayed_update=True).mode == "offload"
    cpu = plan_training(_gpt685(), _h200(24), delayed_update=True, optimizer_mode="cpu")
    assert cpu.optimizer["split"]["mapped"] == cpu.optimizer["split"]["device"] == 0
    auto, plain = (
        plan_training(_gpt685(), _h200(24), delayed_update=True),
        plan_training(_gpt685(), _h200(24)),
    )
    assert auto.optimizer["split"]["device"] == plain.optimizer["split"]["device"]
    assert auto.optimizer["split"]["mapped"] > 0 and auto.optimizer["split"]["host"] > 0
    with pytest.raises(ValueError, match="delayed_update needs the host AdamW"):
        plan_training(_gpt685(), _h200(24), delayed_update=True, optimizer_mode="gpu")


def test_cli_plan_takes_accumulation_and_delayed_update(capsys, monkeypatch, tmp_path):
    from ramstream.cli import main

    monkeypatch.setenv("RAMSTREAM_CACHE_DIR", str(tmp_path / "empty-cache"))
    args = ["plan", "--gpt", "6.85b", "--vram-gb", "24", "--ram-gb", "120", "--batch", "8", "--seq", "512",
            "--chunked-loss"]  # fmt: skip
    assert main(args) == 0
    plain = capsys.readouterr().out
    assert main(args + ["--delayed-update", "--accumulation-steps", "2"]) == 2  # no longer fits 108 GiB
    err = capsys.readouterr().err
    assert "delayed_update_buffers" in err and "accumulator" in err and "moments float32" in plain
    assert main(args + ["--delayed-update"]) == 0
    assert "delayed_update_buffers" in capsys.readouterr().out
    assert main(args + ["--accumulation-steps", "0"]) == 2
    assert "--accumulation-steps 0 is not accepted" in capsys.readouterr().err
