"""ramstream.Pipeline on CPU stages: bit-identical to training the unsplit model (every schedule,
1/2/4 stages, interleaved chunks), frozen parameters, tuple outputs, grad_outputs, autocast,
flush_grads' one meaning, persistent threads, and failures that change nothing and never hang."""

from __future__ import annotations

import copy
import gc
import json
import threading

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import ramstream
from ramstream import Pipeline

WIDTH = 12
CPU2 = ["cpu", "cpu"]


def blocks(n=8, seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(*[nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Tanh()) for _ in range(n)])


def groups(model, k):
    """The model's blocks cut into k consecutive nn.Sequential pieces (sharing the modules)."""
    kids = list(model)
    per = len(kids) // k
    return [nn.Sequential(*kids[i * per : (i + 1) * per]) for i in range(k)]


def batch(rows=10, seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(rows, WIDTH, generator=g), torch.randn(rows, WIDTH, generator=g)


def reference_grads(model, x, y, n, loss_fn=F.mse_loss):
    """The unsplit model over the same microbatches, loss/n backward in microbatch order."""
    losses = []
    for xm, ym in zip(x.tensor_split(n), y.tensor_split(n)):
        loss = loss_fn(model(xm), ym)
        (loss / n).backward()
        losses.append(loss.detach())
    return losses


def assert_same(a, b):
    for (name, p), q in zip(a.named_parameters(), b.parameters()):
        assert torch.equal(p, q), name
        assert (p.grad is None) == (q.grad is None), name
        if p.grad is not None:
            assert torch.equal(p.grad, q.grad), name


def run_with_timeout(fn, seconds=60):
    """fn() on a thread; fails the test (instead of hanging) if it has not returned in time."""
    box = {}

    def target():
        try:
            box["value"] = fn()
        except BaseException as e:  # noqa: BLE001 - handed to the test
            box["error"] = e

    t = threading.Thread(target=target, daemon=True)
    t.start()
    t.join(seconds)
    assert not t.is_alive(), f"hung for {seconds} s"
    if "error" in box:
        raise box["error"]
    return box.get("value")


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


class Head(nn.Module):
    """Returns (h, aux, ids): aux requires grad and is used later, ids is an int tensor."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(WIDTH, WIDTH), nn.Linear(WIDTH, 3)

    def forward(self, x):
        h = torch.tanh(self.a(x))
        return h, self.b(h), (x[:, 0] > 0).long()


class Tail(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.c = nn.Linear(WIDTH, WIDTH)

    def forward(self, h, aux, ids):
        out = self.c(h) * aux.sum(1, keepdim=True) + ids.unsqueeze(1)
        return out, ids  # a tuple output with an element that needs no gradient


class Whole(nn.Module):
    def __init__(self, head, tail) -> None:
        super().__init__()
        self.head, self.tail = head, tail

    def forward(self, x):
        return self.tail(*self.head(x))


def tuple_loss(out, y):
    return F.mse_loss(out[0], y)


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


class Boom(nn.Module):
    """Tanh that raises in forward (when armed for a microbatch count) or in backward."""

    def __init__(self) -> None:
        super().__init__()
        self.forward_at = None
        self.backward_armed = False
        self.calls = 0

    def forward(self, x):
        self.calls += 1
        if self.forward_at is not None and self.calls == self.forward_at:
            raise RuntimeError("boom in forward")
        return _Fail.apply(x, self) if self.backward_armed else torch.tanh(x)


class _Fail(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, mod):
        return torch.tanh(x)

    @staticmethod
    def backward(ctx, g):
        raise RuntimeError("boom in backward")


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


def test_chunk_modules_dice_and_paged_activations_are_issue_28():
    model = blocks(5)
    with Pipeline(chunk_modules=list(model), devices=["cpu", "cpu"], offload=False) as pipe:
        assert [len(m.parts) for m in pipe.modules] == [3, 2]  # the earlier stage takes the remainder
    with Pipeline(
        chunk_modules=list(model), chunks_per_stage=[1, 4], offload=False, devices=["cpu", "cpu"]
    ) as pipe:
        assert [len(m.parts) for m in pipe.modules] == [1, 4]
    with pytest.raises(NotImplementedError, match="issue 28"):
        Pipeline(chunk_modules=list(model), devices=["cpu", "cpu"], offload_activations=True)


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


def test_exported_from_ramstream():
    for name in ("Pipeline", "PipelineModel", "PipelinePaddingWarning"):
        assert name in ramstream.__all__ and getattr(ramstream, name) is not None
    assert issubclass(ramstream.PipelinePaddingWarning, UserWarning)


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


@pytest.mark.parametrize("overlap", [True, False], ids=["threads", "serial"])
def test_infer_on_interleaved_chunks(overlap):
    model = blocks()
    with Pipeline(stage_modules=groups(model, 8), chunks_per_stage=4, devices=CPU2, overlap=overlap) as pipe:
        x, _ = batch(9)
        with torch.no_grad():
            want = torch.cat([model(p) for p in x.tensor_split(5)])
        assert torch.equal(run_with_timeout(lambda: pipe.infer(x, n_microbatches=5)), want)


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


def test_an_in_place_op_on_a_stage_input_is_explained():
    model = blocks(2)
    with Pipeline(
        stage_modules=[model[0], nn.Sequential(nn.ReLU(inplace=True), model[1])], devices=CPU2
    ) as pipe:
        x, y = batch()
        with pytest.raises(RuntimeError, match="modifies its input in place"):
            run_with_timeout(lambda: pipe.step(x, targets=y, loss_fn=F.mse_loss, n_microbatches=2))
        assert all(p.grad is None for p in model.parameters())
