"""Pipeline(offload_activations=True) on CPU stages: each stage's saved activations beyond
offload_act_slots forwards go to host buffers and come back for their backward; weights after
AdamW steps equal the unsplit model bit for bit (gpipe, 1f1b, interleaved, streamed stages,
tuple outputs), the hooks really moved tensors (activation_stats), a failed step frees them."""

from __future__ import annotations

import contextlib
import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from ramstream import Pipeline
from ramstream.pipeline.paging import StagePager

from _pipeline_helpers import (
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
    tuple_loss,
)


def train_both(ref, pipe, steps=2, n=4, schedule="1f1b", loss_fn=F.mse_loss):
    opt_ref = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    opt = torch.optim.AdamW(pipe.parameters(), lr=1e-2)
    for it in range(steps):
        x, y = batch(seed=it)
        reference_grads(ref, x, y, n, loss_fn)
        run_with_timeout(
            lambda: pipe.step(x, targets=y, loss_fn=loss_fn, schedule=schedule, n_microbatches=n)
        )
        for o in (opt_ref, opt):
            o.step()
            o.zero_grad()


CASES = [
    ("gpipe", 2, 1, 1),
    ("gpipe", 4, 1, 2),
    ("1f1b", 2, 1, 1),
    ("1f1b", 4, 1, 2),
    ("interleaved", 2, 2, 1),
]


@pytest.mark.parametrize(
    "schedule,stages,v,slots", CASES, ids=[f"{c[0]}-{c[1]}x{c[2]}-s{c[3]}" for c in CASES]
)
@pytest.mark.parametrize("overlap", [True, False], ids=["threads", "serial"])
def test_paged_steps_equal_the_unsplit_model_bit_for_bit(schedule, stages, v, slots, overlap):
    ref = blocks()
    mine = copy.deepcopy(ref)
    pipe = Pipeline(
        stage_modules=groups(mine, stages * v),
        chunks_per_stage=v,
        devices=["cpu"] * stages,
        overlap=overlap,
        offload_activations=True,
        offload_act_slots=slots,
    )
    train_both(ref, pipe, schedule=schedule)
    assert_same(mine, ref)
    stats = pipe.activation_stats()
    assert len(stats) == stages
    assert stats[0]["paged"] > 0 and stats[0]["paged_bytes"] > 0  # stage 0 holds the most forwards
    for st in stats:
        assert st["packs"] > 0
        assert st["fetched"] == st["paged"] and st["fetched_bytes"] == st["paged_bytes"]
        assert 1 <= st["resident_peak"] <= slots
        assert st["host_bytes_in_use"] == 0  # every buffer back in the pool after the steps
    # the weights (parameters and their transposed views) are never paged: only activations
    assert stats[0]["paged_bytes"] / stats[0]["paged"] <= 3 * WIDTH * 4  # a microbatch's rows
    pipe.close()


def test_slots_bound_what_stays_and_off_means_off():
    ref = blocks()
    x, y = batch()
    counts = {}
    for slots in (1, 2, 4):
        with Pipeline(
            stage_modules=groups(copy.deepcopy(ref), 2),
            devices=["cpu", "cpu"],
            offload_activations=True,
            offload_act_slots=slots,
        ) as pipe:
            pipe.step(x, targets=y, loss_fn=F.mse_loss, schedule="gpipe", n_microbatches=4)
            counts[slots] = pipe.activation_stats()[0]
    assert counts[4]["paged"] == 0 and counts[4]["resident_peak"] == 4  # every forward fits
    assert counts[1]["paged"] > counts[2]["paged"] > 0
    # gpipe on stage 0: forwards 0..slots-1 keep theirs; each backward frees a slot that the next
    # paged forward takes at once (its tensors come back ahead of its backward)
    assert counts[1]["prefetched"] == 3 and counts[2]["prefetched"] == 2 and counts[4]["prefetched"] == 0
    assert counts[1]["resident_peak"] == 1 and counts[2]["resident_peak"] == 2
    assert counts[1]["packs"] == counts[2]["packs"] == counts[4]["packs"]
    with Pipeline(stage_modules=groups(copy.deepcopy(ref), 2), devices=["cpu", "cpu"]) as pipe:
        pipe.step(x, targets=y, loss_fn=F.mse_loss)
        assert pipe.activation_stats() == []


def test_1f1b_gives_a_freed_slot_to_the_next_forward_and_prefetches_in_the_cool_down():
    # stage 0 of 4 runs F0 F1 F2 F3 B0 F4 B1 F5 B2 F6 B3 F7 B4 B5 B6 B7 with one slot: F0 and F4
    # keep theirs (B0 frees the slot for F4, not for a prefetch), the six others are paged; only
    # B4, B5 and B6 are followed by backwards, so mb 5, 6 and 7 come back early
    ref = blocks()
    mine = copy.deepcopy(ref)
    with Pipeline(
        stage_modules=groups(mine, 4), devices=["cpu"] * 4, offload_activations=True, offload_act_slots=1
    ) as pipe:
        x, y = batch(16)
        reference_grads(ref, x, y, 8)
        run_with_timeout(lambda: pipe.step(x, targets=y, loss_fn=F.mse_loss, n_microbatches=8))
        assert_same(mine, ref)
        st = pipe.activation_stats()[0]
        assert st["prefetched"] == 3 and st["resident_peak"] == 1
        assert st["paged"] % 6 == 0 and st["paged"] > 0 and st["fetched"] == st["paged"]


