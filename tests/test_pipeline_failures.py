"""ramstream.Pipeline on CPU stages, what goes wrong: failures in any stage that change nothing and
never hang, deadlocks detected, persistent threads stopped by close() and collection, re-entry and
in-place inputs refused, bad arguments named, dicing of chunk_modules, traces."""

from __future__ import annotations

import copy
import gc
import json
import threading

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from ramstream import Pipeline

from _pipeline_helpers import (
    CPU2,
    WIDTH,
    Boom,
    Head,
    Tail,
    Whole,
    assert_same,
    batch,
    blocks,
    groups,
    reference_grads,
    run_with_timeout,
)


@pytest.mark.parametrize("where", ["forward", "backward", "loss", "loss-shape"])
@pytest.mark.parametrize("schedule", ["1f1b", "gpipe"])
def test_a_failing_step_changes_nothing_and_the_next_step_is_exact(where, schedule):
    ref = blocks(6)
    ref[3].append(Boom())  # in the middle stage (blocks 2-3)
    mine = copy.deepcopy(ref)
    boom = mine[3][2]
    pipe = Pipeline(stage_modules=groups(mine, 3), devices=["cpu"] * 3)
    x, y = batch()
    pipe.step(x, targets=y, loss_fn=F.mse_loss, n_microbatches=4)  # .grad is set: it must survive
    before = {n: (p.detach().clone(), p.grad.clone()) for n, p in mine.named_parameters()}
    grads = [p.grad for p in mine.parameters()]
    calls = {"n": 0}

    def bad_loss(out, t):
        calls["n"] += 1
        if where == "loss" and calls["n"] == 3:
            raise ValueError("boom in the loss")
        return out.sum(1) if where == "loss-shape" else F.mse_loss(out, t)

    boom.calls = 0
    boom.forward_at = 2 if where == "forward" else None
    boom.backward_armed = where == "backward"
    match = {"forward": "forward", "backward": "backward", "loss": "the loss", "loss-shape": "scalar"}[where]
    with pytest.raises((RuntimeError, ValueError), match=match):
        run_with_timeout(
            lambda: pipe.step(x, targets=y, loss_fn=bad_loss, schedule=schedule, n_microbatches=4)
        )
    for n, p in mine.named_parameters():
        assert torch.equal(p, before[n][0]) and torch.equal(p.grad, before[n][1]), n
    assert all(p.grad is g for p, g in zip(mine.parameters(), grads))  # the same tensors
    boom.forward_at, boom.backward_armed = None, False
    pipe.flush_grads()  # the next step starts a new sum
    run_with_timeout(lambda: pipe.step(x, targets=y, loss_fn=F.mse_loss, schedule=schedule, n_microbatches=4))
    ref.zero_grad()
    reference_grads(ref, x, y, 4)
    assert_same(mine, ref)
    pipe.close()


def test_a_deadlocking_schedule_raises_instead_of_hanging(monkeypatch):
    from ramstream.pipeline import runtime

    real = runtime.schedules.build

    def bad(name, stages, mb, v=1):
        ops = real("gpipe", stages, mb, v)  # stage 0: F0 B0 F1 B1 waits for B0, which needs F1
        ops[0] = [ops[0][0], ops[0][2], ops[0][1], ops[0][3]]
        return ops

    monkeypatch.setattr(runtime.schedules, "build", bad)
    model = blocks(4)
    with Pipeline(stage_modules=groups(model, 2), devices=["cpu", "cpu"]) as pipe:
        x, y = batch()
        with pytest.raises(RuntimeError, match="deadlock"):
            run_with_timeout(lambda: pipe.step(x, targets=y, loss_fn=F.mse_loss, n_microbatches=2), 30)
        assert all(p.grad is None for p in model.parameters())


def _pipeline_threads():
    return {t for t in threading.enumerate() if t.name.startswith("ramstream-pipeline-")}


