"""activation_checkpointing="auto" in LoRA (runtime/keep.py): a recompute measures what
the block leaves allocated (inside backward only), the blocks that fit keep their activations after
step 1 (bit-identical to recomputing every block), and the watchdog's first lever makes them
recompute again. On the CPU engine the allocator figures are stand-ins: a counter the blocks'
layers add to, and injected peaks."""

from __future__ import annotations

import pytest
import torch

import ramstream
from ramstream.runtime.keep import KeepPolicy
from test_watchdog import DATA, _peaks, _same, _state, _wrap

from _models import train_torch


def _instrument(model):
    """Each block's fc1 adds 1000 'bytes' to a counter per forward; block forwards are counted."""  # noqa: D401
    counter, calls = [0], {}
    for i, b in enumerate(model.blocks):
        b.fc1.register_forward_hook(lambda *a: counter.__setitem__(0, counter[0] + 1000))
        # (a pre-hook of the first layer: the recompute stops early once the last tensor is saved)
        b.ln.register_forward_pre_hook(lambda *a, _i=i: calls.__setitem__(_i, calls.get(_i, 0) + 1))
    return counter, calls


def _keep(model, opt, usable=10_000, peak=6_000):
    w = model._ramstream
    counter, calls = _instrument(model)
    w.recompute._memory = lambda: counter[0]
    w.keep = KeepPolicy(
        w.recompute, torch.device("cpu"), 0.1, opt._log,
        measure=lambda: {"usable": usable, "peak": peak},
    )  # fmt: skip
    opt._step_callbacks.insert(0, w.keep.after_step)
    if w.watchdog is not None:
        w.watchdog.keep = w.keep
    return w.keep, calls


@pytest.fixture(scope="module")
def reference():
    model, opt = _wrap(activation_checkpointing=True, activation_offload=False, watchdog=False)
    train_torch(model, opt, DATA)
    out = _state(model, opt)
    ramstream.unwrap(model)
    return out


def test_blocks_that_fit_keep_their_activations_after_step_1_bit_for_bit(reference):
    model, opt = _wrap(activation_checkpointing=True, activation_offload=False, watchdog=False)
    keep, calls = _keep(model, opt)
    train_torch(model, opt, DATA)
    assert _same(_state(model, opt), reference)  # keeping or recomputing: the same forward
    # measured in the recomputes of step 1 only (forward passes add nothing: 1000 per block)
    assert model._ramstream.recompute.kept_bytes == {0: 1000, 1: 1000, 2: 1000, 3: 1000}
    assert model._ramstream.recompute._memory is None  # after the decision nothing measures
    # room 10000 * 0.9 - 6000 = 3000; a block 1000 * 1.1: the last two keep theirs
    assert keep.kept == [2, 3] and model._ramstream.recompute.recomputed() == [0, 1]
    # block forwards: 2 per step while recomputing (forward + recompute), 1 once kept
    assert calls == {0: 20, 1: 20, 2: 2 + 9, 3: 2 + 9}
    plan = ramstream.memory_report(model)["plan"]
    assert plan["recompute"] == [0, 1] and plan["recompute_keep"]["kept"] == [2, 3]
    d = plan["recompute_keep"]["decision"]
    assert d["room_bytes"] == 3000 and d["block_bytes"] == 1100 and d in plan["history"]
    assert any("2 of 4 blocks keep them" in e for e in ramstream.memory_report(model)["events"])
    ramstream.unwrap(model)


def test_no_room_keeps_nothing():
    model, opt = _wrap(activation_checkpointing=True, activation_offload=False, watchdog=False)
    keep, _ = _keep(model, opt, usable=10_000, peak=9_500)
    train_torch(model, opt, DATA[:2])
    assert keep.kept == [] and model._ramstream.recompute.recomputed() == [0, 1, 2, 3]
    ramstream.unwrap(model)


def test_give_back_recomputes_front_first():
    model, opt = _wrap(activation_checkpointing=True, activation_offload=False, watchdog=False)
    keep, _ = _keep(model, opt, usable=100_000, peak=0)
    train_torch(model, opt, DATA[:1])
    assert keep.kept == [0, 1, 2, 3]
    assert keep.give_back(1500) == [0, 1]  # ceil(1500 / 1100) blocks
    assert keep.kept == [2, 3] and model._ramstream.recompute.recomputed() == [0, 1]
    assert keep.give_back(1) == [2] and keep.give_back(10**9) == [3] and keep.give_back(1) == []
    ramstream.unwrap(model)


def test_the_watchdog_makes_kept_blocks_recompute_again_first_bit_for_bit(reference):
    model, opt = _wrap(activation_checkpointing=True, activation_offload=False)
    keep, _ = _keep(model, opt)
    wd = model._ramstream.watchdog
    wd.reset_peak = lambda: None
    wd.measure = _peaks([800, 800, 990, 900, 900, 900, 900, 900], usable=1000)  # from step 3
    train_torch(model, opt, DATA)
    assert _same(_state(model, opt), reference)
    (act,) = wd.actions
    assert act["step"] == 5 and act["moves"] == [{"lever": "recompute", "blocks": [2]}]
    assert keep.kept == [3] and model._ramstream.recompute.recomputed() == [0, 1, 2]
    ramstream.unwrap(model)


@pytest.mark.cuda
def test_a_recompute_measures_what_the_block_would_keep_cuda():
    from ramstream.activations.recompute import Recompute
    from ramstream.runtime.keep import measured_memory_fn

    from _models import Block

    dev = torch.device("cuda")
    torch.manual_seed(0)
    blocks = torch.nn.ModuleList(Block(256) for _ in range(2)).to(dev)
    x = torch.randn(8, 512, 256, device=dev, requires_grad=True)
    torch.cuda.synchronize()
    m0 = torch.cuda.memory_allocated(dev)
    out = blocks[1](blocks[0](x))  # kept: both blocks' saved activations and outputs stay
    kept_plain = (torch.cuda.memory_allocated(dev) - m0) / 2
    del out
    rc = Recompute(list(blocks), [0, 1], memory_fn=measured_memory_fn(dev))
    blocks[1](blocks[0](x)).sum().backward()
    rc.close()
    assert set(rc.kept_bytes) == {0, 1}
    for b in rc.kept_bytes.values():
        assert 0.5 * kept_plain <= b <= 1.5 * kept_plain, (b, kept_plain)
