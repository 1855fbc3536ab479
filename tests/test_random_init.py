"""integrations/random_init.py: load_model(random_weights=True)'s parallel draws have the
distribution asked for (against float64 statistics), are repeatable under torch.manual_seed, use
every span (no span left unwritten), and leave biases and padding rows zero; a quantize="none"
random model matches Hugging Face's own initialisation in distribution."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn as nn

from ramstream.integrations import random_init
from ramstream.integrations.random_init import init_module_, parallel_normal_


@pytest.mark.parametrize("threads", [1, 3, 8])
def test_parallel_normal_has_the_asked_distribution(threads, monkeypatch):
    monkeypatch.setattr(random_init, "PARALLEL_MIN", 1000)
    t = torch.full((1237, 1001), float("nan"))
    torch.manual_seed(0)
    parallel_normal_(t, 0.02, threads=threads)
    x = t.double().view(-1)
    assert torch.isfinite(x).all()  # every span written
    n = x.numel()
    assert abs(float(x.mean())) < 5 * 0.02 / math.sqrt(n)
    assert float(x.std()) == pytest.approx(0.02, rel=5 / math.sqrt(n))
    # each span on its own: its own generator, the same distribution
    for span in x.chunk(threads):
        assert float(span.std()) == pytest.approx(0.02, rel=0.02)
    if threads > 1:  # spans are not copies of one another
        a, b = x[: n // threads][:100], x[n // threads : 2 * (n // threads)][:100]
        assert not torch.equal(a, b)


def test_parallel_normal_is_repeatable_under_manual_seed(monkeypatch):
    monkeypatch.setattr(random_init, "PARALLEL_MIN", 1000)
    draws = []
    for _ in range(2):
        torch.manual_seed(7)
        draws.append(parallel_normal_(torch.empty(300, 400, dtype=torch.bfloat16), 0.5, threads=4))
    assert torch.equal(draws[0], draws[1])
    torch.manual_seed(8)
    assert not torch.equal(
        draws[0], parallel_normal_(torch.empty(300, 400, dtype=torch.bfloat16), 0.5, threads=4)
    )


def test_parameters_are_drawn_in_parallel_outside_grad_mode(monkeypatch):
    """A parameter (requires_grad) drawn in spans: the worker threads have their own grad mode
    (the H200 run raised "a view of a view which was created in no_grad mode" here)."""
    monkeypatch.setattr(random_init, "PARALLEL_MIN", 1000)
    lin = nn.Linear(300, 200)
    torch.manual_seed(0)
    with torch.no_grad():
        lin.weight.fill_(float("nan"))
    init_module_(lin, 0.02, None)
    assert lin.weight.requires_grad and torch.isfinite(lin.weight).all()
    assert 0.018 < float(lin.weight.std()) < 0.022
    parallel_normal_(lin.weight, 0.02, threads=4)  # also called outside no_grad
    assert torch.isfinite(lin.weight).all() and lin.weight.grad_fn is None


def test_init_module_linear_embedding_and_others():
    lin, emb, norm = nn.Linear(64, 32), nn.Embedding(50, 16, padding_idx=3), nn.LayerNorm(8)
    with torch.no_grad():
        lin.bias.fill_(1.0)
        norm.weight.fill_(5.0)
    calls = []
    for m in (lin, emb, norm):
        init_module_(m, 0.02, calls.append)
    assert calls == [norm]  # only the module that is neither Linear nor Embedding
    assert torch.equal(lin.bias, torch.zeros(32)) and torch.equal(emb.weight[3], torch.zeros(16))
    assert 0.015 < float(lin.weight.std()) < 0.025
    init_module_(lin, None, calls.append)  # no initializer_range: the model's own init
    assert calls[-1] is lin


def test_random_model_matches_hf_init_in_distribution(tmp_path):
    transformers = pytest.importorskip("transformers")
    from ramstream.integrations.huggingface import load_model

    conf = transformers.LlamaConfig(
        hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=1000, initializer_range=0.05,
    )  # fmt: skip
    conf.save_pretrained(tmp_path)
    torch.manual_seed(0)
    ours = load_model(str(tmp_path), quantize="none", random_weights=True, dtype=torch.float32)
    torch.manual_seed(0)
    ref = transformers.AutoModelForCausalLM.from_config(conf)
    got, want = dict(ours.named_parameters()), dict(ref.named_parameters())
    assert got.keys() == want.keys()
    for name, p in want.items():
        q = got[name]
        assert q.shape == p.shape and q.dtype == p.dtype, name
        if p.dim() == 2:  # Linear / Embedding weights: N(0, 0.05)
            assert float(q.double().std()) == pytest.approx(float(p.double().std()), rel=0.05), name
        else:  # norms: the model's own initialisation (ones)
            assert torch.equal(q, p), name
