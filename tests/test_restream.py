"""Blocks that start streaming their weights between steps (engine/restream.py, runtime/apply.py
StreamLever): the buckets wrap() laid out by block become streamed buckets with their values as
they are, so a run that starts streaming blocks mid-way trains bit for bit as one that never did
(fp32: as torch's fused AdamW; bf16 weights with fp32 masters: as the same ramstream run without the
change), frozen parameters included, and the weights then live in host memory between uses."""

from __future__ import annotations

import pytest
import torch

import ramstream
from ramstream.engine.restream import stream_buckets, streamable
from ramstream.runtime.apply import StreamLever
from ramstream.runtime.inspect import plan_for
from ramstream.weights.setup import streamed_ids

from _models import batches, clone, gpu_profile, make_model, train_torch

LR = 3e-3
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)]


def _wrap(ref, device: str, **options):
    """A clone of `ref` wrapped with a plan made on an injected GPU profile (so that wrap() lays the
    buckets out by block), offload=True (no resident switch on a GPU)."""
    plan = plan_for(ref, profile=gpu_profile(64), batch=2, seq=8)
    model = clone(ref).to(device)
    params = [p for p in model.parameters() if p.requires_grad]
    model, opt = ramstream.wrap(
        model, torch.optim.AdamW(params, lr=LR), device=device, plan=plan, offload=True, bucket_bytes=1 << 16,
        **options,
    )  # fmt: skip
    return model, opt, plan


def _lora_like(dtype):
    """A 4-block model whose every block's fc1 is frozen (a LoRA-like base), in `dtype`."""
    m = make_model(0, n_blocks=4, d=64, dtype=dtype)
    for b in m.blocks:
        b.fc1.requires_grad_(False)
    return m


def _on(device, data):
    return [(x.to(device), y.to(device)) for x, y in data]


def _stream(model, plan, indices):
    w = model._ramstream
    StreamLever(model, w, list(model.blocks)).stream(indices, plan)


@pytest.mark.parametrize("device", DEVICES)
def test_blocks_that_start_streaming_mid_run_train_as_torch(device):
    ref = make_model(0, n_blocks=6, d=64)
    model, opt, plan = _wrap(ref, device)
    assert not any(b.streamed for b in opt._engine.buckets)
    data = _on(device, batches(6, b=2, t=8, seed=3))
    torch_model = clone(ref).to(device)
    want = train_torch(torch_model, torch.optim.AdamW(torch_model.parameters(), lr=LR, fused=True), data)
    got = train_torch(model, opt, data[:2])
    _stream(model, plan, [3, 5])
    got += train_torch(model, opt, data[2:4])
    _stream(model, plan, [1, 3, 5])  # more again: the streamer keeps the earlier blocks
    got += train_torch(model, opt, data[4:])
    if device == "cpu":
        assert got == want
    for p, q in zip(torch_model.parameters(), model.parameters()):
        if device == "cpu":
            assert torch.equal(p.detach(), q.detach())
        else:  # the host AdamW vs torch's CUDA kernel: the same rule, other roundings; a streamed
            # block's weights are at home in host memory between steps: compare on the GPU
            torch.testing.assert_close(p.detach(), q.detach().to(p.device), rtol=0, atol=1e-5)
    w = model._ramstream
    assert sorted(b.index for b in w.streamer.blocks) == [1, 3, 5]
    assert w.plan["weights"]["streamed"] == [1, 3, 5] and w.plan["weights"]["resident"] == [0, 2, 4]
    homes = {
        s.home.untyped_storage().data_ptr(): s.home for b in w.streamer.blocks for s in b.slabs
    }  # between steps a streamed block's weights are views of its slabs' homes in host memory
    for i, blk in enumerate(model.blocks):
        for p in blk.parameters():
            if i in (1, 3, 5):
                assert p.device.type == "cpu" and p.untyped_storage().data_ptr() in homes, i
            else:
                assert p.device.type == device and p.untyped_storage().data_ptr() not in homes, i
                assert p.untyped_storage().nbytes() > 0, i


