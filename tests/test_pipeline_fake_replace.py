"""Pipeline(fake_compute="replace"): the ops skip their kernels. Every stage's output is zeros of
the shape, dtype and device a real run gives (shape-changing stages: embedding -> blocks -> head,
tuple outputs, autocast), found without running the kernels and cached per input signature; the
weights, buffers, `.grad` and an optimizer's state stay bit-identical; with sleeps the step's wall
time is the schedule simulator's makespan; real-kernel paths are refused."""

from __future__ import annotations

import copy
import json
import time

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import ramstream.pipeline.fake as fake_mod
from ramstream import Pipeline, PipelineModel
from ramstream.simulate.pipeline import simulate_schedule

from _pipeline_helpers import CPU2, Head, Tail, batch, blocks, groups, tuple_loss

VOCAB, DIM, SEQ = 50, 8, 5


class Embed(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, DIM)

    def forward(self, ids):
        return self.emb(ids)


def lm(seed=0):
    """[ids (B, SEQ) long] -> embedding (B, SEQ, DIM) -> blocks (B, SEQ, 2*DIM) with a BatchNorm
    (buffers a real forward updates) -> head (B, SEQ, VOCAB)."""
    torch.manual_seed(seed)
    mid = nn.Sequential(nn.Linear(DIM, 2 * DIM), nn.BatchNorm1d(SEQ), nn.GELU())
    return [Embed(), mid, nn.Linear(2 * DIM, VOCAB)]


def tokens(rows=8, seed=1):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (rows, SEQ), generator=g)
    return ids, torch.randint(0, VOCAB, (rows, SEQ), generator=g)


def ce(out, y):
    return F.cross_entropy(out.reshape(-1, VOCAB), y.reshape(-1))


def snapshot(mods) -> list:
    """Every parameter, buffer and .grad of `mods`, cloned."""
    out = []
    for m in mods:
        for t in list(m.parameters()) + list(m.buffers()):
            out.append((t.detach().clone(), None if getattr(t, "grad", None) is None else t.grad.clone()))
    return out


def assert_unchanged(mods, before) -> None:
    now = [t for m in mods for t in list(m.parameters()) + list(m.buffers())]
    assert len(now) == len(before)
    for t, (v, g) in zip(now, before):
        assert t.dtype == v.dtype and torch.equal(t.detach(), v)
        assert (t.grad is None) == (g is None)
        if g is not None:
            assert torch.equal(t.grad, g)


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_outputs_have_the_real_runs_shapes_through_shape_changing_stages(schedule):
    real = Pipeline(stage_modules=lm(), devices=["cpu"] * 3)
    mods = lm()
    pipe = Pipeline(stage_modules=mods, devices=["cpu"] * 3, fake_compute="replace")
    ids, y = tokens(10)
    r_real = real.step(ids, targets=y, loss_fn=ce, n_microbatches=4, schedule=schedule)
    r = pipe.step(ids, targets=y, loss_fn=ce, n_microbatches=4, schedule=schedule)
    assert [o.shape for o in r.outputs] == [o.shape for o in r_real.outputs]  # 3, 3, 2, 2 rows
    assert r.output.shape == r_real.output.shape == (10, SEQ, VOCAB)
    assert r.output.dtype == r_real.output.dtype and not r.output.any()
    assert len(r.losses) == 4 and all(x.shape == () and x.item() == 0.0 for x in r.losses)
    assert r.loss.item() == 0.0 and r_real.loss.item() > 0  # the real loss is not computed
    with torch.no_grad():
        out, want = pipe.infer(ids, n_microbatches=3), real.infer(ids, n_microbatches=3)
    assert out.shape == want.shape and out.dtype == want.dtype and not out.any()
    real.close()
    pipe.close()