def test_threads_are_created_once_and_stopped_by_close_and_collection():
    base = _pipeline_threads()
    pipe = Pipeline(stage_modules=groups(blocks(4), 2), devices=["cpu", "cpu"])
    mine = _pipeline_threads() - base
    assert len(mine) == 2
    x, y = batch()
    for _ in range(3):
        pipe.step(x, targets=y, loss_fn=F.mse_loss, n_microbatches=2)
        pipe.infer(x)
        assert _pipeline_threads() - base == mine
    pipe.close()
    pipe.close()  # idempotent
    assert all(not t.is_alive() for t in mine)
    with pytest.raises(RuntimeError, match="closed"):
        pipe.step(x, targets=y, loss_fn=F.mse_loss)

    pipe = Pipeline(stage_modules=groups(blocks(4), 2), devices=["cpu", "cpu"])
    pipe.step(x, targets=y, loss_fn=F.mse_loss, n_microbatches=2)
    mine = _pipeline_threads() - base
    del pipe
    gc.collect()
    for t in mine:
        t.join(10)
        assert not t.is_alive()


def test_a_step_from_inside_a_stage_is_refused_and_changes_nothing():
    model = blocks(4)
    pipe = Pipeline(stage_modules=groups(model, 2), devices=CPU2)
    x, y = batch()

    def reentrant(out, t):
        pipe.step(x, targets=y, loss_fn=F.mse_loss)
        return F.mse_loss(out, t)

    with pytest.raises(RuntimeError, match="already running"):
        run_with_timeout(lambda: pipe.step(x, targets=y, loss_fn=reentrant, n_microbatches=2))
    assert all(p.grad is None for p in model.parameters())
    pipe.step(x, targets=y, loss_fn=F.mse_loss, n_microbatches=2)
    pipe.close()


def test_an_in_place_op_on_a_stage_input_is_explained():
    model = blocks(2)
    with Pipeline(
        stage_modules=[model[0], nn.Sequential(nn.ReLU(inplace=True), model[1])], devices=CPU2
    ) as pipe:
        x, y = batch()
        with pytest.raises(RuntimeError, match="modifies its input in place"):
            run_with_timeout(lambda: pipe.step(x, targets=y, loss_fn=F.mse_loss, n_microbatches=2))
        assert all(p.grad is None for p in model.parameters())


@pytest.mark.cuda
def test_two_gpus_and_a_failure_on_the_gpu():
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    ref = blocks().cuda()
    ref[5].append(Boom())
    mine = copy.deepcopy(ref)
    boom = mine[5][2]
    x, y = (t.cuda() for t in batch())
    with Pipeline(stage_modules=groups(mine, 4), devices=["cuda:0", "cuda:1", "cuda:1", "cuda:0"]) as pipe:
        boom.backward_armed = True
        with pytest.raises(RuntimeError, match="boom in backward"):
            run_with_timeout(lambda: pipe.step(x, targets=y, loss_fn=F.mse_loss, n_microbatches=4))
        assert all(p.grad is None for p in mine.parameters())
        boom.backward_armed = False
        reference_grads(ref, x, y, 4)
        r = pipe.step(x, targets=y, loss_fn=F.mse_loss, n_microbatches=4, schedule="gpipe")
        assert r.loss.device == torch.device("cuda", 0)
        for p, q in zip(mine.parameters(), ref.parameters()):
            assert torch.equal(p.grad.cpu(), q.grad.cpu())


def test_chunk_modules_dice_and_paged_activations_are_accepted():
    model = blocks(5)
    with Pipeline(chunk_modules=list(model), devices=["cpu", "cpu"], offload=False) as pipe:
        assert [len(m.parts) for m in pipe.modules] == [3, 2]  # the earlier stage takes the remainder
    with Pipeline(
        chunk_modules=list(model), chunks_per_stage=[1, 4], offload=False, devices=["cpu", "cpu"]
    ) as pipe:
        assert [len(m.parts) for m in pipe.modules] == [1, 4]
    with Pipeline(chunk_modules=list(model), devices=["cpu", "cpu"], offload_activations=True) as pipe:
        assert len(pipe.activation_stats()) == 2  # paged activations: test_pipeline_act_offload.py


def test_trace_path_writes_a_track_per_stage(tmp_path):
    with Pipeline(stage_modules=groups(blocks(4), 2), devices=["cpu", "cpu"]) as pipe:
        x, y = batch()
        pipe.step(x, targets=y, loss_fn=F.mse_loss, n_microbatches=2, trace_path=tmp_path / "t.json")
        pipe.infer(x, profile_path=tmp_path / "p.json")  # torch.profiler's trace
        with pytest.raises(FileNotFoundError, match="trace_path"):
            pipe.step(x, targets=y, loss_fn=F.mse_loss, trace_path=tmp_path / "no" / "t.json")
    assert json.loads((tmp_path / "p.json").read_text())["traceEvents"]
    ev = json.loads((tmp_path / "t.json").read_text())["traceEvents"]
    spans = [e for e in ev if e["ph"] == "X"]
    assert len(spans) == 8 and {e["tid"] for e in spans} == {1, 2}


