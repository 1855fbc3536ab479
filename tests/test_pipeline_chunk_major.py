"""Chunk-major streamed stages (Pipeline(offload_chunk_major=True), pipeline/chunk_major.py) on CPU
stages: each streamed chunk is loaded once per run of ops (GPipe: twice per step) instead of once
per microbatch, with outputs, losses, .grad and the weights after AdamW bit-identical to the unsplit
model and to microbatch-major execution (a failure inside a chunk-major run: test_pipeline_streamed.py);
an in-place first op is refused with a clear error; the trace shows the runs."""

from __future__ import annotations

import copy
import json
import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from ramstream import Pipeline
from ramstream.pipeline import chunk_major

from _pipeline_helpers import (
    WIDTH,
    Head,
    Tail,
    Whole,
    assert_same,
    batch,
    blocks,
    reference_grads,
    tuple_loss,
)


def loads(pipe) -> list[int]:
    return [m.streamer.stats["loads"] for m in pipe.modules if hasattr(m, "streamer")]


def cuts(kids, stages):
    per = len(kids) // stages
    return [kids[i * per : (i + 1) * per] for i in range(stages)]


CASES = [
    (1, "gpipe", True),
    (2, "gpipe", True),
    (2, "1f1b", "checkpoint"),
    (4, "gpipe", "checkpoint"),
    (4, "1f1b", True),
]


@pytest.mark.parametrize("stages,schedule,keep", CASES, ids=[f"{s}st-{c}-keep={k}" for s, c, k in CASES])
def test_chunk_major_equals_the_unsplit_model_and_microbatch_major(stages, schedule, keep):
    ref = blocks(8)
    ref[2].requires_grad_(False)  # a frozen chunk streams too
    mine, other = copy.deepcopy(ref), copy.deepcopy(ref)
    kw = dict(devices=["cpu"] * stages, offload_window=1, offload_pin=0, offload_keep_activations=keep)
    pipe = Pipeline(stage_modules=cuts(list(mine), stages), **kw)
    slow = Pipeline(stage_modules=cuts(list(other), stages), offload_chunk_major=False, **kw)
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (ref, mine, other)]
    for it in range(3):
        x, y = batch(seed=it)
        losses = reference_grads(ref, x, y, 4)
        r = pipe.step(x, targets=y, loss_fn=F.mse_loss, n_microbatches=4, schedule=schedule)
        s = slow.step(x, targets=y, loss_fn=F.mse_loss, n_microbatches=4, schedule=schedule)
        assert all(torch.equal(a, b) for a, b in zip(r.losses, losses))
        assert all(torch.equal(a, b) for a, b in zip(s.losses, losses))
        assert torch.equal(r.output, s.output)
        assert_same(mine, ref)
        assert_same(other, ref)
        for o in opts:
            o.step()
            o.zero_grad()
        assert_same(mine, ref)
    assert not any(b.loaded for st in pipe.modules for b in st.streamer.blocks)  # home between steps
    pipe.close()
    slow.close()


def test_gpipe_loads_each_streamed_chunk_twice_per_step():
    """2 streamed stages of 4 chunks, window 1, 4 microbatches: chunk-major, 2 loads per chunk per
    step (forward, backward; the last chunk stays loaded from one into the other: 7), where
    microbatch-major loads them for every microbatch; inference: once per chunk (4, not 16)."""
    ref = blocks(8)
    x, y = batch()
    counts = {}
    for major in (True, False):
        pipe = Pipeline(
            stage_modules=cuts(list(copy.deepcopy(ref)), 2), devices=["cpu", "cpu"], offload_window=1,
            offload_pin=0, offload_chunk_major=major,
        )  # fmt: skip
        before = loads(pipe)
        pipe.step(x, targets=y, loss_fn=F.mse_loss, n_microbatches=4, schedule="gpipe")
        after = loads(pipe)
        pipe.infer(x, n_microbatches=4)
        counts[major] = ([a - b for a, b in zip(after, before)], [c - a for a, c in zip(after, loads(pipe))])
        pipe.close()
    assert counts[True] == ([7, 7], [4, 4])
    assert counts[False][1] == [16, 16] and min(counts[False][0]) >= 4 * 7