def test_tuple_outputs_and_input_gradients_have_the_real_shapes(monkeypatch):
    head, tail = Head(), Tail()
    real = Pipeline(stage_modules=[copy.deepcopy(head), copy.deepcopy(tail)], devices=CPU2)
    pipe = Pipeline(stage_modules=[head, tail], devices=CPU2, fake_compute="replace")
    sent = []
    real_send = fake_mod.FakeCompute.input_grads

    def record(args):
        grads = real_send(args)
        sent.append(grads)
        return grads

    monkeypatch.setattr(fake_mod.FakeCompute, "input_grads", staticmethod(record))
    x, y = batch(8)
    r_real = real.step(x, targets=y, loss_fn=tuple_loss, n_microbatches=2)
    r = pipe.step(x, targets=y, loss_fn=tuple_loss, n_microbatches=2)
    for got, want in zip(r.output, r_real.output):  # (out, ids): a float and a long tensor
        assert got.shape == want.shape and got.dtype == want.dtype and not got.any()
    # stage 1 hands back one gradient per input: zeros for h and aux (they require grad), None for ids
    assert len(sent) == 2
    for grads in sent:
        h, aux, ids = grads
        assert h.shape == (4, 12) and aux.shape == (4, 3) and ids is None
        assert not h.any() and not aux.any()
    real.close()
    pipe.close()


def test_autocast_gives_the_real_dtypes():
    real = Pipeline(stage_modules=lm(), devices=["cpu"] * 3, autocast="bf16")
    pipe = Pipeline(stage_modules=lm(), devices=["cpu"] * 3, autocast="bf16", fake_compute="replace")
    ids, y = tokens(8)
    want = real.step(ids, targets=y, loss_fn=ce, n_microbatches=2).output
    got = pipe.step(ids, targets=y, loss_fn=ce, n_microbatches=2).output
    assert want.dtype == torch.bfloat16 and got.dtype == want.dtype and got.shape == want.shape
    real.close()
    pipe.close()


def test_weights_buffers_grads_and_an_optimizer_stay_bit_identical():
    mods = lm()
    pipe = Pipeline(stage_modules=mods, devices=["cpu"] * 3, fake_compute={"fwd": 0.001, "replace": True})
    opt = torch.optim.AdamW(pipe.parameters(), lr=0.1)
    ids, y = tokens(8)
    before = snapshot(mods)
    pipe.step(ids, targets=y, loss_fn=ce, n_microbatches=4)
    opt.step()  # no .grad anywhere: the optimizer has nothing to do
    assert_unchanged(mods, before)  # BatchNorm's running stats and counter too
    assert not opt.state
    for p in pipe.parameters():  # gradients left by earlier work (a real pipeline's steps)
        p.grad = torch.randn_like(p)
    pipe.flush_grads(0.5)
    before = snapshot(mods)
    pipe.step(ids, targets=y, loss_fn=ce, n_microbatches=4)
    assert_unchanged(mods, before)  # .grad kept (a real step after a flush would replace it)
    pipe.flush_grads(0.5)  # still flushed: the replaced step started no new sum, so no rescale
    assert_unchanged(mods, before)
    pipe.close()


def test_streamed_stages_are_replaced_without_loading_a_weight():
    ref = blocks(6)
    kids = list(ref)
    stage0 = [nn.Sequential(nn.Linear(12, 20), nn.Tanh()), nn.Linear(20, 7)]  # 12 -> 20 -> 7
    stage1 = [nn.Linear(7, 12), *kids[:2], nn.Linear(12, 5)]  # 7 -> 12 -> 5
    real = Pipeline(stage_modules=copy.deepcopy([stage0, stage1]), devices=CPU2)
    pipe = Pipeline(stage_modules=[stage0, stage1], devices=CPU2, fake_compute="replace")
    mods = stage0 + stage1
    x, y = batch(8)
    before = snapshot(mods)
    with torch.no_grad():
        want, out = real.infer(x, n_microbatches=2), pipe.infer(x, n_microbatches=2)
    assert want.shape == out.shape == (8, 5)
    r = pipe.step(x, grad_outputs=torch.ones(8, 5), n_microbatches=2)
    assert r.output.shape == (8, 5) and r.losses == []
    assert_unchanged(mods, before)
    for st in pipe.modules:
        assert st.streamer.stats["loads"] == 0 and st.streamer.stats["bytes_h2d"] == 0
    real.close()
    pipe.close()


