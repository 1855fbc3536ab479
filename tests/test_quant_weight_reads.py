"""Reading a quantized layer's ``weight`` (quant/packed.py _LastRead): peft's get_peft_model over a
quantized model expands each weight once (it read every one about 20 times), gives the model
peft gives over the dequantized weights, and a read never serves stale or inference-mode values."""

from __future__ import annotations

import copy

import pytest
import torch

import ramstream
import ramstream.quant.packed as packed
from ramstream.quant import is_quantized
from test_quantize_model import _batch, _llama, _lora

from _quant_helpers import assert_bits_equal

pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning")


@pytest.fixture
def expansions(monkeypatch):
    """The modules whose weight was expanded, one entry per expansion (none kept before)."""
    packed.LAST_READ.drop()
    seen = []
    inner = packed._dequantize_into
    monkeypatch.setattr(packed, "_dequantize_into", lambda m, out: seen.append(m) or inner(m, out))
    return seen


def _quantized(layers=2):
    model = _llama(layers=layers)
    model.requires_grad_(False)
    ramstream.quantize_model(model, "nf4")
    return model


def test_get_peft_model_expands_each_quantized_weight_once(expansions):
    model = _quantized()
    ref = copy.deepcopy(model)
    ramstream.dequantize_model(ref)  # the same values as plain weights
    bases = [m for m in model.modules() if is_quantized(m)]
    expansions.clear()
    lora = _lora(model)
    assert len(bases) == 14
    counts = {id(m): 0 for m in bases}
    for m in expansions:
        counts[id(m)] += 1
    assert set(counts.values()) == {1}, sorted(counts.values())  # 21 each before _LastRead
    ref_lora = _lora(ref)
    ids = _batch()
    out = lora(input_ids=ids, labels=ids)
    want = ref_lora(input_ids=ids, labels=ids)
    assert_bits_equal(out.logits, want.logits)
    out.loss.backward()
    want.loss.backward()
    got = {n: p.grad for n, p in lora.named_parameters() if p.requires_grad}
    ref_g = {n: p.grad for n, p in ref_lora.named_parameters() if p.requires_grad}
    assert got.keys() == ref_g.keys() and got
    for n in got:
        assert_bits_equal(got[n], ref_g[n])
    assert packed.LAST_READ._weight is None  # the forward let the kept expansion go


def test_reads_share_one_expansion_until_something_changes(expansions):
    model = _quantized()
    lin = model.model.layers[0].self_attn.q_proj
    other = model.model.layers[1].mlp.up_proj
    ref = packed.expand_weight(lin, reuse=False)
    expansions.clear()
    a, b = lin.weight, lin.weight
    assert a is not b and not a.requires_grad and len(expansions) == 1
    assert_bits_equal(a, ref)
    a.mul_(2)  # a write through a read: the next read expands again
    c = lin.weight
    assert len(expansions) == 2
    assert_bits_equal(c, ref)
    _ = other.weight, lin.weight  # one weight is kept: another module's read replaced it
    assert len(expansions) == 4
    sd = {"weight": torch.randn(lin.quant_shape, dtype=lin.quant_dtype)}
    lin.load_state_dict(sd)  # new codes
    fresh = packed.expand_weight(lin, reuse=False)
    assert_bits_equal(lin.weight, fresh)
    assert not torch.equal(fresh, ref)


def test_a_read_under_inference_mode_is_not_kept(expansions):
    model = _quantized()
    lin = model.model.layers[0].mlp.down_proj
    with torch.inference_mode():
        w = lin.weight
        assert w.is_inference()
    assert packed.LAST_READ._weight is None
    x = torch.randn(3, lin.quant_shape[1], requires_grad=True)
    y = torch.nn.functional.linear(x, lin.weight)  # a normal tensor: autograd may save it
    y.sum().backward()
    torch.testing.assert_close(x.grad, torch.ones(3, lin.quant_shape[0]) @ lin.weight)


def test_dequantize_model_lets_the_kept_expansion_go(expansions):
    model = _quantized()
    _ = model.model.layers[0].self_attn.o_proj.weight
    assert packed.LAST_READ._weight is not None
    ramstream.dequantize_model(model)
    assert packed.LAST_READ._weight is None
