"""OffloadModel on a GPU: gradients of streamed chunks go home on the D2H stream into pinned
buffers (reused across steps, never one a caller still holds) and match torch; the copy stream
waits for the compute queued before each load, so the weights on the device stay within the
window even when the host runs far ahead of a slow GPU."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import ramstream

pytestmark = pytest.mark.cuda


def _chunks(n=4, d=64):
    torch.manual_seed(0)
    return [nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d)) for _ in range(n)]


def test_gradients_land_pinned_on_the_d2h_stream():
    chunks = _chunks()
    ref = nn.Sequential(*copy.deepcopy(chunks)).cuda()
    model = ramstream.OffloadModel(chunks, device="cuda", window=1, keep_activations=True)
    x, y = torch.randn(8, 64, device="cuda"), torch.randn(8, 64, device="cuda")
    model.step(x, targets=y)
    F.mse_loss(ref(x), y).backward()
    assert model.grads.stream is not None and model.stats["bytes_d2h"] > 0
    for a, b in zip(ref.parameters(), model.parameters()):
        assert b.grad.device.type == "cpu" and b.grad.is_pinned()
        assert torch.equal(a.grad.cpu(), b.grad)
    ptrs = [p.grad.data_ptr() for p in model.parameters()]
    for p in model.parameters():
        p.grad = None
    model.step(x, targets=y)
    assert [p.grad.data_ptr() for p in model.parameters()] == ptrs  # the pinned buffers reused
    held = [p.grad for p in model.parameters()]  # a caller keeps last step's gradients
    for p in model.parameters():
        p.grad = None
    model.step(x, targets=y)
    assert all(p.grad.data_ptr() != h.data_ptr() for p, h in zip(model.parameters(), held))
    # accumulation without zero_grad: added on the host after the D2H copies
    before = [p.grad.clone() for p in model.parameters()]
    model.step(x, targets=y)
    for p, b in zip(model.parameters(), before):
        assert torch.equal(p.grad, b + b)
    model.close()


class _Slow(nn.Module):
    """A chunk whose forward keeps the GPU busy long after the host has queued it."""

    def __init__(self, d=1024):
        super().__init__()
        self.lin = nn.Linear(d, d)

    def forward(self, x):
        torch.cuda._sleep(20_000_000)
        return self.lin(x)


def test_window_bounds_device_weights_when_the_host_runs_ahead():
    torch.manual_seed(0)
    chunks = [_Slow() for _ in range(16)]
    chunk_bytes = sum(p.numel() * p.element_size() for p in chunks[0].parameters())
    model = ramstream.OffloadModel(chunks, device="cuda", window=1, keep_activations=True)
    x = torch.randn(4, 1024, device="cuda")
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    model.step(x, grad_outputs=torch.ones(4, 1024, device="cuda"))
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    # window 1: two chunks loaded at once, plus slack for a chunk's gradients and the ones still
    # in flight to the host; without the copy stream's wait the host would have loaded all 16
    assert peak < 6 * chunk_bytes, (peak / chunk_bytes, chunk_bytes)
    model.close()


def test_autocast_keeps_no_weight_casts_in_the_graph():
    torch.manual_seed(0)
    chunks = [nn.Linear(1024, 1024) for _ in range(16)]
    chunk_bytes = sum(p.numel() * p.element_size() for p in chunks[0].parameters())
    model = ramstream.OffloadModel(chunks, device="cuda", window=1, keep_activations=True)
    x = torch.randn(4, 1024, device="cuda", requires_grad=True)
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    with torch.autocast("cuda", dtype=torch.bfloat16):
        model.step(x, grad_outputs=torch.ones(4, 1024, device="cuda", dtype=torch.bfloat16))
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    # kept, the 16 bf16 casts alone would be 8 chunks' worth of fp32 weights
    assert model.stats["casts_dropped"] == 16
    assert peak < 6 * chunk_bytes, peak / chunk_bytes
    model.close()