def test_1f1b_runs_its_warm_up_forwards_chunk_major():
    """4 stages of 2 chunks, 1F1B, 6 microbatches: stage s's 3-s warm-up forwards are one run (its
    chunks load once for them), every later op microbatch by microbatch: fewer loads on stages
    0-2 than microbatch-major, the same on stage 3 (no warm-up)."""
    x, y = batch(rows=12)
    got = {}
    for major in (True, False):
        pipe = Pipeline(
            stage_modules=cuts(list(blocks(8)), 4), devices=["cpu"] * 4, offload_window=1, offload_pin=0,
            offload_chunk_major=major,
        )  # fmt: skip
        pipe.step(x, targets=y, loss_fn=F.mse_loss, n_microbatches=6)
        got[major] = loads(pipe)
        pipe.close()
    assert all(a < b for a, b in zip(got[True][:3], got[False][:3])) and got[True][3] == got[False][3]


def test_tuple_outputs_and_grad_outputs_chunk_major():
    torch.manual_seed(3)
    ref = Whole(Head(), Tail())
    mine = copy.deepcopy(ref)
    x, y = batch()
    pipe = Pipeline(stage_modules=[[mine.head, mine.tail]], devices=["cpu"], offload_window=1, offload_pin=0)
    reference_grads(ref, x, y, 2, loss_fn=tuple_loss)
    pipe.step(x, targets=y, loss_fn=tuple_loss, n_microbatches=2, schedule="gpipe")
    assert_same(mine, ref)
    g = torch.randn(10, 12)
    pipe.flush_grads()
    ref.zero_grad()
    out = ref(x)[0]
    out.backward(g)
    pipe.step(x, grad_outputs=(g, None), n_microbatches=2, schedule="gpipe")
    for p, q in zip(mine.parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-6, atol=1e-6)  # microbatch sums vs one
    pipe.close()


class AddInPlace(nn.Module):
    def forward(self, x):
        return x.add_(1.0)


def test_an_in_place_first_op_in_a_later_chunk_is_refused_with_a_hint():
    kids = list(blocks(4))
    kids[1] = nn.Linear(12, 12)  # its output is not saved for its backward: adding to it is allowed
    kids[2] = nn.Sequential(AddInPlace(), kids[2])
    pipe = Pipeline(stage_modules=[kids], devices=["cpu"], offload_window=1, offload_pin=0)
    x, y = batch()
    with pytest.raises(RuntimeError, match="chunk 2 of a streamed stage modifies its input in place"):
        pipe.step(x, targets=y, loss_fn=F.mse_loss, n_microbatches=2, schedule="gpipe")
    pipe.close()
    with Pipeline(stage_modules=[kids], devices=["cpu"], offload_chunk_major=False) as slow:
        slow.step(x, targets=y, loss_fn=F.mse_loss, n_microbatches=2, schedule="gpipe")  # RamTorch's order
    for bad in ("yes", 1, None):
        with pytest.raises(TypeError, match="offload_chunk_major must be True, False or 'auto'"):
            Pipeline(stage_modules=[kids], devices=["cpu"], offload_chunk_major=bad)


def test_the_trace_shows_a_run_as_one_span(tmp_path):
    pipe = Pipeline(stage_modules=cuts(list(blocks(4)), 2), devices=["cpu", "cpu"], offload_window=1)
    x, y = batch()
    path = tmp_path / "trace.json"
    pipe.step(x, targets=y, loss_fn=F.mse_loss, n_microbatches=4, schedule="gpipe", trace_path=path)
    names = sorted({e["name"] for e in json.loads(path.read_text())["traceEvents"] if e["ph"] == "X"})
    assert names == ["B mb0-3 c0", "B mb0-3 c1", "F mb0-3 c0", "F mb0-3 c1"]
    pipe.close()


