"""Pipeline.step()/infer() on pre-split microbatches (a tuple/list of tuples of tensors), CPU stages:
bit-identical to the same step on one batch cut the same way and to the unsplit model run over the
same microbatches, every schedule, streamed and resident stages, uneven sizes, tuple arguments,
targets and grad_outputs per microbatch, PipelineModel, and the errors of malformed inputs."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from ramstream import Pipeline, PipelineModel

from _pipeline_helpers import CPU2, WIDTH, assert_same, batch, blocks, groups

# (schedule, stages, chunks per stage, streamed)
CASES = [
    ("gpipe", 2, 1, False),
    ("1f1b", 2, 1, False),
    ("1f1b", 4, 1, False),
    ("interleaved", 2, 2, False),
    ("gpipe", 2, 1, True),
    ("1f1b", 2, 1, True),
    ("interleaved", 2, 2, True),
]


def _pipe(model, stages, v, streamed):
    if streamed:  # every piece a list of chunks: streamed through the weight streamer
        kids = list(model)
        per = len(kids) // (stages * v)
        pieces = [kids[i * per : (i + 1) * per] for i in range(stages * v)]
    else:
        pieces = groups(model, stages * v)
    return Pipeline(stage_modules=pieces, chunks_per_stage=v, devices=["cpu"] * stages, offload=streamed)


def _reference(model, xs, ys):
    """torch on the unsplit model: loss / m backward per microbatch, in order."""
    losses = []
    for xm, ym in zip(xs, ys):
        loss = F.mse_loss(model(xm), ym)
        (loss / len(xs)).backward()
        losses.append(loss.detach())
    return losses


@pytest.mark.parametrize(
    "schedule,stages,v,streamed",
    CASES,
    ids=[f"{c[0]}-{c[1]}x{c[2]}-{'streamed' if c[3] else 'resident'}" for c in CASES],
)
def test_presplit_step_equals_the_cut_batch_and_torch(schedule, stages, v, streamed):
    ref = blocks()
    flat, pre = copy.deepcopy(ref), copy.deepcopy(ref)
    pf, pp = _pipe(flat, stages, v, streamed), _pipe(pre, stages, v, streamed)
    try:
        for it in range(2):
            x, y = batch(seed=it)  # 10 rows: 3, 3, 2, 2
            xs, ys = x.tensor_split(4), y.tensor_split(4)
            rf = pf.step(x, targets=y, loss_fn=F.mse_loss, n_microbatches=4, schedule=schedule)
            rp = pp.step([(xm,) for xm in xs], targets=list(ys), loss_fn=F.mse_loss, schedule=schedule)
            want = _reference(ref, xs, ys)
            assert len(rp.losses) == 4
            for a, b, c in zip(rp.losses, rf.losses, want):
                assert torch.equal(a, b) and torch.equal(a, c)
            assert torch.equal(rp.output, rf.output)
            assert_same(pre, flat)
            assert_same(pre, ref)
            for m in (ref, flat, pre):  # an update, then the next step on new weights
                torch.optim.SGD(m.parameters(), lr=0.1).step()
                m.zero_grad(set_to_none=True)
    finally:
        pf.close()
        pp.close()


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_equal_presplit_microbatches_give_torchs_full_batch_gradients(schedule):
    ref = blocks()
    mine = copy.deepcopy(ref)
    x, y = batch(rows=12)
    F.mse_loss(ref(x), y).backward()
    with Pipeline(stage_modules=groups(mine, 2), devices=CPU2) as pipe:
        res = pipe.step(tuple((xm,) for xm in x.split(3)), targets=y, loss_fn=F.mse_loss, schedule=schedule)
    assert torch.allclose(res.loss, F.mse_loss(ref(x), y), rtol=1e-6, atol=1e-7)
    for p, q in zip(mine.parameters(), ref.parameters()):
        assert torch.allclose(p.grad, q.grad, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("as_list", [True, False], ids=["targets-per-microbatch", "targets-one-tensor"])
def test_uneven_presplit_microbatches(as_list):
    ref = blocks()
    mine = copy.deepcopy(ref)
    x, y = batch(rows=12)
    sizes = [2, 5, 1, 4]  # not what tensor_split would make
    xs, ys = x.split(sizes), y.split(sizes)
    want = _reference(ref, xs, ys)
    with Pipeline(stage_modules=groups(mine, 2), devices=CPU2) as pipe:
        res = pipe.step([(xm,) for xm in xs], targets=list(ys) if as_list else y, loss_fn=F.mse_loss)
    assert [o.shape[0] for o in res.outputs] == sizes
    assert all(torch.equal(a, b) for a, b in zip(res.losses, want))
    assert_same(mine, ref)


class TwoArgs(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(WIDTH, WIDTH), nn.Linear(WIDTH, WIDTH)

    def forward(self, u, w):
        return torch.tanh(self.a(u) + self.b(w))


def test_tuple_argument_microbatches():
    torch.manual_seed(3)
    ref = nn.ModuleList([TwoArgs(), blocks(2)])
    flat, pre = copy.deepcopy(ref), copy.deepcopy(ref)
    u, y = batch(rows=9, seed=4)
    w, _ = batch(rows=9, seed=5)
    us, ws, ys = u.split([4, 3, 2]), w.split([4, 3, 2]), y.split([4, 3, 2])
    for xm_u, xm_w, ym in zip(us, ws, ys):
        (F.mse_loss(ref[1](ref[0](xm_u, xm_w)), ym) / 3).backward()
    with Pipeline(stage_modules=list(pre), devices=CPU2) as pipe:
        res = pipe.step(tuple(zip(us, ws)), targets=list(ys), loss_fn=F.mse_loss, n_microbatches=3)
    assert len(res.losses) == 3
    assert_same(pre, ref)
    # the same microbatches as one flat (u, w) batch cut by tensor_split (3, 3, 3): a different cut
    with Pipeline(stage_modules=list(flat), devices=CPU2) as pipe:
        pipe.step((u, w), targets=y, loss_fn=F.mse_loss, n_microbatches=3)
    assert not all(torch.equal(p.grad, q.grad) for p, q in zip(flat.parameters(), pre.parameters()))


def test_presplit_grad_outputs_per_microbatch():
    ref = blocks()
    a, b = copy.deepcopy(ref), copy.deepcopy(ref)
    x, _ = batch(rows=10)
    g = torch.randn(10, WIDTH, generator=torch.Generator().manual_seed(7))
    with Pipeline(stage_modules=groups(a, 2), devices=CPU2) as pipe:
        pipe.step(x, grad_outputs=g, n_microbatches=4)
    with Pipeline(stage_modules=groups(b, 2), devices=CPU2) as pipe:
        pipe.step([(xm,) for xm in x.tensor_split(4)], grad_outputs=list(g.tensor_split(4)))
    assert_same(a, b)


@pytest.mark.parametrize("streamed", [False, True], ids=["resident", "streamed"])
def test_presplit_infer_returns_outputs_per_microbatch(streamed):
    ref = blocks()
    x, _ = batch(rows=11)
    xs = x.split([5, 1, 3, 2])
    with _pipe(copy.deepcopy(ref), 2, 1, streamed) as pipe:
        out = pipe.infer([(xm,) for xm in xs])
        flat = pipe.infer(x, n_microbatches=4)
        same_cut = pipe.infer([(xm,) for xm in x.tensor_split(4)])
    assert isinstance(out, tuple) and len(out) == 4
    with torch.no_grad():
        for o, xm in zip(out, xs):
            assert torch.equal(o, ref(xm))
    assert torch.equal(flat, torch.cat(same_cut))


def test_pipeline_model_takes_presplit_microbatches():
    ref = blocks(4)
    a, b = copy.deepcopy(ref), copy.deepcopy(ref)
    x, y = batch(rows=8)
    with PipelineModel(a, x[:2], devices=CPU2) as pm:
        pm.step(x, targets=y, loss_fn=F.mse_loss, n_microbatches=4)
    with PipelineModel(b, x[:2], devices=CPU2) as pm:
        pm.step([(xm,) for xm in x.split(2)], targets=y, loss_fn=F.mse_loss)
        out = pm.infer([(xm,) for xm in x.split(2)])
    assert_same(a, b)
    with torch.no_grad():
        assert all(torch.equal(o, b(xm)) for o, xm in zip(out, x.split(2)))


X = torch.randn(6, WIDTH)
BAD_DATA = [
    ((X, (X,)), ValueError, "mixes microbatches"),
    (((X[:3],), 3), ValueError, "mixes microbatches"),
    (((X[:3],), ()), ValueError, r"data\[1\] is an empty microbatch"),
    (((X[:3],), (3,)), TypeError, r"data\[1\]\[0\] must be a tensor"),
    (((X[:3],), (X[3:], X[3:])), ValueError, r"data\[1\] has 2 tensors, data\[0\] has 1"),
    (((X[:3], X[:2]), (X[3:], X[3:])), ValueError, "different rows"),
    (((X[:0],), (X,)), ValueError, "at least one row"),
    (((torch.tensor(1.0),), (X,)), ValueError, "at least one row"),
    ((X[:3], X[3:5]), ValueError, "tuple of tuples"),  # a flat tuple: one batch, rows must agree
]


@pytest.mark.parametrize("data,exc,match", BAD_DATA, ids=[f"bad{i}" for i in range(len(BAD_DATA))])
@pytest.mark.parametrize("call", ["step", "infer"])
def test_malformed_data_raises_and_changes_nothing(data, exc, match, call):
    model = blocks(2)
    with Pipeline(stage_modules=groups(model, 2), devices=CPU2) as pipe:
        with pytest.raises(exc, match=match):
            pipe.step(data, n_microbatches=2) if call == "step" else pipe.infer(data, n_microbatches=2)
        assert all(p.grad is None for p in model.parameters())
        assert pipe.step([(X[:3],), (X[3:],)]).loss is not None  # the pipeline goes on


BAD_TARGETS = [
    ([X[:2]], ValueError, "1 entries for 2 pre-split microbatches"),
    ([X[:2], X[2:]], ValueError, r"targets\[0\] has shape \(2, 12\), its microbatch has 3 rows"),
    (X[:5], ValueError, r"6 rows in dim 0 \(3\+3\)"),
    ([X[:3], "y"], TypeError, r"targets\[1\] must be a tensor"),
    ({"y": X}, TypeError, "one entry per microbatch"),
]


@pytest.mark.parametrize("targets,exc,match", BAD_TARGETS, ids=[f"bad{i}" for i in range(len(BAD_TARGETS))])
def test_bad_targets_for_presplit_data(targets, exc, match):
    with Pipeline(stage_modules=groups(blocks(2), 2), devices=CPU2) as pipe:
        with pytest.raises(exc, match=match):
            pipe.step([(X[:3],), (X[3:],)], targets=targets, loss_fn=F.mse_loss)


@pytest.mark.parametrize("n", [1, 3, 4])
def test_n_microbatches_must_match_the_presplit_count(n):
    with Pipeline(stage_modules=groups(blocks(2), 2), devices=CPU2) as pipe:
        with pytest.raises(ValueError, match=rf"n_microbatches={n} but data holds 2 pre-split microbatches"):
            pipe.step([(X[:3],), (X[3:],)], n_microbatches=n)
        with pytest.raises(ValueError, match=rf"n_microbatches={n} but data holds 2"):
            pipe.infer([(X[:3],), (X[3:],)], n_microbatches=n)
        with pytest.raises(ValueError, match="n_microbatches must be an int >= 1"):
            pipe.step([(X[:3],), (X[3:],)], n_microbatches=0)
        assert len(pipe.step([(X[:3],), (X[3:],)], n_microbatches=2).losses) == 2


def test_default_n_microbatches_is_still_four_for_one_batch():
    with Pipeline(stage_modules=groups(blocks(2), 2), devices=CPU2) as pipe:
        assert len(pipe.step(X).losses) == 4


def test_train_session_refuses_presplit_data():
    with Pipeline(stage_modules=groups(blocks(2), 2), devices=CPU2, offload=False) as pipe:
        with pipe.train_session(
            optimizer_factory=lambda ps: torch.optim.SGD(ps, lr=0.1), n_microbatches=2, loss_fn=F.mse_loss
        ) as trainer:
            with pytest.raises(ValueError, match="accepted by step\\(\\) and infer\\(\\) only"):
                trainer.run([([(X[:3],), (X[3:],)], X)], updates=1)
