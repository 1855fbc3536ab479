"""Recomputed blocks under autocast: the casts autocast caches for them are dropped after each block
(nothing else holds them), gradients unchanged; on the GPU the forward's peak shows it."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from ramstream.activations import recompute
from ramstream.activations.recompute import Recompute


def _stack(n=4, d=64, device="cpu"):
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Sequential(nn.Linear(d, d), nn.GELU()) for _ in range(n)]).to(device)


def _grads(model, x, device_type):
    model.zero_grad(set_to_none=True)
    with torch.autocast(device_type, dtype=torch.bfloat16):
        loss = model(x).float().square().mean()
    loss.backward()
    return loss.detach(), [p.grad.clone() for p in model.parameters()]


def test_the_cache_is_cleared_after_each_recomputed_block_and_gradients_are_unchanged(monkeypatch):
    model, x = _stack(), torch.randn(8, 64)
    ref_loss, ref = _grads(model, x, "cpu")  # no recompute: the reference
    calls = []
    real = recompute._drop_casts
    monkeypatch.setattr(recompute, "_drop_casts", lambda: (calls.append(1), real())[1])
    rc = Recompute(list(model), [0, 1, 3])
    try:
        loss, got = _grads(model, x, "cpu")
    finally:
        rc.close()
    assert len(calls) == 3  # one per recomputed block's forward (not in its recompute: no grad mode there)
    assert torch.equal(loss, ref_loss)
    for a, b in zip(got, ref):
        assert torch.equal(a, b)


def test_without_autocast_nothing_is_cleared(monkeypatch):
    model, x = _stack(), torch.randn(8, 64)
    calls = []
    monkeypatch.setattr(recompute, "_drop_casts", lambda: calls.append(1))
    rc = Recompute(list(model), [0, 1, 2, 3])
    try:
        model(x).sum().backward()
    finally:
        rc.close()
    assert calls == []


@pytest.mark.cuda
def test_recomputed_blocks_hold_no_bf16_weight_copies_during_the_forward():
    d, n = 2048, 8  # 16 MiB of fp32 weight per block, 8 MiB as bf16
    model = _stack(n, d, "cuda")
    x = torch.randn(16, d, device="cuda")
    rc = Recompute(list(model), list(range(n)))
    try:
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            y = model(x)
        held = torch.cuda.max_memory_allocated() - base
        y.float().sum().backward()
    finally:
        rc.close()
    casts = n * d * d * 2
    # the peak holds at most two blocks' casts (the running one, the previous before its clear)
    # and the small activations; the cache would have held all eight (64 MiB)
    assert held < casts / 2, (held, casts)
