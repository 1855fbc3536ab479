"""Helpers of the activation offload tests on the CPU engine: an attached offloader, a spy on the
paging decision, gradient comparison with a clone."""

from __future__ import annotations

import torch

from ramstream.activations import ActivationOffloader

CPU = torch.device("cpu")


def _assert_same_grads(a, b):
    for (name, pa), pb in zip(a.named_parameters(), b.parameters()):
        assert (pa.grad is None) == (pb.grad is None), name
        if pa.grad is not None:
            assert torch.equal(pa.grad, pb.grad), f"{name}: max diff {(pa.grad - pb.grad).abs().max().item()}"


def _backward_both(blocks, ref, x):
    """Runs x through `blocks` and a copy of x through `ref` (their clone) block after block,
    backward of each sum, and asserts bit-equal parameter gradients. Returns the copy of x."""
    xr = x.detach().clone().requires_grad_()
    y, yr = x, xr
    for b, r in zip(blocks, ref):
        y, yr = b(y), r(yr)
    y.sum().backward()
    yr.sum().backward()
    _assert_same_grads(blocks, ref)
    return xr


def _offloader(blocks, paged="all", **kw):
    kw.setdefault("min_offload_bytes", 1)
    off = ActivationOffloader(blocks, CPU, **kw).attach()
    off.set_paged(range(len(off.blocks)) if paged == "all" else paged)
    return off


def _spy(off):
    """Records every tensor that reaches the paging decision (after the parameter/size filter)."""
    seen = []
    real = off._page

    def page(t, call, paged):
        seen.append((call.index, t.untyped_storage().data_ptr(), t.numel() * t.element_size()))
        return real(t, call, paged)

    off._page = page
    return seen