def test_streamed_stages_and_tuple_outputs_page_too():
    ref = blocks(6)
    mine = copy.deepcopy(ref)
    pipe = Pipeline(
        stage_modules=[list(mine)[:4], nn.Sequential(*list(mine)[4:])],
        devices=["cpu", "cpu"],
        offload_window=2,
        offload_activations=True,
        offload_act_slots=1,
    )
    train_both(ref, pipe, schedule="gpipe")
    assert_same(mine, ref)
    assert all(st["paged"] > 0 for st in pipe.activation_stats())
    pipe.close()

    torch.manual_seed(0)
    ref = Whole(Head(), Tail())
    mine = copy.deepcopy(ref)
    with Pipeline(
        stage_modules=[mine.head, mine.tail],
        devices=["cpu", "cpu"],
        offload_activations=True,
        offload_act_slots=1,
    ) as pipe:
        x, y = batch(8)
        reference_grads(ref, x, y, 4, tuple_loss)
        pipe.step(x, targets=y, loss_fn=tuple_loss, n_microbatches=4, schedule="gpipe")
        assert_same(mine, ref)
        assert all(st["paged"] > 0 for st in pipe.activation_stats())  # the loss's too


def test_a_failing_step_returns_its_buffers_and_the_next_step_is_exact():
    ref = blocks(4)
    ref[3].append(Boom())
    mine = copy.deepcopy(ref)
    boom = mine[3][2]
    x, y = batch()
    with Pipeline(
        stage_modules=groups(mine, 2), devices=["cpu", "cpu"], offload_activations=True, offload_act_slots=1
    ) as pipe:
        boom.backward_armed = True
        with pytest.raises(RuntimeError, match="boom in backward"):
            run_with_timeout(lambda: pipe.step(x, targets=y, loss_fn=F.mse_loss, n_microbatches=4))
        assert all(p.grad is None for p in mine.parameters())
        assert all(st["host_bytes_in_use"] == 0 for st in pipe.activation_stats())
        assert all(not pg.groups and not pg.resident for pg in pipe._pagers)
        boom.backward_armed = False
        reference_grads(ref, x, y, 4)
        run_with_timeout(lambda: pipe.step(x, targets=y, loss_fn=F.mse_loss, n_microbatches=4))
        assert_same(mine, ref)


def test_a_strided_view_comes_back_with_its_strides():
    torch.manual_seed(0)
    base, w = torch.randn(6, 8), torch.randn(3, 6)

    def grad(pager):
        b = base.clone().requires_grad_(True)
        with pager.saving((0, 0), []) if pager else contextlib.nullcontext():
            v = (b * 1.0)[:, 1::3].t()  # (3, 6) with strides (3, 8): a view with gaps
            y = torch.tanh(v) * v * w  # mul saves v itself
        if pager:
            strides = {p.stride for p in pager.groups[(0, 0)].items}
            assert v.stride() in strides
            pager.fetch((0, 0), None)
        y.sum().backward()
        return b.grad

    pager = StagePager(torch.device("cpu"), slots=1)
    pager.saving(("other", 0), [])  # takes the one slot: the next forward pages
    assert torch.equal(grad(pager), grad(None))
    assert pager.stats()["paged"] >= 2
    pager.release((0, 0), None)
    assert pager.stats()["host_bytes_in_use"] == 0
    pager.close()


def test_bad_slots_name_the_argument():
    parts = groups(blocks(4), 2)
    with pytest.raises(ValueError, match="offload_act_slots"):
        Pipeline(stage_modules=parts, devices=["cpu", "cpu"], offload_activations=True, offload_act_slots=0)
    with pytest.raises(TypeError, match="offload_activations"):
        Pipeline(stage_modules=parts, devices=["cpu", "cpu"], offload_activations="yes")


@pytest.mark.cuda
def test_paged_stages_on_one_gpu_equal_the_unsplit_model():
    ref = blocks().cuda()
    mine = copy.deepcopy(ref)
    x, y = (t.cuda() for t in batch())
    reference_grads(ref, x, y, 4)
    with Pipeline(
        stage_modules=groups(mine, 2),
        devices=["cuda:0", "cuda:0"],
        offload_activations=True,
        offload_act_slots=1,
    ) as pipe:
        run_with_timeout(
            lambda: pipe.step(x, targets=y, loss_fn=F.mse_loss, n_microbatches=4, schedule="gpipe")
        )
        assert_same(mine, ref)
        st = pipe.activation_stats()[0]
        assert st["paged"] > 0 and st["fetched_bytes"] == st["paged_bytes"]
