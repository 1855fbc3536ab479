"""Streamed weights (param_offload) with Hugging Face models on the CPU engine: Llama and GPT-2
(tied embeddings), HF gradient checkpointing, and a peft LoRA model whose frozen base streams;
each bit-identical to the same run with every weight resident."""

from __future__ import annotations

import copy

import pytest
import torch

pytest.importorskip("transformers")

import ramstream
from test_hf_integration import _batches, _checkpointing, _gpt2, _llama, _lora, _train


def _run(model, offload, paging=False):
    model, opt = ramstream.wrap(
        model,
        torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=3e-3),
        device="cpu",
        param_offload=offload,
        activation_offload=paging,
        min_offload_bytes=0,
    )
    torch.manual_seed(3)  # GPT-2's dropout masks: the same stream in both runs
    losses = _train(model, opt, _batches(4))
    return model, losses, ramstream.memory_report(model)


@pytest.mark.parametrize("make", [_llama, _gpt2, _lora], ids=["llama", "gpt2", "lora"])
@pytest.mark.parametrize("checkpoint", [None, False], ids=["plain", "hf-checkpointing"])
def test_streamed_hf_models_train_bit_identically(make, checkpoint):
    base = make()
    if checkpoint is not None:
        _checkpointing(base, reentrant=checkpoint)
    a, la, _ = _run(copy.deepcopy(base), False)
    b, lb, rb = _run(base, True)
    assert la == lb
    for (na, pa), (nb, pb) in zip(a.state_dict().items(), b.state_dict().items()):
        assert na == nb and torch.equal(pa, pb), na
    assert rb["params"]["streamed_blocks"] == [0, 1, 2]
    assert rb["params"]["loads"] >= 4 * 3


def test_lora_streams_the_frozen_base_and_trains_only_adapters():
    base = _lora()
    frozen = {n: p.detach().clone() for n, p in base.named_parameters() if not p.requires_grad}
    model, losses, rep = _run(base, True, paging=True)
    assert losses[-1] < losses[0]
    for n, p in model.named_parameters():
        if n in frozen:
            assert torch.equal(p.detach(), frozen[n]), n  # the base never changes
    st = model._ramstream.streamer
    frozen_bytes = sum(s.nbytes for blk in st.blocks for s in blk.slabs if not s.params[0].requires_grad)
    assert frozen_bytes > 0


@pytest.mark.parametrize("make", [_llama, _lora], ids=["llama", "lora"])
def test_wrap_checkpointing_of_hf_layers_streamed_equals_the_plain_run(make):
    """activation_checkpointing on HF decoder layers (keyword arguments: attention mask, position
    embeddings) with their weights streamed: the same losses and weights as keeping everything."""
    base = make()
    a, la, _ = _run(copy.deepcopy(base), False)
    model, opt = ramstream.wrap(
        base,
        torch.optim.AdamW([p for p in base.parameters() if p.requires_grad], lr=3e-3),
        device="cpu",
        param_offload=True,
        activation_checkpointing=True,
    )
    torch.manual_seed(3)
    lb = _train(model, opt, _batches(4))
    assert la == lb
    for (na, pa), (_nb, pb) in zip(a.state_dict().items(), model.state_dict().items()):
        assert torch.equal(pa, pb), na
