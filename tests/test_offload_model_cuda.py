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
    model = ramstream.OffloadModel(chunks, device="cuda", window=2, keep_activations=True)
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
    model = ramstream.OffloadModel(chunks, device="cuda", window=2, keep_activations=True)
    x = torch.randn(4, 1024, device="cuda")
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    model.step(x, grad_outputs=torch.ones(4, 1024, device="cuda"))
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    # window 2: two chunks loaded at once, plus slack for a chunk's gradients and the ones still
    # in flight to the host; without the copy stream's wait the host would have loaded all 16
    assert peak < 6 * chunk_bytes, (peak / chunk_bytes, chunk_bytes)
    model.close()


def test_autocast_keeps_no_weight_casts_in_the_graph():
    torch.manual_seed(0)
    chunks = [nn.Linear(1024, 1024) for _ in range(16)]
    chunk_bytes = sum(p.numel() * p.element_size() for p in chunks[0].parameters())
    model = ramstream.OffloadModel(chunks, device="cuda", window=2, keep_activations=True)
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


@pytest.mark.parametrize("window", [1, 2])
def test_window_1_never_overlaps_a_load_with_compute(tmp_path, window):
    """RamTorch's window: window=1 loads each chunk after the compute before it (the trace's H2D
    spans are disjoint from every forward/backward span); window=2 prefetches the next chunk
    while one runs (some load lies inside another chunk's compute span)."""
    import json

    torch.manual_seed(0)
    chunks = [_Slow() for _ in range(6)]
    model = ramstream.OffloadModel(chunks, device="cuda", window=window, keep_activations=True)
    x, g = torch.randn(4, 1024, device="cuda"), torch.ones(4, 1024, device="cuda")
    model.step(x, grad_outputs=g)  # warm
    path = tmp_path / "step.json"
    model.step(x, grad_outputs=g, profile_path=str(path))
    with open(path) as f:
        spans = [e for e in json.load(f)["traceEvents"] if e["ph"] == "X"]
    loads = [
        (s["ts"], s["ts"] + s["dur"]) for s in spans if s["cat"] == "h2d" and s["name"].startswith("load")
    ]
    work = [(s["ts"], s["ts"] + s["dur"]) for s in spans if s["name"].split()[0] in ("forward", "backward")]
    assert len(loads) == 2 * 6 - window and len(work) == 2 * 6

    def overlap(a, b):
        return max(0.0, min(a[1], b[1]) - max(a[0], b[0]))

    worst = max(max(overlap(ld, w) / max(ld[1] - ld[0], 1e-3) for w in work) for ld in loads)
    if window == 1:
        assert worst < 0.05, worst  # microseconds of event-timing noise at most
    else:
        assert worst > 0.5, worst
    assert model.stats["peak_loaded_bytes"] == window * model.streamer.blocks[0].nbytes
    model.close()