def test_stages_that_do_not_fit_fail_as_a_real_step_would():
    """RamTorch's stand-in mirrors the input's shape and never notices; here the shapes are
    propagated, so a stage that cannot take its input fails the step, naming the chunk."""
    mods = [nn.Linear(12, 7), nn.Linear(12, 3)]
    pipe = Pipeline(stage_modules=mods, devices=CPU2, fake_compute="replace")
    x, y = batch(8)
    with pytest.raises(RuntimeError, match=r"chunk 1's output shape.*\[4, 7\] X \[12, 3\]"):
        pipe.step(x, targets=y, loss_fn=F.mse_loss, n_microbatches=2)
    pipe.close()


def test_shapes_are_traced_once_per_input_signature(monkeypatch):
    calls = []
    real_trace = fake_mod.FakeCompute._trace

    def counting(self, c, module, args, device):
        calls.append((c, tuple(args[0].shape)))
        return real_trace(self, c, module, args, device)

    monkeypatch.setattr(fake_mod.FakeCompute, "_trace", counting)
    pipe = Pipeline(stage_modules=lm(), devices=["cpu"] * 3, fake_compute="replace")
    ids, y = tokens(8)
    for _ in range(2):
        pipe.step(ids, targets=y, loss_fn=ce, n_microbatches=4)
    assert sorted(c for c, _ in calls) == [0, 1, 2]  # 8 forwards per chunk, one trace each
    with torch.no_grad():
        pipe.infer(ids, n_microbatches=4)  # no grad mode: another signature
    pipe.step(ids[:6], targets=y[:6], loss_fn=ce, n_microbatches=2)  # 3 rows: another shape
    assert len(calls) == 9 and calls[-1] == (2, (3, SEQ, 2 * DIM))
    pipe.close()


@pytest.mark.parametrize("schedule,v", [("gpipe", 1), ("1f1b", 1), ("interleaved", 2)])
def test_with_sleeps_the_step_takes_the_simulated_makespan(tmp_path, schedule, v):
    tf, tb = [0.02, 0.04], [0.04, 0.06]  # per stage, split over its v chunks
    pipe = Pipeline(
        stage_modules=groups(blocks(8), 2 * v),
        chunks_per_stage=v,
        devices=CPU2,
        fake_compute={"fwd": tf, "bwd": tb, "replace": True},
    )
    x, y = batch(8)
    step = dict(targets=y, loss_fn=F.mse_loss, n_microbatches=4, schedule=schedule)
    pipe.step(x, **step)  # the shapes get traced (once)
    t0 = time.perf_counter()
    pipe.step(x, **step, trace_path=tmp_path / "t.json")
    wall = time.perf_counter() - t0
    per_chunk = lambda t: [t[c % 2] / v for c in range(2 * v)]  # noqa: E731
    sim = simulate_schedule(
        schedule, stages=2, microbatches=4, chunks_per_stage=v, tf=per_chunk(tf), tb=per_chunk(tb)
    )
    serial = 4 * (sum(tf) + sum(tb))
    assert sim.makespan < serial
    assert sim.makespan <= wall < sim.makespan + 0.25 * (serial - sim.makespan)  # the bubbles show
    spans = [e for e in json.loads((tmp_path / "t.json").read_text())["traceEvents"] if e["ph"] == "X"]
    assert len(spans) == 2 * 2 * 4 * v  # every op of every stage traced
    for s in range(2):  # a stage's ops end no earlier than the simulator's (sleeps after arrivals)
        ends = sorted(e["ts"] + e["dur"] for e in spans if e["tid"] == s + 1)
        want = sorted(o.end for o in sim.spans if o.stage == s)
        assert all(a / 1e6 >= b - 1e-3 for a, b in zip(ends, want))
    pipe.close()


