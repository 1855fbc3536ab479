"""GradWriteback(sum_as_landed=True) (the pipeline's streamed stages, a landing per microbatch):
each later landing is added into the first as it lands (CUDA: on a host thread after its copy),
and the result equals the sum commit() makes of every landing, bit for bit; one host gradient
per parameter is kept; a failed step's additions are waited for and dropped."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

from ramstream import Pipeline
from ramstream.frontends.offload_model.grads import GradWriteback

from _pipeline_helpers import batch, blocks, reference_grads

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)]


def _land_all(gw, p, grads):
    for g in grads:
        gw.land(p, g.to(gw.device, copy=True))  # (landing hands the tensor over)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("max_staged", [1, 2 << 30])  # 1 byte: every addition waits for the one before
def test_summed_as_landed_equals_the_sum_at_commit(device, max_staged):
    torch.manual_seed(0)
    grads = [torch.randn(257, 33) * 10 ** (i % 4) for i in range(7)]  # magnitudes: order matters
    p, q = (torch.nn.Parameter(torch.zeros(257, 33)) for _ in range(2))
    summed = GradWriteback(torch.device(device), sum_as_landed=True, max_staged=max_staged)
    plain = GradWriteback(torch.device(device))
    _land_all(summed, p, grads)
    _land_all(plain, q, grads)
    assert len(summed._pending[id(p)][1]) == 1 and len(plain._pending[id(q)][1]) == 7
    summed.commit({})
    plain.commit({})
    assert torch.equal(p.grad, q.grad)
    ref = grads[0].clone()
    for g in grads[1:]:
        ref.add_(g)
    assert torch.equal(p.grad, ref)  # left to right, as autograd accumulates
    summed.close()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("sum_as_landed", [False, True])
def test_land_many_equals_one_landing_at_a_time(device, sum_as_landed):
    """A chunk's landings in one batch (land_many, one wait of the copy stream) give the pending
    gradients, the sums and the counters of landing them one by one, a parameter twice in a
    batch included (the second landing of a step: its own buffer, added on the host)."""
    torch.manual_seed(1)
    ps = [torch.nn.Parameter(torch.zeros(65, 9)) for _ in range(3)]
    qs = [torch.nn.Parameter(torch.zeros(65, 9)) for _ in range(3)]
    order = [0, 1, 2, 0, 2, 0]
    grads = [torch.randn(65, 9) * 10 ** (i % 3) for i in range(len(order))]
    dev = torch.device(device)
    batched = GradWriteback(dev, sum_as_landed=sum_as_landed)
    single = GradWriteback(dev, sum_as_landed=sum_as_landed)
    batched.land_many([(ps[i], g.to(dev, copy=True)) for i, g in zip(order, grads)])
    for i, g in zip(order, grads):
        single.land(qs[i], g.to(dev, copy=True))
    assert batched.stats == single.stats
    batched.commit({})
    single.commit({})
    for p, q in zip(ps, qs):
        assert p.grad.device.type == "cpu" and torch.equal(p.grad, q.grad)
    ref = grads[0].clone().add_(grads[3]).add_(grads[5])  # parameter 0: in landing order
    assert torch.equal(ps[0].grad, ref)
    batched.land_many([])  # nothing to land: nothing happens
    assert not batched._pending
    batched.close()
    single.close()


def test_a_previous_grad_is_refused_where_sums_start_at_the_first_landing():
    p = torch.nn.Parameter(torch.zeros(3))
    gw = GradWriteback(torch.device("cpu"), sum_as_landed=True)
    gw.land(p, torch.ones(3))
    with pytest.raises(ValueError, match="before must be"):
        gw.commit({id(p): torch.ones(3)})


@pytest.mark.parametrize("device", DEVICES)
def test_discard_waits_for_the_additions_and_keeps_grad(device):
    p = torch.nn.Parameter(torch.zeros(64))
    p.grad = torch.full((64,), 5.0)
    gw = GradWriteback(torch.device(device), sum_as_landed=True)
    _land_all(gw, p, [torch.ones(64)] * 5)
    gw.discard()
    assert not gw._pending and not gw._jobs
    assert torch.equal(p.grad, torch.full((64,), 5.0))
    gw.close()


@pytest.mark.cuda
def test_microbatch_major_streamed_stages_on_the_gpu_equal_the_unsplit_model():
    """RamTorch's order (offload_chunk_major=False, 1F1B): each streamed parameter lands once per
    microbatch and is summed on the host as it lands; .grad equals the unsplit model's."""
    ref = blocks(8).cuda()
    mine = copy.deepcopy(ref)
    x, y = (t.cuda() for t in batch())
    reference_grads(ref, x, y, 4)
    halves = [list(mine)[:4], list(mine)[4:]]
    with Pipeline(
        stage_modules=halves,
        devices=["cuda:0", "cuda:0"],
        offload_chunk_major=False,
        offload_window=2,
        offload_pin=0,
    ) as pipe:
        for m in pipe.modules:
            m.grads.max_staged = 1  # every addition waits for the one before: the queue's order
        pipe.step(x, targets=y, loss_fn=F.mse_loss, n_microbatches=4)
        for p, q in zip(mine.parameters(), ref.parameters()):
            assert p.grad.device.type == "cpu" and torch.equal(p.grad, q.grad.cpu())
        assert [m.grads.stats["landed"] for m in pipe.modules] == [32, 32]  # 4 chunks x 2 x 4 microbatches


@pytest.mark.parametrize("bad", [0, -1, 1.5, True, "2G"])
def test_max_staged_must_be_a_positive_int(bad):
    with pytest.raises(ValueError, match="max_staged"):
        GradWriteback(torch.device("cpu"), sum_as_landed=True, max_staged=bad)