@pytest.mark.cuda
@pytest.mark.parametrize("keep", [True, "checkpoint"])
def test_chunk_major_on_the_gpu_equals_the_unsplit_model(keep):
    """Two streamed stages on cuda:0 (the P2 shape), GPipe: bit-identical to the unsplit model,
    2 loads per chunk per step less one, gradients home once per parameter."""
    ref = blocks(8).cuda()
    mine = copy.deepcopy(ref)
    x, y = (t.cuda() for t in batch())
    reference_grads(ref, x, y, 4)
    kw = dict(offload_window=2, offload_pin=0, offload_keep_activations=keep)
    with Pipeline(stage_modules=cuts(list(mine), 2), devices=["cuda:0", "cuda:0"], **kw) as pipe:
        pipe.step(x, targets=y, loss_fn=F.mse_loss, n_microbatches=4, schedule="gpipe")
        for p, q in zip(mine.parameters(), ref.parameters()):
            assert p.device.type == "cpu" and p.grad.device.type == "cpu"
            assert torch.equal(p.detach(), q.detach().cpu()) and torch.equal(p.grad, q.grad.cpu())
        assert loads(pipe) == [7, 7]
        assert [m.grads.stats["landed"] for m in pipe.modules] == [8, 8]  # 4 chunks x (weight, bias)


def test_1f1b_on_streamed_stages_sharing_a_device_advises_gpipe_once():
    x, y = batch()
    with Pipeline(stage_modules=cuts(list(blocks(4)), 2), devices=["cpu", "cpu"]) as pipe:
        with pytest.warns(UserWarning, match="schedule='gpipe' runs them chunk-major") as seen:
            pipe.step(x, targets=y, loss_fn=F.mse_loss, n_microbatches=4)
        assert "about 2 x 4 times per step" in str(seen[0].message)
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            pipe.step(x, targets=y, loss_fn=F.mse_loss, n_microbatches=4)  # once per Pipeline
    for kw in ({"schedule": "gpipe"}, {"n_microbatches": 1}):
        with Pipeline(stage_modules=cuts(list(blocks(4)), 2), devices=["cpu", "cpu"]) as pipe:
            with warnings.catch_warnings():
                warnings.simplefilter("error")
                pipe.step(x, targets=y, loss_fn=F.mse_loss, **({"n_microbatches": 4} | kw))
    with Pipeline(
        stage_modules=cuts(list(blocks(4)), 2), devices=["cpu", "cpu"], offload_chunk_major=False
    ) as p:
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            p.step(x, targets=y, loss_fn=F.mse_loss, n_microbatches=4)


def test_auto_runs_chunk_major_only_the_stages_that_share_a_device():
    from ramstream.pipeline.chunk_major import grouped_chunks
    from ramstream.pipeline.run import Chunk

    class Streamed:
        pass

    def chunks(devices, streamed=(True,) * 4):
        return [
            Chunk(Streamed() if st else object(), torch.device(d), s, None, None)
            for s, (d, st) in enumerate(zip(devices, streamed))
        ]

    two_gpus = chunks(["cuda:0", "cuda:1"])
    assert grouped_chunks("auto", two_gpus, 1, Streamed) == frozenset()
    assert grouped_chunks(True, two_gpus, 1, Streamed) == {0, 1}
    assert grouped_chunks("auto", chunks(["cuda:0", "cuda:0", "cuda:1"]), 1, Streamed) == {0, 1}
    assert grouped_chunks("auto", chunks(["cuda:1"]), 1, Streamed) == {0}  # one stage
    assert grouped_chunks("auto", chunks(["cpu", "cpu"], (True, False)), 1, Streamed) == {0}
    assert grouped_chunks(True, two_gpus, 2, Streamed) == frozenset()  # interleaved: never
    assert grouped_chunks(False, chunks(["cpu", "cpu"]), 1, Streamed) == frozenset()


def test_batches_cut_runs_of_one_stage_chunk_and_kind():
    from ramstream.pipeline.chunk_major import batches
    from ramstream.pipeline.schedule import Op

    f0, f1, f2 = (Op("F", m, 0) for m in range(3))
    b0, b1 = Op("B", 0, 0), Op("B", 1, 0)
    assert batches([f0, f1, b0, b1, f2], lambda op: True) == [[f0, f1], [b0, b1], [f2]]
    assert batches([f0, f1, b0], lambda op: False) == [[f0], [f1], [b0]]
    g0, g1 = Op("F", 0, 1), Op("F", 1, 1)
    order = [(0, f0), (0, f1), (1, g0), (0, f2), (1, g1)]  # an execution order across stages
    assert batches(order, lambda op: True, pairs=True) == [
        [(0, f0), (0, f1)],
        [(1, g0)],
        [(0, f2)],
        [(1, g1)],
    ]
    assert batches(order, lambda op: op.chunk == 1, pairs=True) == [
        [(0, f0)],
        [(0, f1)],
        [(1, g0)],
        [(0, f2)],
        [(1, g1)],
    ]