def test_bf16_weights_keep_their_fp32_masters_and_frozen_weights_stream_too():
    """bf16 weights (fp32 masters on the host, a separate copy), a LoRA-like frozen fc1 in every
    block: the run that streams blocks 2-3 from step 3 equals the one that never streams them."""

    data = batches(5, b=2, t=8, seed=4)
    a, opt_a, _ = _wrap(_lora_like(torch.bfloat16), "cpu")
    want = train_torch(a, opt_a, data)
    b, opt_b, plan = _wrap(_lora_like(torch.bfloat16), "cpu")
    got = train_torch(b, opt_b, data[:2])
    _stream(b, plan, [2, 3])
    got += train_torch(b, opt_b, data[2:])
    assert got == want
    for p, q in zip(a.state_dict().values(), b.state_dict().values()):
        assert torch.equal(p, q)
    for x, y in zip(opt_a.master_weights(), opt_b.master_weights()):
        assert torch.equal(x, y)
    blocks = b._ramstream.streamer.blocks
    frozen = [p for blk in blocks for s in blk.slabs for p in s.params if not p.requires_grad]
    assert {id(p) for p in frozen} == {id(blk.fc1.weight) for blk in b.blocks[2:]} | {
        id(blk.fc1.bias) for blk in b.blocks[2:]
    }


def test_a_bucket_spanning_blocks_is_refused_and_nothing_changes():
    """Without a plan wrap() does not lay the buckets out by block: asking to stream one block
    whose bucket it shares with another raises, naming why, before anything moved."""
    model = make_model(0, n_blocks=4, d=16)
    model, opt = ramstream.wrap(model, torch.optim.AdamW(model.parameters(), lr=LR), device="cpu")
    engine = opt._engine
    assert engine.block_of == {}
    ids = streamed_ids(model, list(model.blocks), [1], lambda m: None)
    with pytest.raises(ValueError, match="spans a block boundary"):
        stream_buckets(engine, ids)
    assert not any(b.streamed for b in engine.buckets)
    with pytest.raises(ValueError, match="spans a block boundary"):
        streamable(engine, ids)


def test_stream_lever_is_not_offered_with_delayed_update_or_fixed_param_offload():
    ref = make_model(0, n_blocks=4, d=64)
    _, opt, _ = _wrap(ref, "cpu", delayed_update=True)
    assert opt._engine.block_of == {}
    _, opt, _ = _wrap(ref, "cpu", param_offload=[0])
    assert opt._engine.block_of == {}


@pytest.mark.parametrize("fail_at", [2, 3], ids=["frozen-home", "trained-home"])
def test_host_memory_refusing_a_home_changes_nothing_and_training_goes_on(monkeypatch, fail_at):
    """Host memory refuses the second frozen slab's home, or the first trained bucket's: a
    MemoryError, the frozen weights already moved are back where they were, no bucket streams, and
    training goes on exactly as the run that never tried."""
    from ramstream.weights.slab import Copier

    data = batches(4, b=2, t=8, seed=5)
    a, opt_a, _ = _wrap(_lora_like(torch.float32), "cpu")
    want = train_torch(a, opt_a, data)
    b, opt_b, plan = _wrap(_lora_like(torch.float32), "cpu")
    got = train_torch(b, opt_b, data[:2])
    before = {k: v.clone() for k, v in b.state_dict().items()}
    calls = [0]
    real = Copier.host_buffer

    def refuse(self, numel, dtype):
        calls[0] += 1
        if calls[0] == fail_at:
            raise RuntimeError("CUDA error: out of memory (pinned host allocation)")
        return real(self, numel, dtype)

    monkeypatch.setattr(Copier, "host_buffer", refuse)
    with pytest.raises(MemoryError, match="streaming blocks 2-3|pinned host memory"):
        _stream(b, plan, [2, 3])
    monkeypatch.setattr(Copier, "host_buffer", real)
    assert not any(x.streamed for x in opt_b._engine.buckets) and b._ramstream.streamer is None
    for k, v in b.state_dict().items():
        assert torch.equal(v, before[k]), k
    got += train_torch(b, opt_b, data[2:])
    assert got == want
    for p, q in zip(a.parameters(), b.parameters()):
        assert torch.equal(p.detach(), q.detach())
