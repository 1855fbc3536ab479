"""activation_checkpointing="auto" decides from sizes (activations/recompute.py): the LoRA rule
and the full fine-tuning rule, on injected GPU sizes (no GPU needed: the rules only read them)."""

from __future__ import annotations

import pytest
import torch

import ramstream.hardware as hardware
from ramstream.activations.recompute import auto_checkpointing

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


def test_a_full_fine_tune_that_recomputes_every_block_keeps_70_percent_of_weights_resident(monkeypatch):
    """param_offload="auto" streams blocks of a full fine-tune above 50 % of the GPU, or above 70 %
    when every block recomputes (its activations then take little room)."""
    from ramstream.activations.recompute import recomputes_every_block
    from ramstream.weights.setup import choose_streamed

    model = make_model(0, n_blocks=4)
    blocks = list(model.blocks)
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    free = int(weights / 0.6 / 0.9)  # the weights are 60 % of what may be used
    mem = {"total": free, "cap": free, "free": free, "reserved": 0, "allocated": 0}
    monkeypatch.setattr(hardware, "gpu_memory", lambda device: dict(mem))
    monkeypatch.setattr(hardware, "kernels_problem", lambda: None)
    log = []
    assert choose_streamed(model, blocks, "auto", CUDA, 0.1, log.append) != []
    assert choose_streamed(model, blocks, "auto", CUDA, 0.1, log.append, recompute_all=True) == []
    # weights + moments + gradients exceed 90 % of the GPU: "auto" recomputes every block
    assert recomputes_every_block(model, blocks, CUDA, "auto")
    assert recomputes_every_block(model, blocks, CUDA, True)
    assert not recomputes_every_block(model, blocks, CUDA, False)
    assert not recomputes_every_block(model, blocks, CUDA, "auto", optimizer_mode="cpu")


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
