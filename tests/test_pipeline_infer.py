"""Pipeline's streaming inference on CPU stages (infer_open / infer_submit / infer_loop): results in
order equal to the unsplit model, stages working on different items at once, an item's error at
its handle without a hang (every wait has a timeout), backpressure, close() ending the stage loops."""

from __future__ import annotations

import threading

import pytest
import torch
import torch.nn as nn

from ramstream import Pipeline, PipelineModel
from ramstream.pipeline.streaming import InferHandle

from _pipeline_helpers import CPU2, WIDTH, Head, Tail, Whole, blocks, groups, run_with_timeout

T = 30  # seconds: no wait in these tests is longer


def items(k=7, seed=3):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(1 + i % 3, WIDTH, generator=g) for i in range(k)]


@pytest.mark.parametrize("stages,v", [(1, 1), (2, 1), (4, 1), (2, 2)], ids=["1", "2", "4", "2x2"])
@pytest.mark.parametrize("overlap", [True, False], ids=["threads", "serial"])
def test_results_in_order_equal_the_unsplit_model(stages, v, overlap):
    model = blocks()
    xs = items()
    with torch.no_grad():
        want = [model(x) for x in xs]
    with Pipeline(
        stage_modules=groups(model, stages * v), chunks_per_stage=v, devices=["cpu"] * stages, overlap=overlap
    ) as pipe:
        got = run_with_timeout(lambda: list(pipe.infer_loop(iter(xs), timeout=T)), T)
        assert len(got) == len(xs) and all(torch.equal(a, b) for a, b in zip(got, want))
        with pipe.infer_open() as stream:
            hs = [pipe.infer_submit(x) for x in xs]
            assert pipe.infer_open() is stream and all(isinstance(h, InferHandle) for h in hs)
            assert all(torch.equal(h.result(T), w) for h, w in zip(hs, want))
            assert all(h.done() for h in hs) and not any(p.requires_grad for p in [hs[0].result()])
        assert all(p.grad is None for p in model.parameters())


class Gate(nn.Module):
    """Calls `before(n)` on its n-th call, then tanh."""

    def __init__(self, before) -> None:
        super().__init__()
        self.before, self.calls = before, 0

    def forward(self, x):
        self.calls += 1
        self.before(self.calls)
        return torch.tanh(x)


def test_stages_work_on_different_items_at_once():
    second_started = threading.Event()
    seen = {}

    def first(n):
        if n == 2:
            second_started.set()  # stage 0 starts item 1 ...

    def last(n):
        if n == 1:  # ... while stage 1 still runs item 0 (which waits for it)
            seen["overlap"] = second_started.wait(T)

    pipe = Pipeline(stage_modules=[Gate(first), Gate(last)], devices=CPU2)
    got = run_with_timeout(lambda: list(pipe.infer_loop(items(3), timeout=T)), T)
    assert len(got) == 3 and seen["overlap"] is True
    pipe.close()


def test_an_item_that_fails_raises_at_its_handle_and_the_others_go_on():
    model = blocks(4)

    def fail_third(n):
        if n == 3:
            raise ValueError("boom on item 2")

    xs = items(5)
    with torch.no_grad():
        want = [model[2:](torch.tanh(model[:2](x))) for x in xs]
    with Pipeline(
        stage_modules=[model[:2], nn.Sequential(Gate(fail_third), *model[2:])], devices=CPU2
    ) as pipe:
        stream = pipe.infer_open()
        hs = [stream.submit(x) for x in xs]
        with pytest.raises(ValueError, match="boom on item 2"):
            hs[2].result(T)
        with pytest.raises(ValueError, match="boom on item 2"):
            hs[2].result(T)  # every time it is asked
        assert "failed" in repr(hs[2])
        assert all(torch.equal(hs[i].result(T), want[i]) for i in (0, 1, 3, 4))
        got = list(stream.loop(xs[:2], timeout=T))  # the stream goes on
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
        run_with_timeout(stream.close, T)


def test_a_slow_item_times_out_at_its_handle_and_close_waits_for_it():
    release = threading.Event()
    slow = Gate(lambda n: release.wait(T))
    pipe = Pipeline(stage_modules=[nn.Tanh(), slow], devices=CPU2)
    h = pipe.infer_submit(torch.zeros(1, 2))
    with pytest.raises(TimeoutError, match="item 0"):
        h.result(timeout=0.2)
    with pytest.raises(RuntimeError, match="infer_open"):
        pipe.infer(torch.zeros(4, 2))  # the stream holds the stage threads
    release.set()
    assert torch.equal(h.result(T), torch.tanh(torch.tanh(torch.zeros(1, 2))))
    run_with_timeout(pipe.close, T)


