"""OffloadModel(activation_offload=True): the kept graph's large saved tensors go to host memory
and come back for backward (the ActivationOffloader that wrap() uses), and the gradients are
bit-identical to the same chunks run resident without paging; a failed step leaves no paged
buffer alive; close() removes the paging hooks."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import ramstream

from _offload_optim_ref import Boom

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)]
D, ROWS = 256, 1024  # a [1024, 256] fp32 activation is 1 MiB: the offloader's default threshold


def _chunks(n=4):
    torch.manual_seed(0)
    return [nn.Sequential(nn.Linear(D, 2 * D), nn.GELU(), nn.Linear(2 * D, D)) for _ in range(n)]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("autocast", [False, True])
def test_paged_activations_give_bit_identical_gradients(device, autocast):
    chunks = _chunks()
    ref = nn.Sequential(*copy.deepcopy(chunks)).to(device)
    model = ramstream.OffloadModel(
        chunks, device=device, window=2, keep_activations=True, activation_offload=True
    )
    for step in range(3):
        torch.manual_seed(10 + step)
        x, y = torch.randn(ROWS, D, device=device), torch.randn(ROWS, D, device=device)
        with torch.autocast(device, dtype=torch.bfloat16, enabled=autocast):
            res = model.step(x, targets=y)
            loss = F.mse_loss(ref(x), y)
        loss.backward()
        assert torch.equal(res.loss, loss.detach())
        assert model.stats["activation_bytes_paged"] >= 4 * ROWS * D * 4  # the big tensors went home
    for a, b in zip(ref.parameters(), model.parameters()):
        assert torch.equal(a.grad.cpu(), b.grad.cpu())
    model.close()
    assert model._hooks.activations is None


@pytest.mark.parametrize("device", DEVICES)
def test_a_failed_backward_leaves_no_paged_buffer_alive(device):
    chunks = _chunks(3)
    ref = nn.Sequential(*copy.deepcopy(chunks)).to(device)
    model = ramstream.OffloadModel(chunks, device=device, keep_activations=True, activation_offload=True)
    off = model._hooks.activations
    x, y = torch.randn(ROWS, D, device=device), torch.randn(ROWS, D, device=device)

    def bad_loss(out, t):
        return F.mse_loss(Boom.apply(out), t)

    with pytest.raises(RuntimeError, match="boom"):
        model.step(x, targets=y, loss_fn=bad_loss)
    assert off.stats()["live_entries"] == 0
    assert all(p.grad is None for p in model.parameters())  # as before the failed step
    res = model.step(x, targets=y)  # the next step works and pages again
    loss = F.mse_loss(ref(x), y)
    loss.backward()
    assert torch.equal(res.loss, loss.detach())
    for a, b in zip(ref.parameters(), model.parameters()):
        assert torch.equal(a.grad.cpu(), b.grad.cpu())
    assert model.stats["activation_bytes_paged"] > 0
    model.close()


def test_the_host_optimizer_trains_the_same_with_paged_activations():
    chunks = _chunks(3)
    twin = copy.deepcopy(chunks)
    a = ramstream.OffloadModel(chunks, device="cpu", keep_activations=True, activation_offload=True)
    b = ramstream.OffloadModel(twin, device="cpu", keep_activations=True)
    oa, ob = a.optimizer(lr=1e-3), b.optimizer(lr=1e-3)
    for step in range(3):
        torch.manual_seed(step)
        x, y = torch.randn(ROWS, D), torch.randn(ROWS, D)
        assert torch.equal(a.step(x, targets=y).loss, b.step(x, targets=y).loss)
        oa.step()
        ob.step()
        oa.zero_grad()
        ob.zero_grad()
    oa.synchronize()
    ob.synchronize()
    for p, q in zip(a.parameters(), b.parameters()):
        assert torch.equal(p, q)
    a.close()
    b.close()
