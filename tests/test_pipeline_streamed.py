"""ramstream.Pipeline's streamed stages (offload=True: a chunked stage's weights in host RAM,
streamed chunk by chunk by the weight streamer OffloadModel uses) on CPU stages: bit-identical to
the unsplit model with torch's AdamW over several steps (windows, pinned chunks, recompute,
schedules, mixed with resident stages), failures that change nothing, the options it refuses."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from ramstream import Pipeline
from ramstream.pipeline.streamed import StreamedStage

from _pipeline_helpers import (
    Boom,
    assert_same,
    batch,
    blocks,
    next_step_is_exact,
    reference_grads,
    run_with_timeout,
)

CONFIGS = [(True, 1, 0), (True, 2, 1), ("checkpoint", 2, 0), (False, 3, 1)]


@pytest.mark.parametrize("keep,window,pin", CONFIGS, ids=[f"keep={k}-w{w}-pin{p}" for k, w, p in CONFIGS])
@pytest.mark.parametrize("overlap", [True, False], ids=["threads", "serial"])
def test_streamed_stages_equal_the_unsplit_model(keep, window, pin, overlap):
    ref = blocks()
    mine = copy.deepcopy(ref)
    kids = list(mine)
    pipe = Pipeline(
        stage_modules=[kids[:3], nn.Sequential(*kids[3:5]), kids[5:]],  # streamed, resident, streamed
        devices=["cpu"] * 3,
        overlap=overlap,
        offload_window=window,
        offload_pin=pin,
        offload_keep_activations=keep,
    )
    assert [type(m).__name__ for m in pipe.modules] == ["StreamedStage", "Sequential", "StreamedStage"]
    opt_ref = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    opt = torch.optim.AdamW(pipe.parameters(), lr=1e-2)
    for it in range(3):
        x, y = batch(seed=it)
        losses = reference_grads(ref, x, y, 4)
        r = pipe.step(x, targets=y, loss_fn=F.mse_loss, n_microbatches=4, schedule=("1f1b", "gpipe")[it % 2])
        assert all(torch.equal(a, b) for a, b in zip(r.losses, losses))
        assert_same(mine, ref)
        opt_ref.step()
        opt.step()
        opt_ref.zero_grad()
        opt.zero_grad()
        assert_same(mine, ref)
    stage = pipe.modules[0]
    assert stage.streamer.stats["loads"] > 0 and stage.pinned == sorted({i * 3 // pin for i in range(pin)})
    assert not any(b.loaded for b in stage.streamer.blocks)  # weights home between steps
    with torch.no_grad():
        want = torch.cat([ref(p) for p in x.tensor_split(3)])
    assert torch.equal(pipe.infer(x, n_microbatches=3), want)
    pipe.close()


@pytest.mark.parametrize("schedule", ["1f1b", "gpipe"], ids=["microbatch-major", "chunk-major"])
@pytest.mark.parametrize("where", ["forward", "backward"])
def test_a_failing_streamed_step_changes_nothing(where, schedule):
    ref = blocks(6)
    ref[1].append(Boom())  # inside the streamed stage's second chunk
    mine = copy.deepcopy(ref)
    boom = mine[1][2]
    kids = list(mine)
    pipe = Pipeline(stage_modules=[kids[:3], kids[3:]], devices=["cpu", "cpu"], offload_window=1)
    x, y = batch()
    pipe.step(x, targets=y, loss_fn=F.mse_loss, n_microbatches=4, schedule=schedule)
    before = {n: (p.detach().clone(), p.grad.clone()) for n, p in mine.named_parameters()}
    boom.calls = 0
    boom.forward_at = 3 if where == "forward" else None  # gpipe: the third microbatch of a chunk-major run
    boom.backward_armed = where == "backward"
    with pytest.raises(RuntimeError, match=f"boom in {where}"):
        run_with_timeout(
            lambda: pipe.step(x, targets=y, loss_fn=F.mse_loss, n_microbatches=4, schedule=schedule)
        )
    for n, p in mine.named_parameters():
        assert torch.equal(p, before[n][0]) and torch.equal(p.grad, before[n][1]), n
    assert not any(b.loaded for st in pipe.modules for b in st.streamer.blocks)
    assert not any(st.streamer.driven or st.holding for st in pipe.modules)
    boom.forward_at, boom.backward_armed = None, False
    next_step_is_exact(pipe, mine, ref, x, y, schedule=schedule)
    pipe.close()


def test_frozen_chunks_stream_too_and_close_leaves_the_weights_home():
    ref = blocks(4)
    ref[1].requires_grad_(False)
    mine = copy.deepcopy(ref)
    pipe = Pipeline(chunk_modules=list(mine), devices=["cpu"])
    x, y = batch()
    reference_grads(ref, x, y, 2)
    pipe.step(x, targets=y, loss_fn=F.mse_loss, n_microbatches=2)
    assert_same(mine, ref)
    assert all(p.grad is None for p in mine[1].parameters())
    pipe.close()
    with torch.no_grad():
        assert torch.equal(mine(x), ref(x))  # plain modules again, weights in place


def test_options_a_streamed_stage_takes_and_refuses():
    kids = list(blocks(4))
    with Pipeline(chunk_modules=kids, devices=["cpu"], offload_activations=True) as pipe:
        assert isinstance(pipe.modules[0], StreamedStage)  # paged: test_pipeline_act_offload.py
    with pytest.raises(ValueError, match="offload_keep_activations"):
        Pipeline(chunk_modules=kids, devices=["cpu"], offload_keep_activations="sometimes")
    with Pipeline(chunk_modules=kids, devices=["cpu"], offload_grad_accum="cpu", offload_acc_slots=3) as pipe:
        assert isinstance(pipe.modules[0], StreamedStage)
        with pytest.raises(TypeError, match="places itself"):
            pipe.modules[0].to(torch.float64)


@pytest.mark.cuda
def test_a_streamed_stage_on_the_gpu():
    ref = blocks().cuda()
    mine = copy.deepcopy(ref)
    kids = list(mine)
    x, y = (t.cuda() for t in batch())
    reference_grads(ref, x, y, 4)
    with Pipeline(stage_modules=[kids[:6], nn.Sequential(*kids[6:])], devices=["cuda:0", "cuda:0"]) as pipe:
        pipe.step(x, targets=y, loss_fn=F.mse_loss, n_microbatches=4)
        streamed = list(pipe.modules[0].parameters())
        assert all(p.device.type == "cpu" and p.grad.device.type == "cpu" for p in streamed)
        for p, q in zip(mine.parameters(), ref.parameters()):
            assert torch.equal(p.detach().cpu(), q.detach().cpu())
            assert torch.equal(p.grad.cpu(), q.grad.cpu())


def test_a_module_list_stage_and_collection_unhooks_the_streamer():
    import gc

    ref = blocks(4)
    mine = copy.deepcopy(ref)
    pipe = Pipeline(
        stage_modules=[nn.ModuleList(list(mine)[:2]), nn.Sequential(*list(mine)[2:])], devices=["cpu"] * 2
    )
    assert isinstance(pipe.modules[0], StreamedStage)
    x, y = batch()
    pipe.step(x, targets=y, loss_fn=F.mse_loss, n_microbatches=2)
    del pipe
    gc.collect()
    assert not mine[0]._forward_pre_hooks and not mine[1]._forward_pre_hooks
    with torch.no_grad():
        assert torch.equal(mine(x), ref(x))