def _threads():
    return {t for t in threading.enumerate() if t.name.startswith("ramstream-pipeline-")}


def test_close_ends_the_stage_loops_and_the_pipeline_trains_again():
    base = _threads()
    model = blocks(4)
    pipe = Pipeline(stage_modules=groups(model, 2), devices=CPU2)
    mine = _threads() - base
    x = torch.randn(4, WIDTH)
    stream = pipe.infer_open()
    stream.submit(x).result(T)
    with pytest.raises(RuntimeError, match="already running"):
        pipe.step(x)
    run_with_timeout(stream.close, T)
    stream.close()  # idempotent
    with pytest.raises(RuntimeError, match="closed"):
        stream.submit(x)
    pipe.step(x, n_microbatches=2)  # the threads serve steps again
    assert all(p.grad is not None for p in model.parameters())
    for _ in pipe.infer_loop([x] * 5, timeout=T):
        break  # leaving the loop closes the stream it opened
    pipe.step(x, n_microbatches=2)
    pipe.infer_submit(x)  # opens a stream that close() ends
    run_with_timeout(pipe.close, T)
    for t in mine:
        t.join(T)
        assert not t.is_alive()


def test_backpressure_tuple_outputs_and_bad_arguments():
    pulled, yielded = [0], [0]

    def source():
        for x in items(9):
            pulled[0] += 1
            assert pulled[0] - yielded[0] <= 3  # at most max_in_flight submitted ahead
            yield x

    torch.manual_seed(0)
    whole = Whole(Head(), Tail())
    with Pipeline(stage_modules=[whole.head, whole.tail], devices=CPU2) as pipe:
        for out in pipe.infer_loop(source(), max_in_flight=3, timeout=T):
            yielded[0] += 1
            assert isinstance(out, tuple) and out[1].dtype == torch.long
        assert yielded[0] == 9
        x = items(1)[0]
        with torch.no_grad():
            want = whole(x)
        got = pipe.infer_submit(x).result(T)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
        with pytest.raises(TypeError, match="tensor or a tuple"):
            pipe.infer_submit([x])
        with pytest.raises(ValueError, match="max_in_flight"):
            next(pipe.infer_loop([x], max_in_flight=0))
        for bad in (-1, "1", float("nan"), True):
            with pytest.raises(ValueError, match="timeout must be None or a number of seconds"):
                next(pipe.infer_loop([x], timeout=bad))
        h = pipe.infer_submit(x)
        with pytest.raises(ValueError, match="InferHandle.result: timeout"):
            h.result(timeout=-0.5)
        assert torch.equal(h.result(T)[0], want[0])  # a refused wait leaves the item to finish


def test_pipeline_model_streams_its_stages():
    model = blocks(4)
    xs = items(5)
    with torch.no_grad():
        want = [model(x) for x in xs]
    with PipelineModel(model, xs[0], devices=CPU2, warn_on_padding=False) as pm:
        got = run_with_timeout(lambda: list(pm.infer_loop(xs, timeout=T)), T)
        assert all(torch.equal(a, b) for a, b in zip(got, want))
        assert torch.equal(pm.infer_submit(xs[1]).result(T), want[1])  # one item, not padded
        assert pm.infer_open() is pm.pipeline.infer_open()
        pm.pipeline.infer_open().close()


def test_streamed_stages_stream_too():
    model = blocks(6)
    xs = items(4)
    with torch.no_grad():
        want = [model(x) for x in xs]
    with Pipeline(chunk_modules=list(model), devices=CPU2, offload_window=2) as pipe:
        got = run_with_timeout(lambda: list(pipe.infer_loop(xs, timeout=T)), T)
        assert all(torch.equal(a, b) for a, b in zip(got, want))
        pipe.step(xs[0], n_microbatches=1)  # the stream closed: the stages train again


@pytest.mark.cuda
def test_streaming_on_one_gpu_equals_the_model():
    model = blocks().cuda()
    xs = [x.cuda() for x in items()]
    with torch.no_grad():
        want = [model(x) for x in xs]
    with Pipeline(stage_modules=groups(model, 2), devices=["cuda:0", "cuda:0"]) as pipe:
        got = run_with_timeout(lambda: list(pipe.infer_loop(xs, timeout=T)), T)
        assert all(torch.equal(a, b) for a, b in zip(got, want))
