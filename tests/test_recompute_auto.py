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
