"""activation_checkpointing="auto" decides from sizes without a plan (runtime/inspect.py counts the
live model, planner/wrap_rules.py decides): the LoRA rule and the full fine-tuning rule, on
injected GPU sizes (no GPU needed: the rules only read them)."""

from __future__ import annotations

import pytest
import torch

import ramstream.hardware as hardware
from ramstream.runtime.inspect import auto_checkpointing, recompute_rule

from _models import make_model

CUDA = torch.device("cuda", 0)


@pytest.fixture
def gpu(monkeypatch):
    """Injects the usable bytes of a GPU that has ramstream's kernels."""
    state = {"cap": 0}
    monkeypatch.setattr(hardware, "gpu_memory", lambda device: {"cap": state["cap"]})
    monkeypatch.setattr(hardware, "kernels_problem", lambda: None)
    return state


def _sizes(model):
    ps = list(model.parameters())
    weights = sum(p.numel() * p.element_size() for p in ps)
    state = sum(p.numel() * (8 + p.element_size()) for p in ps if p.requires_grad)
    return weights, state


def test_full_fine_tuning_recomputes_only_when_the_state_cannot_be_resident(gpu):
    model = make_model(0, n_blocks=3)
    blocks, log = list(model.blocks), []
    weights, state = _sizes(model)
    gpu["cap"] = int((weights + state) / 0.9) + 1  # everything fits: resident, no recompute
    assert not auto_checkpointing(model, blocks, CUDA, log.append)
    gpu["cap"] = int((weights + state) / 0.9) - 1024  # it does not: recompute to make room
    assert auto_checkpointing(model, blocks, CUDA, log.append)
    assert "full fine-tuning" in log[-1] and "share of the optimizer state" in log[-1]
    assert not auto_checkpointing(model, blocks, CUDA, log.append, optimizer_mode="cpu")
    assert not auto_checkpointing(model, blocks, torch.device("cpu"), log.append)


def test_hugging_faces_own_checkpointing_turns_the_rule_off(gpu):
    model = make_model(0, n_blocks=3)
    weights, state = _sizes(model)
    gpu["cap"] = int((weights + state) / 0.9) - 1024
    blocks = list(model.blocks)
    assert auto_checkpointing(model, blocks, CUDA, lambda m: None)
    blocks[1].gradient_checkpointing = True
    log = []
    assert not auto_checkpointing(model, blocks, CUDA, log.append) and log == []
    assert recompute_rule(model, blocks, CUDA).rule == "hf checkpointing"


def test_full_fine_tuning_rule_needs_the_cuda_kernels(gpu, monkeypatch):
    model = make_model(0, n_blocks=3)
    weights, state = _sizes(model)
    gpu["cap"] = int((weights + state) / 0.9) - 1024
    monkeypatch.setattr(hardware, "kernels_problem", lambda: "a build without CUDA kernels")
    assert not auto_checkpointing(model, list(model.blocks), CUDA, lambda m: None)


def test_lora_like_models_recompute_when_their_weights_fill_a_quarter(gpu):
    model = make_model(0, n_blocks=3)
    for name, p in model.named_parameters():
        p.requires_grad_(name.endswith("bias") and "blocks.0." in name)
    blocks = list(model.blocks)
    nbytes = sum(p.numel() * p.element_size() for b in blocks for p in b.parameters())
    gpu["cap"] = 4 * nbytes - 4
    assert auto_checkpointing(model, blocks, CUDA, lambda m: None)
    gpu["cap"] = 4 * nbytes + 4
    assert not auto_checkpointing(model, blocks, CUDA, lambda m: None)


def test_a_full_fine_tune_that_recomputes_every_block_keeps_70_percent_of_weights_resident(gpu):
    """param_offload="auto" (the planner's policy.auto_streamed) streams blocks of a full fine-tune
    above 50 % of the GPU, or above 70 % when every block recomputes (its activations then take
    little room)."""
    from ramstream.planner.policy import auto_streamed
    from ramstream.runtime.inspect import model_shape

    model = make_model(0, n_blocks=4)
    blocks = list(model.blocks)
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    usable = int(weights / 0.6 / 0.9)  # the weights are 60 % of what may be used
    shape = model_shape(model, blocks, batch=1, seq=8, loss="dense")
    assert shape.weight_bytes == weights
    k, room = auto_streamed(shape, usable, 0.1, lambda part: part.weight_bytes)
    assert k > 0 and room == pytest.approx(usable * 0.9 * 0.5)
    resident = weights - sum(p.numel() * p.element_size() for b in blocks[:k] for p in b.parameters())
    assert resident <= room < resident + sum(p.numel() * p.element_size() for p in blocks[k - 1].parameters())
    k, room = auto_streamed(shape, usable, 0.1, lambda part: part.weight_bytes, recompute_all=True)
    assert k == 0 and room == pytest.approx(usable * 0.9 * 0.7)
    # weights + moments and gradients exceed 90 % of the GPU: "auto" recomputes every block
    gpu["cap"] = usable
    assert recompute_rule(model, blocks, CUDA).on
    assert not recompute_rule(model, blocks, CUDA, optimizer_mode="cpu").on


def test_a_quantized_lora_base_counts_its_packed_weights(gpu):
    """A LoRA-like model whose frozen block weights are quantized (packed buffers, no longer
    parameters): the trained share counts the packed weights' full-precision elements, the bytes
    their packed size (the 14B NF4 LoRA ran out of memory on the H200 when they were not counted:
    the rule saw only the adapters and norms and recomputed nothing)."""
    from ramstream import quantize_model
    from ramstream.quant.packed import packed_buffers

    model = make_model(0, n_blocks=3)
    for p in model.parameters():
        p.requires_grad_(False)
    blocks = list(model.blocks)
    quantize_model(model, "int8", block_size=64)
    for b in blocks:  # a small trained part per block (an adapter's share)
        next(p for n, p in b.named_parameters() if n.endswith("bias")).requires_grad_(True)
    packed = sum(t.nbytes for b in blocks for _, _, t in packed_buffers(b))
    assert packed > 0
    nbytes = packed + sum(p.numel() * p.element_size() for b in blocks for p in b.parameters())
    gpu["cap"] = 4 * nbytes - 4
    assert auto_checkpointing(model, blocks, CUDA, lambda m: None)
    gpu["cap"] = 4 * nbytes + 4
    assert not auto_checkpointing(model, blocks, CUDA, lambda m: None)
