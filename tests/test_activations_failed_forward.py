"""A forward pass that raises part-way (an out-of-memory error, say) under activation paging frees
what it saved: the next step has all its memory back.

Found on the GPU (bench_activations.py, 1.8B GPT under a 24 GiB cap): after one batch ran out of
memory in forward, 16 GiB of its activations stayed allocated for the rest of the process, so no
larger batch could fit afterwards, paged or not. The pack hook kept a tensor that stays on the
device as the tensor itself; for a tensor an op saves of its own output (SDPA, exp, LayerNorm's
mean and rstd) that tensor's grad_fn is the node that holds the packed object, a cycle through
autograd's C++ graph that Python's garbage collector cannot see. Backward breaks it by freeing the
saved tensors; a forward that never reaches backward left the whole graph alive."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch
import torch.nn as nn

from ramstream.activations import ActivationOffloader


class ExpBlock(nn.Module):
    """exp() saves its own output for backward: the case that made the cycle."""

    def __init__(self, d: int, fail: bool = False) -> None:
        super().__init__()
        self.fc = nn.Linear(d, d)
        self.fail = fail
        self.outputs: list = []

    def forward(self, x):
        y = torch.exp(self.fc(x) * 0.01)
        self.outputs.append(weakref.ref(y))
        if self.fail:
            raise torch.OutOfMemoryError("injected: out of memory in forward")
        return x + y


def _model(d=64):
    return nn.Sequential(ExpBlock(d), ExpBlock(d), ExpBlock(d, fail=True))


@pytest.mark.parametrize("mode", ["measuring", "paged", "paged+measuring", "kept"])
def test_a_forward_that_raises_frees_its_saved_tensors(mode):
    model = _model()
    off = ActivationOffloader(list(model), "cpu", min_offload_bytes=0).attach()
    off.set_measuring("measuring" in mode)
    off.set_paged([0, 1, 2] if "paged" in mode else [])
    if mode == "kept":  # hooked blocks whose tensors all stay (below the size threshold)
        off.min_offload_bytes = 1 << 40
        off.set_paged([0, 1, 2])
    x = torch.randn(8, 64, requires_grad=True)
    with pytest.raises(torch.OutOfMemoryError):
        model(x)
    gc.collect()
    alive = [r for b in model for r in b.outputs if r() is not None]
    assert not alive, f"{len(alive)} saved activations of the failed forward are still alive"
    # and the next step trains as an unhooked model does
    model[2].fail = False
    ref = _model()
    ref[2].fail = False
    ref.load_state_dict(model.state_dict())
    model(x).sum().backward()
    ref(x).sum().backward()
    for a, b in zip(model.parameters(), ref.parameters()):
        assert torch.equal(a.grad, b.grad)
    off.detach()
