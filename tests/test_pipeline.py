"""ramstream.Pipeline on CPU stages, what a step computes: bit-identical to training the unsplit
model (every schedule, 1/2/4 stages, interleaved chunks), frozen parameters, tuple outputs,
grad_outputs, autocast, flush_grads' one meaning, infer and the model= path."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import ramstream
from ramstream import Pipeline

from _pipeline_helpers import (
    CPU2,
    WIDTH,
    Head,
    Tail,
    Whole,
    assert_same,
    batch,
    blocks,
    groups,
    reference_grads,
    run_with_timeout,
    tuple_loss,
)

CASES = [
    ("gpipe", 1, 1),
    ("gpipe", 2, 1),
    ("gpipe", 4, 1),
    ("1f1b", 1, 1),
    ("1f1b", 2, 1),
    ("1f1b", 4, 1),
    ("staggered_1b1f", 2, 1),
    ("interleaved", 1, 2),
    ("interleaved", 2, 2),
    ("interleaved", 4, 2),
]


@pytest.mark.parametrize("schedule,stages,v", CASES, ids=[f"{s}-{k}x{v}" for s, k, v in CASES])
@pytest.mark.parametrize("overlap", [True, False], ids=["threads", "serial"])
def test_steps_equal_the_unsplit_model_bit_for_bit(schedule, stages, v, overlap):
    ref = blocks()
    mine = copy.deepcopy(ref)
    pipe = Pipeline(
        stage_modules=groups(mine, stages * v),
        chunks_per_stage=v,
        devices=["cpu"] * stages,
        overlap=overlap,
    )
    opt_ref = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    opt = torch.optim.AdamW(pipe.parameters(), lr=1e-2)
    for it in range(2):
        x, y = batch(seed=it)  # 10 rows in 4 microbatches: 3, 3, 2, 2
        losses = reference_grads(ref, x, y, 4)
        r = pipe.step(x, targets=y, loss_fn=F.mse_loss, schedule=schedule, n_microbatches=4)
        assert len(r.losses) == 4 and all(torch.equal(a, b) for a, b in zip(r.losses, losses))
        assert torch.equal(r.loss, torch.stack(losses).mean())
        assert torch.equal(r.output, torch.cat(r.outputs)) and r.output.shape == (10, WIDTH)
        assert_same(mine, ref)
        opt_ref.step()
        opt.step()
        opt_ref.zero_grad()
        opt.zero_grad()
        assert_same(mine, ref)
    pipe.close()


def test_frozen_parameters_and_a_frozen_first_stage():
    ref = blocks()
    for i in (0, 1, 5):
        ref[i].requires_grad_(False)  # stage 0 (blocks 0-1) is frozen: its output needs no grad
    mine = copy.deepcopy(ref)
    with Pipeline(stage_modules=groups(mine, 4), devices=["cpu"] * 4) as pipe:
        x, y = batch()
        reference_grads(ref, x, y, 2)
        pipe.step(x, targets=y, loss_fn=F.mse_loss, n_microbatches=2)
        assert_same(mine, ref)
        assert all(p.grad is None for p in mine[5].parameters())


def test_tuple_outputs_between_stages():
    torch.manual_seed(0)
    ref = Whole(Head(), Tail())
    mine = copy.deepcopy(ref)
    with Pipeline(stage_modules=[mine.head, mine.tail], devices=["cpu", "cpu"]) as pipe:
        x, y = batch(8)
        reference_grads(ref, x, y, 4, tuple_loss)
        r = pipe.step(x, targets=y, loss_fn=tuple_loss, n_microbatches=4)
        assert_same(mine, ref)
        assert isinstance(r.output, tuple) and r.output[1].dtype == torch.long


@pytest.mark.parametrize("kind", ["tensor", "callable", "tuple"])
def test_grad_outputs_bypass_the_loss(kind):
    ref = blocks()
    mine = copy.deepcopy(ref)
    x, _ = batch()
    g = torch.randn(10, WIDTH, generator=torch.Generator().manual_seed(5))
    for xm, gm in zip(x.tensor_split(2), g.tensor_split(2)):
        ref(xm).backward(gm)  # as given: not divided by the microbatch count
    go = {"tensor": g, "tuple": (g,), "callable": None}[kind]
    if kind == "callable":
        pieces = iter(g.tensor_split(2))

        def go(out, target):
            assert target is None and not out.requires_grad
            return next(pieces)

    with Pipeline(stage_modules=groups(mine, 2), devices=["cpu", "cpu"]) as pipe:
        r = pipe.step(x, grad_outputs=go, n_microbatches=2)
        assert r.losses == []
        with pytest.raises(RuntimeError, match="grad_outputs"):
            _ = r.loss
    assert_same(mine, ref)


def test_autocast_bfloat16_per_stage_and_fp16_refused_for_training():
    ref = blocks()
    mine = copy.deepcopy(ref)
    x, y = batch()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        reference_grads(ref, x, y, 2)
    with Pipeline(stage_modules=groups(mine, 2), devices=["cpu", "cpu"], autocast=torch.bfloat16) as pipe:
        r = pipe.step(x, targets=y, loss_fn=F.mse_loss, n_microbatches=2)
        assert r.outputs[0].dtype == torch.bfloat16
        assert all(p.grad.dtype == torch.float32 for p in mine.parameters())
        assert_same(mine, ref)
    with Pipeline(stage_modules=groups(blocks(), 2), devices=["cpu", "cpu"], autocast="fp16") as pipe:
        with pytest.raises(ValueError, match="loss scaling"):
            pipe.step(x, targets=y, loss_fn=F.mse_loss)
        assert pipe.infer(x).dtype == torch.float16


def test_flush_grads_has_one_meaning():
    model = blocks(4)
    ref = copy.deepcopy(model)
    pipe = Pipeline(stage_modules=groups(model, 2), devices=["cpu", "cpu"])
    (x1, y1), (x2, y2) = batch(seed=1), batch(seed=2)
    pipe.step(x1, targets=y1, loss_fn=F.mse_loss, n_microbatches=2)
    pipe.step(x2, targets=y2, loss_fn=F.mse_loss, n_microbatches=2)
    reference_grads(ref, x1, y1, 2)
    reference_grads(ref, x2, y2, 2)  # two steps without a flush: the sum, as torch accumulates
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=0, atol=1e-7)
    pipe.flush_grads(0.5)  # the mean of the two steps
    kept = [p.grad.clone() for p in model.parameters()]
    pipe.flush_grads(0.5)  # a second flush with no step between changes nothing
    assert all(torch.equal(p.grad, k) for p, k in zip(model.parameters(), kept))
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad * 0.5, rtol=0, atol=1e-7)
    r = pipe.step(x1, targets=y1, loss_fn=F.mse_loss, n_microbatches=2)  # a new sum starts
    ref.zero_grad()
    reference_grads(ref, x1, y1, 2)
    assert_same(model, ref)
    r.flush_grads()  # the result's flush is the pipeline's
    assert_same(model, ref)
    with pytest.raises(TypeError, match="scale"):
        pipe.flush_grads("1")
    pipe.close()


def test_infer_and_the_model_path_equal_the_model():
    ref = blocks(6)
    mine = copy.deepcopy(ref)
    x, y = batch()
    with Pipeline(mine, None, {"2": "beginning", "3": "end"}, devices=["cpu"] * 3) as pipe:
        assert [len(m) if isinstance(m, nn.Sequential) else len(m.parts) for m in pipe.modules] == [2, 2, 2]
        with torch.no_grad():
            assert torch.equal(
                pipe.infer(x, n_microbatches=3), torch.cat([ref(p) for p in x.tensor_split(3)])
            )
        assert all(p.grad is None for p in mine.parameters())
        reference_grads(ref, x, y, 5)
        pipe.step(x, targets=y, loss_fn=F.mse_loss, n_microbatches=5)
        assert_same(mine, ref)
    with Pipeline(copy.deepcopy(ref), devices=["cpu", "cpu"]) as pipe:  # balanced by parameters
        assert len(pipe.modules) == 2
        with torch.no_grad():
            assert torch.equal(
                pipe.infer(x, n_microbatches=2), torch.cat([ref(p) for p in x.tensor_split(2)])
            )


def test_default_loss_is_the_output_sum_and_targets_need_a_loss_fn():
    ref = blocks(2)
    mine = copy.deepcopy(ref)
    x, y = batch()
    with Pipeline(stage_modules=groups(mine, 2), devices=["cpu", "cpu"]) as pipe:
        reference_grads(ref, x, torch.zeros_like(x), 2, lambda o, _t: o.sum())
        pipe.step(x, n_microbatches=2)
        assert_same(mine, ref)
        with pytest.raises(ValueError, match="loss_fn"):
            pipe.step(x, targets=y)


@pytest.mark.parametrize("overlap", [True, False], ids=["threads", "serial"])
def test_infer_on_interleaved_chunks(overlap):
    model = blocks()
    with Pipeline(stage_modules=groups(model, 8), chunks_per_stage=4, devices=CPU2, overlap=overlap) as pipe:
        x, _ = batch(9)
        with torch.no_grad():
            want = torch.cat([model(p) for p in x.tensor_split(5)])
        assert torch.equal(run_with_timeout(lambda: pipe.infer(x, n_microbatches=5)), want)


@pytest.mark.cuda
def test_two_stages_on_one_gpu_equal_the_unsplit_model():
    ref = blocks().cuda()
    mine = copy.deepcopy(ref)
    x, y = (t.cuda() for t in batch())
    reference_grads(ref, x, y, 4)
    with Pipeline(stage_modules=groups(mine, 2), devices=["cuda:0", "cuda:0"]) as pipe:
        assert all(ch.stream is not None for ch in pipe._chunks)
        r = pipe.step(x, targets=y, loss_fn=F.mse_loss, n_microbatches=4)
        assert r.loss.is_cuda
        assert_same(mine, ref)
        with torch.no_grad():
            assert torch.equal(
                pipe.infer(x, n_microbatches=4), torch.cat([ref(p) for p in x.tensor_split(4)])
            )


def test_exported_from_ramstream():
    for name in ("Pipeline", "PipelineModel", "PipelinePaddingWarning"):
        assert name in ramstream.__all__ and getattr(ramstream, name) is not None
    assert issubclass(ramstream.PipelinePaddingWarning, UserWarning)