def test_pipeline_model_replaces_too():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(VOCAB, DIM), nn.Linear(DIM, 16), nn.Linear(16, VOCAB))
    before = snapshot([model])
    pm = PipelineModel(model, torch.zeros(3, SEQ, dtype=torch.long), devices=CPU2, fake_compute="replace")
    ids, y = tokens(7)
    with pytest.warns(Warning, match="padded"):
        out = pm(ids)  # 7 rows in microbatches of 3: padded, the padding dropped
    assert out.shape == (7, SEQ, VOCAB) and not out.any()
    assert pm.step(ids, targets=y, loss_fn=ce, n_microbatches=2).output.shape == (7, SEQ, VOCAB)
    assert_unchanged([model], before)
    pm.close()


class ItemStage(nn.Module):
    def forward(self, x):
        return x[: int(x.sum().item() > 0) + 1]  # a data-dependent shape


def test_a_forward_that_needs_real_values_fails_the_step_naming_the_chunk():
    mods = [nn.Linear(12, 12), ItemStage()]
    pipe = Pipeline(stage_modules=mods, devices=CPU2, fake_compute="replace")
    before = snapshot(mods)
    x, y = batch(8)
    with pytest.raises(RuntimeError, match=r"chunk 1's output shape could not be found"):
        pipe.step(x, targets=y, loss_fn=F.mse_loss, n_microbatches=2)
    assert_unchanged(mods, before)
    pipe.close()


def test_real_kernel_paths_are_refused():
    pipe = Pipeline(stage_modules=groups(blocks(4), 2), devices=CPU2, fake_compute="replace")
    with pytest.raises(NotImplementedError, match=r"infer_open\(\).*fake_compute replace"):
        pipe.infer_submit(torch.zeros(2, 12))
    with pytest.raises(NotImplementedError, match=r"train_session\(\).*fake_compute replace"):
        pipe.train_session(optimizer_factory=lambda ps: torch.optim.SGD(ps, lr=0.1), loss_fn=F.mse_loss)
    x, _ = batch(4)
    assert pipe.infer(x, n_microbatches=2).shape == x.shape  # the pipeline still works
    pipe.close()


@pytest.mark.parametrize(
    "value,match",
    [
        ("Replace", r"fake_compute='Replace' is not accepted; accepted: None, 'replace'"),
        ("sleep", "is not accepted"),
        ({"replace": "yes"}, r"fake_compute\['replace'\] must be True or False, got 'yes'"),
        ({"fwd": 0.1, "replace": 1}, r"fake_compute\['replace'\] must be True or False, got 1"),
        ({"replace": True, "mode": "x"}, "is not accepted"),
        (["replace"], "is not accepted"),
    ],
)
def test_bad_values_are_named(value, match):
    with pytest.raises(ValueError, match=match):
        Pipeline(stage_modules=groups(blocks(4), 2), devices=CPU2, fake_compute=value)
    with pytest.raises(ValueError, match=match):
        PipelineModel(blocks(4), devices=CPU2, fake_compute=value)


@pytest.mark.cuda
def test_cuda_stages_get_the_real_shapes_and_keep_their_weights():
    real = Pipeline(stage_modules=lm(), devices=["cuda:0"] * 3)
    mods = lm()
    pipe = Pipeline(stage_modules=mods, devices=["cuda:0"] * 3, fake_compute="replace")
    streamed = Pipeline(
        stage_modules=[[Embed(), *lm()[1:]]], devices=["cuda:0"], fake_compute={"replace": True}
    )
    ids, y = (t.cuda() for t in tokens(8))
    before = snapshot(mods)
    want = real.step(ids, targets=y, loss_fn=ce, n_microbatches=4).output
    got = pipe.step(ids, targets=y, loss_fn=ce, n_microbatches=4)
    assert got.output.shape == want.shape and got.output.device == want.device
    assert got.loss.is_cuda and got.loss.item() == 0.0
    assert_unchanged(mods, before)
    with torch.no_grad():
        out = streamed.infer(ids, n_microbatches=2)
    assert out.shape == want.shape and out.is_cuda
    assert streamed.modules[0].streamer.stats["bytes_h2d"] == 0
    for p in (real, pipe, streamed):
        p.close()
