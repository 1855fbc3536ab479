"""wrap(param_offload=...): streamed blocks train bit-identically to the same run with every weight
resident, and never hold all block weights on the device at once (CPU engine here; the same
tests marked `cuda` run on a GPU)."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

import ramstream

from _models import Block, TinyGPT

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)]


class CkptBlock(Block):
    """A block that recomputes its MLP in backward (activation checkpointing inside the block)."""

    def forward(self, x):
        return x + checkpoint(lambda h: self.fc2(F.gelu(self.fc1(h))), self.ln(x), use_reentrant=False)


def _model(kind: str, dtype: torch.dtype):
    torch.manual_seed(0)
    m = TinyGPT(vocab=64, d=32, n_blocks=5, tied=True)
    if kind == "ckpt":
        for i in range(len(m.blocks)):
            b = CkptBlock(32)
            b.load_state_dict(m.blocks[i].state_dict())
            m.blocks[i] = b
    if kind == "frozen":  # a LoRA-like base: every block's fc1 is frozen
        for b in m.blocks:
            b.fc1.requires_grad_(False)
    return m.to(dtype)


def _batches(n: int, device):
    g = torch.Generator().manual_seed(1)
    return [(torch.randint(0, 64, (4, 12), generator=g).to(device),) * 2 for _ in range(n)]


def _train(m, device, steps=10, **options):
    params = [p for p in m.parameters() if p.requires_grad]
    # offload=True: on a GPU the unstreamed run would switch to torch's fused AdamW after two
    # steps (streamed runs never do), whose rounding differs from the host AdamW's
    options.setdefault("offload", True)
    model, opt = ramstream.wrap(m, torch.optim.AdamW(params, lr=1e-2), device=device, **options)
    accum = options.get("accumulation_steps", 1)
    losses = []
    for idx, tgt in _batches(steps * accum, device):
        loss = model(idx, tgt)
        loss.backward()
        losses.append(loss.item())
        if len(losses) % accum == 0:
            opt.step()
            opt.zero_grad()
    opt.synchronize()
    sd = {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}
    return model, opt, sd, losses


CONFIGS = [
    ("plain", torch.float32, {}),
    ("plain", torch.bfloat16, {}),
    ("ckpt", torch.float32, {}),
    ("frozen", torch.float32, {}),
    ("plain", torch.float32, {"max_grad_norm": 0.05}),
    ("plain", torch.float32, {"accumulation_steps": 2}),
    ("plain", torch.float32, {"activation_offload": True, "min_offload_bytes": 0}),
    ("plain", torch.float32, {"weight_window": 3}),
    ("plain", torch.float32, {"activation_checkpointing": True}),
]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kind,dtype,extra", CONFIGS, ids=lambda v: str(v).replace("torch.", ""))
def test_streamed_blocks_train_bit_identically(device, kind, dtype, extra):
    m = _model(kind, dtype)
    _, _, ref, ref_losses = _train(copy.deepcopy(m), device, param_offload=False, **extra)
    model, opt, got, losses = _train(m, device, param_offload=True, **extra)
    assert losses == ref_losses
    for k in ref:
        assert torch.equal(ref[k], got[k]), k
    st = ramstream.memory_report(model)["params"]
    assert st["streamed_blocks"] == [0, 1, 2, 3, 4]
    assert st["loads"] >= 10 * 5  # every block at least once per step
    # never all block weights on the device at once: at most the window and the block in use
    block_bytes = sum(p.numel() * p.element_size() for p in m.blocks[0].parameters())
    window = extra.get("weight_window", 2)
    assert st["stream"]["peak_loaded_bytes"] <= (window + 2) * block_bytes * 1.05
    assert st["stream"]["peak_loaded_bytes"] < 5 * block_bytes or window >= 3


@pytest.mark.parametrize("device", DEVICES)
def test_part_of_the_stack_streamed_equals_all_resident(device):
    m = _model("plain", torch.float32)
    _, _, ref, _ = _train(copy.deepcopy(m), device, param_offload=False)
    for option, expect in (([1, 3], [1, 3]), (0.4, [0, 1])):
        model, opt, got, _ = _train(copy.deepcopy(m), device, param_offload=option)
        assert ramstream.memory_report(model)["params"]["streamed_blocks"] == expect
        assert all(torch.equal(ref[k], got[k]) for k in ref)


def test_evicted_weights_live_in_host_memory_and_state_dict_reads_them():
    m = _model("plain", torch.float32)
    model, opt, sd, _ = _train(m, "cpu", steps=2, param_offload=True)
    w = model.blocks[2].fc1.weight
    slab = next(s for b in model._ramstream.streamer.blocks for s in b.slabs if any(p is w for p in s.params))
    assert not slab.loaded and slab.flat.untyped_storage().nbytes() == 0
    assert w.data_ptr() >= slab.home.data_ptr() and w.data_ptr() < slab.home.data_ptr() + slab.home.nbytes
    assert torch.equal(sd["blocks.2.fc1.weight"], w.detach())


def test_load_state_dict_into_streamed_model_then_resume_equals_uninterrupted():
    m = _model("plain", torch.float32)
    _, _, ref, ref_losses = _train(copy.deepcopy(m), "cpu", steps=6, param_offload=False)
    model, opt, sd3, _ = _train(copy.deepcopy(m), "cpu", steps=3, param_offload=True)
    osd = opt.state_dict()
    fresh = _model("plain", torch.float32)
    model2, opt2 = ramstream.wrap(
        fresh, torch.optim.AdamW(fresh.parameters(), lr=1e-2), device="cpu", param_offload=True
    )
    model2.load_state_dict(sd3)
    opt2.load_state_dict(osd)
    losses = []
    for idx, tgt in _batches(6, "cpu")[3:]:
        loss = model2(idx, tgt)
        loss.backward()
        losses.append(loss.item())
        opt2.step()
        opt2.zero_grad()
    opt2.synchronize()
    got = model2.state_dict()
    assert losses == ref_losses[3:]
    assert all(torch.equal(ref[k], got[k].cpu()) for k in ref)


def test_unwrap_leaves_a_plain_model_with_the_trained_weights():
    m = _model("plain", torch.float32)
    model, opt, sd, _ = _train(m, "cpu", steps=3, param_offload=True)
    plain = ramstream.unwrap(model)
    assert all(torch.equal(sd[k], v) for k, v in plain.state_dict().items())
    idx, tgt = _batches(1, "cpu")[0]
    plain(idx, tgt).backward()  # trains as a plain module
    assert plain.blocks[0].fc1.weight.grad is not None


def test_to_on_a_streamed_model_keeps_streaming_and_refuses_a_dtype_change():
    m = _model("plain", torch.float32)
    model, opt, sd, _ = _train(m, "cpu", steps=2, param_offload=True)
    model.to("cpu")
    assert ramstream.memory_report(model)["params"]["streamed_blocks"] == [0, 1, 2, 3, 4]
    with pytest.raises(RuntimeError, match="streamed weights"):
        model.to(torch.bfloat16)
    assert model.blocks[0].fc1.weight.dtype == torch.float32


def test_a_failed_backward_leaves_nothing_loaded_and_training_goes_on():
    from _models import Boom

    m = _model("plain", torch.float32)
    model, opt = ramstream.wrap(
        m, torch.optim.AdamW(m.parameters(), lr=1e-2), device="cpu", param_offload=True, eager_updates=False
    )
    idx, tgt = _batches(1, "cpu")[0]
    orig = model.blocks[2].forward
    model.blocks[2].forward = lambda x: Boom.apply(orig(x))
    Boom.armed = True
    try:
        with pytest.raises(RuntimeError):
            model(idx, tgt).backward()
    finally:
        Boom.armed = False
        model.blocks[2].forward = orig
    model(idx, tgt).backward()  # the failed pass is dropped when the next one starts
    st = model._ramstream.streamer
    assert st.loaded_bytes() == 0
    opt.step()
    opt.synchronize()


@pytest.mark.parametrize(
    "value", ["yes", 1.5, -0.1, [0, "a"], None, {"blocks": 1}], ids=lambda v: type(v).__name__ + str(v)
)
def test_bad_param_offload_values_name_the_accepted_ones(value):
    m = _model("plain", torch.float32)
    with pytest.raises(ValueError, match="param_offload"):
        ramstream.wrap(m, device="cpu", param_offload=value)


def test_block_index_out_of_range_says_how_many_blocks_there_are():
    m = _model("plain", torch.float32)
    with pytest.raises(ValueError, match="5 blocks"):
        ramstream.wrap(m, device="cpu", param_offload=[0, 7])


def test_auto_on_the_cpu_streams_nothing():
    m = _model("plain", torch.float32)
    model, _ = ramstream.wrap(m, device="cpu")
    assert ramstream.memory_report(model)["params"]["streamed_blocks"] == []


@pytest.mark.cuda
def test_a_model_built_on_the_cpu_never_holds_all_block_weights_on_the_gpu():
    torch.manual_seed(0)
    m = TinyGPT(vocab=256, d=256, n_blocks=8, tied=False)
    block_bytes = sum(p.numel() * 4 for p in m.blocks[0].parameters())
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    model, opt = ramstream.wrap(m, torch.optim.AdamW(m.parameters()), device="cuda", param_offload=True)
    for idx, tgt in _batches(3, "cuda"):
        model(idx % 256, tgt % 256).backward()
        opt.step()
        opt.zero_grad()
    opt.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    assert ramstream.memory_report(model)["params"]["stream"]["peak_loaded_bytes"] <= 3 * block_bytes
    assert peak < 8 * block_bytes, (peak, block_bytes)


@pytest.mark.parametrize("device", DEVICES)
def test_activation_checkpointing_equals_keeping_activations(device):
    m = _model("plain", torch.float32)
    _, _, ref, ref_losses = _train(copy.deepcopy(m), device, param_offload=True)
    model, _, got, losses = _train(m, device, param_offload=True, activation_checkpointing=[0, 2, 4])
    assert losses == ref_losses and all(torch.equal(ref[k], got[k]) for k in ref)
    assert ramstream.memory_report(model)["plan"]["recompute"] == [0, 2, 4]
    plain = ramstream.unwrap(model)
    assert "forward" not in plain.blocks[0].__dict__  # the checkpointed forward is gone


def test_checkpointed_blocks_keep_only_their_inputs():
    """Saved-tensor count: a checkpointed block saves its input only (the recompute saves the rest
    in backward)."""
    m = _model("plain", torch.float32)
    model, _ = ramstream.wrap(m, device="cpu", activation_checkpointing=True, param_offload=False)
    idx, tgt = _batches(1, "cpu")[0]
    counts = []

    def pack(t):
        counts.append(t.numel())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(idx, tgt)
    saved_ckpt = len(counts)
    ramstream.unwrap(model)
    counts.clear()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        m(idx, tgt)
    assert saved_ckpt < len(counts) - 5 * 4  # each of 5 blocks saves >= 5 tensors unchecked


@pytest.mark.parametrize("value", ["yes", 2.0, [1, "x"], None])
def test_bad_activation_checkpointing_values_name_the_accepted_ones(value):
    with pytest.raises(ValueError, match="activation_checkpointing"):
        ramstream.wrap(_model("plain", torch.float32), device="cpu", activation_checkpointing=value)


def test_memory_report_plan_says_where_the_optimizer_state_lives():
    m = _model("plain", torch.float32)
    model, opt, _, _ = _train(m, "cpu", steps=1, param_offload=[0, 1])
    plan = ramstream.memory_report(model)["plan"]
    engine = opt._engine
    streamed = sum(1 for b in engine.buckets if b.streamed)
    assert plan["optimizer"]["buckets"] == {
        "host": len(engine.buckets) - streamed,
        "mapped": 0,
        "device": 0,
        "streamed": streamed,
    }
    assert streamed >= 2 and plan["weights"]["streamed"] == [0, 1] and not plan["optimizer"]["resident"]
    assert plan["history"] == []  # offload=True: no switch decided


def test_streamed_blocks_under_autocast_train_as_the_unstreamed_model():
    """bf16 autocast (CPU) over fp32 weights: the streamer clears autocast's weight-cast cache
    after each block (it would keep every streamed block's cast alive): same results."""
    runs = []
    for offload in (False, True):
        m = _model("plain", torch.float32)
        model, opt = ramstream.wrap(
            m, torch.optim.AdamW(m.parameters(), lr=1e-2), device="cpu", param_offload=offload, offload=True
        )
        losses = []
        for idx, tgt in _batches(4, "cpu"):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = model(idx, tgt)
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
        opt.synchronize()
        runs.append((losses, {k: v.clone() for k, v in model.state_dict().items()}))
    assert runs[0][0] == runs[1][0]
    assert all(torch.equal(runs[0][1][k], runs[1][1][k]) for k in runs[0][1])
