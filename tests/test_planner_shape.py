"""ModelShape: parameter counts and bytes from a real nn.Module, the built-in GPT formula against a
built GPT's parameters, a Hugging Face config's counts by hand, LoRA, and the activation formula."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from ramstream.planner import ModelShape


class _Block(nn.Module):
    """A pre-norm GPT block (the architecture ModelShape.gpt describes)."""

    def __init__(self, d, heads):
        super().__init__()
        self.h = heads
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.fc, self.out = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.h, d // self.h).unbind(2)
        a = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True
        )
        x = x + self.proj(a.transpose(1, 2).reshape(b, t, d))
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class _GPT(nn.Module):
    def __init__(self, vocab, d, layers, heads, ctx, tied=False):
        super().__init__()
        self.wte, self.wpe = nn.Embedding(vocab, d), nn.Embedding(ctx, d)
        self.layers = nn.ModuleList(_Block(d, heads) for _ in range(layers))
        self.ln_f = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)
        if tied:
            self.head.weight = self.wte.weight


def _bytes(params) -> int:
    return sum(p.numel() * p.element_size() for p in params)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_from_model_counts_every_parameter_once(dtype):
    m = _GPT(vocab=97, d=32, layers=3, heads=4, ctx=40, tied=True).to(dtype)
    m.layers[1].fc.weight.requires_grad_(False)
    s = ModelShape.from_model(m, list(m.layers), batch=2, seq=16)
    unique = list({id(p): p for p in m.parameters()}.values())
    assert s.numel == sum(p.numel() for p in unique)
    assert s.weight_bytes == _bytes(unique)
    assert s.frozen_numel == 32 * 128 and s.blocks[1].frozen_matrix_numel == 32 * 128
    for blk, mod in zip(s.blocks, m.layers):
        assert blk.weight_bytes == _bytes(mod.parameters())
    assert s.embed.trained_numel == 97 * 32 + 40 * 32  # the tied head weight counted here, once
    assert s.head.trained_numel == 2 * 32  # ln_f only
    assert s.head.fwd_flops_per_token == 2 * 97 * 32  # but the head matmul still runs
    assert s.dtype == str(dtype).replace("torch.", "")


def test_from_model_finds_blocks_and_takes_given_activation_bytes():
    m = _GPT(vocab=50, d=16, layers=4, heads=2, ctx=8)
    s = ModelShape.from_model(m, batch=2, seq=8, act_bytes=[100, 200, 300, 400])
    assert len(s.blocks) == 4 and [s.act_bytes(i) for i in range(4)] == [100, 200, 300, 400]
    with pytest.raises(ValueError, match="act_bytes"):
        ModelShape.from_model(m, batch=2, seq=8, act_bytes=[1, 2])
    with pytest.raises(TypeError, match="nn.Module"):
        ModelShape.from_model("model", batch=1, seq=1)


@pytest.mark.parametrize("size,d,layers", [("125m", 768, 12), ("1.8b", 2048, 32), ("6.85b", 4096, 32)])
def test_gpt_formula_by_hand(size, d, layers):
    s = ModelShape.gpt(size, batch=1, seq=1024, dtype="fp32")
    per_block = 12 * d * d + 13 * d  # qkv 3d^2+3d, proj d^2+d, fc 4d^2+4d, out 4d^2+d, 2 LN 4d
    total = layers * per_block + 50304 * d + 1024 * d + 50304 * d + 2 * d
    assert s.numel == total and s.trained_numel == total and s.weight_bytes == 4 * total
    assert len(s.blocks) == layers


def test_gpt_formula_against_a_built_model():
    cfg = dict(d=64, layers=3, heads=4, ctx=32)
    s = ModelShape.gpt(cfg, batch=2, seq=32, dtype="bf16", vocab=101)
    m = _GPT(vocab=101, d=64, layers=3, heads=4, ctx=32).to(torch.bfloat16)
    assert s.numel == sum(p.numel() for p in m.parameters())
    assert s.weight_bytes == _bytes(m.parameters())
    assert s.blocks[0].trained_numel == sum(p.numel() for p in m.layers[0].parameters())
    ms = ModelShape.from_model(m, list(m.layers), batch=2, seq=32)
    assert ms.numel == s.numel and ms.blocks[0].fwd_flops_per_token == s.blocks[0].fwd_flops_per_token
    assert ms.act_bytes(0) == s.act_bytes(0) - 4 * 4 * 64  # from_model does not know the heads


def test_gpt_activation_formula_by_hand():
    d, heads, tokens = 2048, 16, 4 * 512
    s = ModelShape.gpt("1.8b", batch=4, seq=512, dtype="bf16")
    assert s.act_bytes(0) == tokens * (2 * 16 * d + 4 * heads + 16)
    assert s.boundary_bytes(0) == tokens * 2 * d
    assert s.logits_bytes == tokens * 50304 * (2 + 8)
    s2 = ModelShape.gpt("1.8b", batch=4, seq=512, dtype="bf16", loss="chunked")
    assert s2.logits_bytes == 1024 * 50304 * 10
    # flops: 2 x matmul params forward, + 2 seq d causal attention; backward twice both
    mm = 12 * d * d
    assert s.blocks[0].fwd_flops_per_token == 2 * mm + 2 * 512 * d
    assert s.blocks[0].bwd_flops_per_token == 4 * mm + 4 * 512 * d
    t = s.with_tokens(batch=1, seq=2048)
    assert t.tokens == 2048 and t.blocks[0].fwd_flops_per_token == 2 * mm + 2 * 2048 * d
    assert t.act_bytes(0) == 2048 * (2 * 16 * d + 4 * heads + 16)


QWEN7 = dict(
    model_type="qwen2", hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
    num_attention_heads=28, num_key_value_heads=4, vocab_size=152064, tie_word_embeddings=False,
)  # fmt: skip


def test_hf_config_counts_by_hand_and_lora(tmp_path):
    import json

    d, f, L, V, kv = 3584, 18944, 28, 152064, 4 * 128
    layer = d * d + 2 * d * kv + d * d + 3 * d * f + 2 * d + (d + 2 * kv)  # q,k,v,o, mlp, 2 norms, qkv bias
    total = L * layer + 2 * V * d + d
    s = ModelShape.from_hf_config(QWEN7, batch=1, seq=1024, dtype="bf16")
    assert s.numel == total and 7.6e9 < total < 7.7e9 and s.frozen_numel == 0
    (tmp_path / "config.json").write_text(json.dumps(QWEN7))
    lo = ModelShape.from_hf_config(tmp_path, batch=1, seq=1024, dtype="bf16", lora=16)
    adapters = 16 * ((d + d) + 2 * (d + kv) + (d + d) + 2 * (d + f) + (f + d))
    assert lo.trained_numel == L * adapters and lo.frozen_numel == total
    assert lo.blocks[0].frozen_matrix_numel == d * d + 2 * d * kv + d * d + 3 * d * f
    a = 1024 * (2 * (6 * d + 2 * kv + 4 * f + 7 * 16) + 4 * 28 + 16)
    assert lo.act_bytes(0) == a
    # a frozen base: backward computes input gradients only (2 x params), plus the adapters'
    mm = d * d + 2 * d * kv + d * d + 3 * d * f
    assert lo.blocks[0].bwd_flops_per_token == 2 * (mm + adapters) + 2 * adapters + 4 * 1024 * d


def test_shape_argument_errors():
    with pytest.raises(ValueError, match="accepted: 125m"):
        ModelShape.gpt("3b", batch=1, seq=1)
    with pytest.raises(ValueError, match="batch must be an int >= 1"):
        ModelShape.gpt("125m", batch=0, seq=1)
    with pytest.raises(ValueError, match="dtype"):
        ModelShape.gpt("125m", batch=1, seq=1, dtype="int8")
    with pytest.raises(ValueError, match="lacks hidden_size"):
        ModelShape.from_hf_config({"vocab_size": 3}, batch=1, seq=1)
    with pytest.raises(ValueError, match="loss"):
        ModelShape.gpt("125m", batch=1, seq=1, loss="sparse")
