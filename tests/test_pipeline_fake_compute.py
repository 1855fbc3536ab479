"""Pipeline(fake_compute=...) (RamTorch's schedule-timing aid): the given seconds are slept at each
op of step() and infer() once its input arrived (a stage's seconds split over its chunks), so a
step lasts at least the schedule simulator's makespan; the numbers are those of the same pipeline
without it, and every bad value is refused before anything is built. Replace mode:
test_pipeline_fake_replace.py."""

from __future__ import annotations

import copy
import time

import pytest
import torch
import torch.nn.functional as F

import ramstream.pipeline.run as run_mod
from ramstream import Pipeline, PipelineModel
from ramstream.simulate.pipeline import simulate_schedule

from _pipeline_helpers import CPU2, assert_same, batch, blocks, groups


def _sleeps(monkeypatch) -> list[float]:
    """Records the seconds each op asks to sleep (and sleeps them, as time.sleep does)."""
    asked: list[float] = []
    real = time.sleep

    def sleep(s):
        asked.append(s)
        real(s)

    monkeypatch.setattr(run_mod.time, "sleep", sleep)
    return asked


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_the_numbers_are_those_without_it_and_each_op_sleeps_its_stages_seconds(monkeypatch, schedule):
    model = blocks(8)
    plain = copy.deepcopy(model)
    x, y = batch(12)
    asked = _sleeps(monkeypatch)
    fake = Pipeline(
        stage_modules=groups(model, 2), devices=CPU2, fake_compute={"fwd": [0.002, 0.004], "bwd": 0.006}
    )
    ref = Pipeline(stage_modules=groups(plain, 2), devices=CPU2)
    r1 = fake.step(x, targets=y, loss_fn=F.mse_loss, n_microbatches=4, schedule=schedule)
    n_fake = len(asked)
    r2 = ref.step(x, targets=y, loss_fn=F.mse_loss, n_microbatches=4, schedule=schedule)
    assert len(asked) == n_fake  # the plain pipeline sleeps nothing
    assert torch.equal(r1.loss, r2.loss)
    assert_same(model, plain)
    # 4 forwards and 4 backwards per stage: stage 0 forwards 2 ms, stage 1 4 ms, every backward 6 ms
    assert sorted(asked) == sorted([0.002] * 4 + [0.004] * 4 + [0.006] * 8)
    fake.close()
    ref.close()


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_a_step_lasts_at_least_the_simulated_makespan(schedule):
    """An op sleeps after its input arrived: a stage waiting for an activation or a gradient does
    not count that wait as its compute."""
    tf, tb = [0.02, 0.04], [0.04, 0.06]
    pipe = Pipeline(stage_modules=groups(blocks(4), 2), devices=CPU2, fake_compute={"fwd": tf, "bwd": tb})
    x, y = batch(8)
    t0 = time.perf_counter()
    pipe.step(x, targets=y, loss_fn=F.mse_loss, n_microbatches=4, schedule=schedule)
    wall = time.perf_counter() - t0
    sim = simulate_schedule(schedule, stages=2, microbatches=4, tf=tf, tb=tb)
    assert sim.makespan == pytest.approx(0.46)  # 0.02 + 4 * 0.04 + 4 * 0.06 + 0.04
    assert wall >= sim.makespan
    pipe.close()


def test_serial_steps_take_at_least_the_slept_seconds_and_infer_sleeps_forwards_only(monkeypatch):
    x, y = batch(8)
    pipe = Pipeline(stage_modules=groups(blocks(4), 2), devices=CPU2, overlap=False,
                    fake_compute={"fwd": 0.01, "bwd": 0.02})  # fmt: skip
    asked = _sleeps(monkeypatch)
    t0 = time.perf_counter()
    pipe.step(x, targets=y, loss_fn=F.mse_loss, n_microbatches=4)
    wall = time.perf_counter() - t0
    assert wall >= sum(asked) == pytest.approx(2 * 4 * (0.01 + 0.02))  # one thread: every op in turn
    asked.clear()
    with torch.no_grad():
        out = pipe.infer(x, n_microbatches=2)
    assert out.shape == x.shape and asked == [0.01] * 4
    pipe.close()


def test_interleaved_chunks_share_their_stages_seconds(monkeypatch):
    model = blocks(8)
    pieces = groups(model, 4)  # 4 chunks on 2 stages: chunk c on stage c % 2
    pipe = Pipeline(
        stage_modules=pieces, devices=CPU2, chunks_per_stage=2, fake_compute={"fwd": [0.004, 0.008]}
    )
    asked = _sleeps(monkeypatch)
    x, y = batch(8)
    pipe.step(x, targets=y, loss_fn=F.mse_loss, n_microbatches=2, schedule="interleaved")
    forwards = sorted(s for s in asked if s > 0)
    assert forwards == sorted([0.002] * 4 + [0.004] * 4)  # each of a stage's 2 chunks: half its seconds
    assert asked.count(0.0) == 8  # the backwards: 0 s (not given)
    pipe.close()


def test_pipeline_model_passes_it_on(monkeypatch):
    model = blocks(4)
    pm = PipelineModel(model, devices=CPU2, fake_compute={"bwd": 0.003})
    asked = _sleeps(monkeypatch)
    x, y = batch(6)
    pm.step(x, targets=y, loss_fn=F.mse_loss, n_microbatches=3)
    assert sorted(asked) == [0.0] * 6 + [0.003] * 6


@pytest.mark.parametrize(
    "value,error,match",
    [
        ("replace ", ValueError, "fake_compute='replace ' is not accepted"),
        ("sleep", ValueError, "fake_compute='sleep' is not accepted"),
        ({}, ValueError, "is not accepted"),
        ({"fwd": 1, "other": 2}, ValueError, "is not accepted"),
        ({"fwd": -0.1}, ValueError, "seconds >= 0"),
        ({"bwd": float("nan")}, ValueError, "seconds >= 0"),
        ({"fwd": True}, ValueError, "seconds >= 0"),
        ({"fwd": "1"}, ValueError, "seconds >= 0"),
        ({"fwd": [0.1, 0.2, 0.3]}, ValueError, "3 entries for 2 stages"),
        (0.1, ValueError, "is not accepted"),
    ],
)
def test_bad_values_name_fake_compute(value, error, match):
    with pytest.raises(error, match=match):
        Pipeline(stage_modules=groups(blocks(4), 2), devices=CPU2, fake_compute=value)