def test_bad_arguments_name_the_argument():
    model = blocks(4)
    parts = groups(model, 2)
    cpu2 = ["cpu", "cpu"]
    with pytest.raises(TypeError, match="devices"):
        Pipeline(stage_modules=parts, devices="cpu")
    with pytest.raises(ValueError, match="devices"):
        Pipeline(stage_modules=parts, devices=["cpu", "tpu:0"])
    with pytest.raises(ValueError, match="devices has 3"):
        Pipeline(stage_modules=parts, devices=["cpu"] * 3)
    with pytest.raises(ValueError, match="autocast"):
        Pipeline(stage_modules=parts, devices=cpu2, autocast=torch.float64)
    with pytest.raises(ValueError, match="offload_window"):
        Pipeline(stage_modules=parts, devices=cpu2, offload_window=0)
    with pytest.raises(ValueError, match="offload_grad_accum"):
        Pipeline(stage_modules=parts, devices=cpu2, offload_grad_accum="gpu")
    with pytest.raises(TypeError, match="overlap"):
        Pipeline(stage_modules=parts, devices=cpu2, overlap=1)
    with pytest.raises(TypeError, match=r"stage_modules\[1\]"):
        Pipeline(stage_modules=[parts[0], "x"], devices=cpu2)
    with pytest.raises(ValueError, match="chunks_per_stage"):
        Pipeline(chunk_modules=list(model), chunks_per_stage=[1, 1], devices=cpu2, offload=False)
    with pytest.raises(ValueError, match="chunks_per_stage=3"):
        Pipeline(stage_modules=list(model), chunks_per_stage=3, devices=cpu2)
    with pytest.raises(ValueError, match="not both"):
        Pipeline(model, stage_modules=parts)
    with pytest.raises(ValueError, match="split_spec"):
        Pipeline(stage_modules=parts, split_spec={"1": "beginning"})
    with pytest.raises(TypeError, match="nn.Sequential"):
        Pipeline(Whole(Head(), Tail()), devices=cpu2)
    with pytest.raises(ValueError, match="not a child"):
        Pipeline(model, None, {"nope": "beginning"}, devices=cpu2)
    shared = nn.Linear(WIDTH, WIDTH)
    with pytest.raises(ValueError, match="shared by stages 0 and 1"):
        Pipeline(stage_modules=[shared, nn.Sequential(shared)], devices=cpu2)
    x, y = batch()
    with Pipeline(stage_modules=parts, devices=cpu2) as pipe:
        with pytest.raises(ValueError, match="schedule"):
            pipe.step(x, targets=y, loss_fn=F.mse_loss, schedule="zigzag")
        with pytest.raises(ValueError, match="n_microbatches"):
            pipe.step(x, targets=y, loss_fn=F.mse_loss, n_microbatches=0)
        with pytest.raises(ValueError, match="n_microbatches=11"):
            pipe.step(x, targets=y, loss_fn=F.mse_loss, n_microbatches=11)
        with pytest.raises(ValueError, match="targets has 9 rows"):
            pipe.step(x, targets=y[:9], loss_fn=F.mse_loss)
        with pytest.raises(ValueError, match="not both"):
            pipe.step(x, loss_fn=F.mse_loss, grad_outputs=y)
        with pytest.raises(TypeError, match="loss_fn"):
            pipe.step(x, targets=y, loss_fn=3)
        with pytest.raises(TypeError, match="data"):
            pipe.step([1, 2], targets=y, loss_fn=F.mse_loss)
        with pytest.raises(TypeError, match="grad_outputs"):
            pipe.step(x, grad_outputs=[y])
        with pytest.raises(ValueError, match="grad_outputs entry 0"):
            pipe.step(x, grad_outputs=y[:, :3])
        pipe.step(x, targets=y, loss_fn=F.mse_loss)  # still works after all of that