class _Twice(nn.Module):
    """A chunk whose Linear runs twice: two uses of one cast weight."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(3)
        self.lin = nn.Linear(WIDTH, WIDTH)

    def forward(self, x):
        return torch.tanh(self.lin(torch.tanh(self.lin(x))))


def _autocast_pipes(device, n_models):
    torch.manual_seed(0)
    ref = nn.Sequential(*blocks(4), _Twice(), nn.LayerNorm(WIDTH)).to(device)
    models = [copy.deepcopy(ref) for _ in range(n_models)]
    kw = dict(devices=[device] * 2, offload_window=2, offload_pin=0, autocast=torch.bfloat16)
    return ref, models, [Pipeline(stage_modules=cuts(list(m), 2), **kw) for m in models]


def _unfused_step(pipe, monkeypatch, *a, **k):
    """pipe.step with autograd's own conversion and accumulation (cast_grads off)."""
    with monkeypatch.context() as mp:
        mp.setattr(chunk_major, "fuse_cast_grads", lambda *_: [])
        return pipe.step(*a, **k)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
def test_autocast_gradients_summed_through_the_cast_are_bit_identical(device, monkeypatch):
    """Under autocast bf16 a chunk-major backward run adds each microbatch's bf16 gradient of a
    cast weight straight into .grad (cast_grads.py): .grad and the weights after AdamW equal
    autograd's own conversion and accumulation bit for bit over 3 steps, and the unsplit model's
    within autocast's tolerance; a weight used twice in its chunk (_Twice) too; the LayerNorm's
    fp32 parameters take autograd's path."""
    ref, (mine, other), (pipe, plain) = _autocast_pipes(device, 2)
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (ref, mine, other)]
    for it in range(3):
        x, y = (t.to(device) for t in batch(seed=it))
        with torch.autocast(device, dtype=torch.bfloat16):
            reference_grads(ref, x, y, 4)
        kw = dict(targets=y, loss_fn=F.mse_loss, n_microbatches=4, schedule="gpipe")
        pipe.step(x, **kw)
        _unfused_step(plain, monkeypatch, x, **kw)
        assert_same(mine, other)
        for p, q in zip(mine.parameters(), ref.parameters()):
            torch.testing.assert_close(p.grad, q.grad.cpu(), atol=2e-3, rtol=0.05)
        for o in opts:
            o.step()
            o.zero_grad()
        assert_same(mine, other)
    # per step: stage 0 holds 3 Linear blocks (6 parameters); stage 1 one more and _Twice's two
    # (its Linear's two uses share one cast, whose node sums them); none of the LayerNorm's (used
    # in fp32, not cast)
    assert [m.fused_casts for m in pipe.modules] == [3 * 6, 3 * 4]
    assert [m.fused_casts for m in plain.modules] == [0, 0]
    for p in (pipe, plain):
        p.close()


def test_a_hooked_parameter_keeps_autograd_s_path(monkeypatch):
    """A tensor hook on a streamed parameter still sees every microbatch's gradient."""
    _, (mine, other), (pipe, plain) = _autocast_pipes("cpu", 2)
    seen = []
    w = mine[0][0].weight
    w.register_hook(lambda g: seen.append(g.dtype))
    x, y = batch()
    kw = dict(targets=y, loss_fn=F.mse_loss, n_microbatches=4, schedule="gpipe")
    pipe.step(x, **kw)
    _unfused_step(plain, monkeypatch, x, **kw)
    assert seen == [torch.float32] * 4
    assert_same(mine, other)
    assert pipe.modules[0].fused_casts == 5  # the hooked weight's left out
    for p in (pipe, plain):
        p.close()
