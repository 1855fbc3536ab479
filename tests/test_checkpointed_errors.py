"""activations.recompute.checkpointed: a checkpointed function that raises leaves no saved-tensor
hooks pushed, also under a torch whose checkpoint does not close its own generator on an error
(torch 2.11, the GPU machine's: there the leftover hooks were popped later, on another thread,
and tripped an internal assert). That torch is emulated by a stand-in for torch.utils.checkpoint
compiled under torch's file name (the fix finds torch's frames by their file)."""

from __future__ import annotations

import pytest
import torch
import torch.utils.checkpoint as tc

import ramstream
from ramstream.activations import recompute

# torch 2.11's shape of the non-reentrant path: a generator holding saved_tensors_hooks around
# the call, advanced before and after, never told about an exception in between.
_OLD_CHECKPOINT = """
import torch

def _generator():
    with torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t):
        yield
    yield

def checkpoint(function, *args, use_reentrant=None, **kwargs):
    kwargs.pop("preserve_rng_state", None)
    gen = _generator()
    next(gen)
    ret = function(*args, **kwargs)
    next(gen)
    return ret
"""


def _old_checkpoint():
    space: dict = {}
    exec(compile(_OLD_CHECKPOINT, tc.__file__, "exec"), space)  # noqa: S102 - the test's own code
    return space["checkpoint"]


def _hooks_pushed() -> bool:
    return torch._C._autograd._top_saved_tensors_default_hooks(False) is not None


def _boom(x):
    raise RuntimeError("boom")


@pytest.fixture
def old_torch(monkeypatch):
    monkeypatch.setattr(tc, "checkpoint", _old_checkpoint())


def test_the_emulated_old_checkpoint_leaves_its_hooks_pushed(old_torch):
    """The emulation reproduces the problem: without checkpointed(), hooks stay pushed while the
    exception is alive."""
    x = torch.randn(3, requires_grad=True)
    try:
        tc.checkpoint(_boom, x)
    except RuntimeError as e:
        err = e
    assert _hooks_pushed()
    del err
    assert not _hooks_pushed()


@pytest.mark.parametrize("torch_version", ["installed", "old"])
def test_checkpointed_pops_the_hooks_before_the_error_leaves(torch_version, monkeypatch):
    if torch_version == "old":
        monkeypatch.setattr(tc, "checkpoint", _old_checkpoint())
    x = torch.randn(3, requires_grad=True)
    try:
        recompute.checkpointed(_boom, x)
    except RuntimeError as e:
        err = e
    assert str(err) == "boom"
    assert not _hooks_pushed()  # while the exception (and its traceback) is still alive
    y = recompute.checkpointed(torch.sin, x)  # and the next call works
    y.sum().backward()
    assert torch.equal(x.grad, torch.cos(x).detach())


def test_offload_checkpoint_error_leaves_no_hooks(old_torch):
    lin = torch.nn.Linear(4, 4)
    with pytest.raises(RuntimeError, match="mat1 and mat2"):
        ramstream.offload_checkpoint(lin, torch.randn(2, 3, requires_grad=True))
    assert not _hooks_pushed()
