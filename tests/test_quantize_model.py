"""quantize_model / dequantize_model: packed frozen block weights against independent references
(bitsandbytes' NF4 quantize/dequantize, ramstream.functional's int8, float64 matmuls), training
(plain torch and wrap()) bit for bit against a model whose weights were replaced by
dequantize(quantize(w)), state dicts, refusals."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
import torch.nn as nn

import ramstream
from ramstream.activations import find_blocks
from ramstream.functional import quantize_nf4
from ramstream.quant import is_quantized

from _quant_helpers import NF4_CODE, assert_bits_equal

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning")
VOCAB = 96


def _llama(seed=0, bias=False, layers=3):
    torch.manual_seed(seed)
    cls = transformers.Qwen2Config if bias else transformers.LlamaConfig
    cfg = cls(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        tie_word_embeddings=False,
    )
    return (transformers.Qwen2ForCausalLM if bias else transformers.LlamaForCausalLM)(cfg)


def _gpt2(seed=0):
    torch.manual_seed(seed)
    cfg = transformers.GPT2Config(
        vocab_size=VOCAB,
        n_embd=64,
        n_layer=2,
        n_head=4,
        n_positions=64,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
    )
    return transformers.GPT2LMHeadModel(cfg)


def _nf4_codes(w: torch.Tensor, block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """NF4 codes (one per element) and absmax from bitsandbytes' quantize_4bit where it is
    installed, else from ramstream's kernel (whose codes test_quant.py checks)."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            import bitsandbytes.functional as bf
        packed, st = bf.quantize_4bit(w.float().contiguous(), blocksize=block_size, quant_type="nf4")
        packed, absmax = packed.view(-1), st.absmax
    except ImportError:
        packed, absmax = quantize_nf4(w.contiguous(), block_size)
    codes = torch.stack([packed >> 4, packed & 15], 1).view(-1)[: w.numel()].long()
    return codes, absmax


def _roundtrip(w: torch.Tensor, fmt: str, block_size: int) -> torch.Tensor:
    """The reference weight dequantize(quantize(w)), computed without ramstream's dequantizer:
    NF4 codes from bitsandbytes and the NF4 table typed in by the tests; int8 in torch
    (round half to even of x / absmax * 127). bitsandbytes' own CPU dequantize_4bit is not used:
    for a (64, 96) weight it returns values that differ from its codes times absmax."""
    n = w.numel()
    scale_of = lambda a: a.repeat_interleave(block_size)[:n]  # noqa: E731
    if fmt == "nf4":
        codes, absmax = _nf4_codes(w, block_size)
        return (NF4_CODE[codes] * scale_of(absmax)).view(w.shape).to(w.dtype)
    x = w.detach().float().flatten()
    pad = torch.cat([x, x.new_zeros(-n % block_size)]).view(-1, block_size)
    absmax = pad.abs().amax(1)
    q = torch.where(absmax[:, None] > 0, torch.round((pad / absmax[:, None]) * 127), 0.0).flatten()[:n]
    q = q + 0.0  # the int8 code 0 is +0.0 (round(-0.3) is -0.0)
    return (q * scale_of(absmax / 127)).view(w.shape).to(w.dtype)


def _frozen_block_linears(model):
    blocks = find_blocks(model)
    return [
        (n, m)
        for b in blocks
        for n, m in b.named_modules()
        if hasattr(m, "weight")
        and isinstance(m.weight, torch.Tensor)
        and m.weight.dim() == 2
        and type(m).__name__ in ("Linear", "Conv1D")
    ]


def _reference_copy(model, fmt, block_size):
    """A deep copy whose frozen block weights are replaced by their quantize-dequantize round trip."""
    ref = copy.deepcopy(model)
    with torch.no_grad():
        for _, m in _frozen_block_linears(ref):
            if not m.weight.requires_grad:
                m.weight.copy_(_roundtrip(m.weight, fmt, block_size))
    return ref


def _batch(seed=1, b=2, t=12):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, VOCAB, (b, t), generator=g)


@pytest.mark.parametrize("fmt", ["nf4", "int8"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_forward_and_input_grad_equal_the_roundtrip_weights(fmt, dtype):
    torch.manual_seed(0)
    lin = nn.Linear(96, 40, dtype=dtype).requires_grad_(False)
    ref = _roundtrip(lin.weight, fmt, 32)
    rep = ramstream.quantize_model(
        nn.ModuleList([lin, nn.Linear(2, 2).requires_grad_(False)]), fmt, block_size=32
    )
    assert rep["tensors"] == 2 and is_quantized(lin)
    assert_bits_equal(lin.weight, ref)
    x = torch.randn(3, 5, 96, dtype=dtype, requires_grad=True)
    x_ref = x.detach().clone().requires_grad_()
    y, y_ref = lin(x), torch.nn.functional.linear(x_ref, ref, lin.bias)
    assert_bits_equal(y, y_ref)
    g = torch.randn_like(y)
    y.backward(g)
    y_ref.backward(g)
    assert_bits_equal(x.grad, x_ref.grad)
    # against float64: the expanded weight is what the product used
    y64 = x.detach().double() @ ref.double().t() + lin.bias.double()
    assert torch.allclose(
        y.double(),
        y64,
        rtol=2e-2 if dtype == torch.bfloat16 else 1e-5,
        atol=1e-2 if dtype == torch.bfloat16 else 1e-5,
    )


def test_nf4_codes_equal_bitsandbytes():
    bf = pytest.importorskip("bitsandbytes.functional")
    torch.manual_seed(3)
    lin = nn.Linear(128, 33).requires_grad_(False)
    w = lin.weight.detach().clone()
    ramstream.quantize_model(nn.ModuleList([lin, nn.Linear(1, 1).requires_grad_(False)]), "nf4")
    q, st = bf.quantize_4bit(w, blocksize=64, quant_type="nf4")
    assert torch.equal(lin.weight_codes, q.view(-1))
    assert torch.equal(lin.weight_absmax, st.absmax)


def _train(model, steps, opt_fn, wrap=False):
    opt = opt_fn([p for p in model.parameters() if p.requires_grad])
    if wrap:
        model, opt = ramstream.wrap(
            model, opt, device="cpu", param_offload=False, activation_checkpointing=False
        )
    losses = []
    for i in range(steps):
        ids = _batch(seed=i)
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.detach())
    if wrap:
        ramstream.unwrap(model)
    return losses, {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}


def _lora(model, lora_dropout=0.0):
    peft = pytest.importorskip("peft")
    torch.manual_seed(10)  # lora_A's init
    model = peft.get_peft_model(
        model,
        peft.LoraConfig(
            r=4,
            lora_alpha=8,
            lora_dropout=lora_dropout,
            target_modules=[
                "q_proj",
                "k_proj",
                "v_proj",
                "o_proj",
                "gate_proj",
                "up_proj",
                "down_proj",
                "c_attn",
                "c_proj",
                "c_fc",
            ],
        ),
    )
    g = torch.Generator().manual_seed(11)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.copy_(torch.randn(p.shape, generator=g) * 0.05)
    return model


@pytest.mark.parametrize("fmt", ["nf4", "int8"])
@pytest.mark.parametrize("build", ["llama", "qwen2", "gpt2"])
@pytest.mark.parametrize("wrap", [False, True], ids=["torch", "wrap"])
def test_lora_training_equals_training_on_dequantized_weights(fmt, build, wrap):
    base = {"llama": _llama, "qwen2": lambda: _llama(bias=True), "gpt2": _gpt2}[build]()
    base.requires_grad_(False)
    ref = _lora(_reference_copy(base, fmt, 64))
    n_expected = len(_frozen_block_linears(base))
    rep = ramstream.quantize_model(base, fmt)
    assert rep["tensors"] == n_expected > 0
    assert rep["bytes_after"] < rep["bytes_before"] / (3 if fmt == "nf4" else 1.5)
    model = _lora(base)  # peft wraps the quantized Linears
    assert any(is_quantized(m) for m in model.modules())
    opt = lambda ps: torch.optim.AdamW(ps, lr=1e-2, foreach=False)  # noqa: E731
    got_l, got_p = _train(model, 3, opt, wrap)
    ref_l, ref_p = _train(ref, 3, opt, wrap)
    for a, b in zip(got_l, ref_l):
        assert_bits_equal(a, b)
    assert got_p.keys() == ref_p.keys() and got_p
    for n in ref_p:
        assert_bits_equal(got_p[n], ref_p[n])


def test_only_frozen_block_weights_are_packed_and_trained_ones_skipped():
    model = _llama()
    model.requires_grad_(False)
    model.model.layers[1].mlp.up_proj.weight.requires_grad_(True)
    embed = model.model.embed_tokens.weight
    head = model.lm_head.weight
    rep = ramstream.quantize_model(model, "int8")
    assert not is_quantized(model.lm_head) and model.lm_head.weight is head
    assert model.model.embed_tokens.weight is embed
    assert not is_quantized(model.model.layers[1].mlp.up_proj)
    assert is_quantized(model.model.layers[1].mlp.down_proj)
    assert rep["tensors"] == 3 * 7 - 1


def test_a_trained_weight_asked_for_raises_naming_it():
    model = _llama()
    model.requires_grad_(False)
    model.model.layers[2].self_attn.k_proj.weight.requires_grad_(True)
    before = copy.deepcopy(model.state_dict())
    with pytest.raises(ValueError, match=r"model\.layers\.2\.self_attn\.k_proj\.weight requires grad"):
        ramstream.quantize_model(model, "nf4", blocks=list(model.model.layers))
    assert not any(is_quantized(m) for m in model.modules())  # nothing packed before the check
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k])


@pytest.mark.parametrize("bad", ["fp4", "NF4", None, 4])
def test_unknown_format_lists_accepted(bad):
    with pytest.raises(ValueError, match=r"quantize=.*accepted: 'int8', 'nf4'"):
        ramstream.quantize_model(_llama(), bad)


@pytest.mark.parametrize("bad", [63, 0, 1, -2, 64.0, True, "64"])
def test_bad_block_size_lists_accepted(bad):
    with pytest.raises(ValueError, match=r"block_size=.*accepted: an even integer"):
        ramstream.quantize_model(_llama(), "nf4", block_size=bad)


def test_state_dict_serves_dequantized_values_and_loads_back():
    model = _llama(bias=True)
    model.requires_grad_(False)
    keys = list(model.state_dict().keys())
    ref = _reference_copy(model, "nf4", 64).state_dict()
    ramstream.quantize_model(model, "nf4")
    sd = model.state_dict()
    assert list(sd.keys()) == keys
    for k in keys:
        assert_bits_equal(sd[k], ref[k])
    other = _llama(seed=5, bias=True).requires_grad_(False)
    ramstream.quantize_model(other, "nf4")
    other.load_state_dict(sd)
    for k, v in other.state_dict().items():
        assert_bits_equal(v, ref[k])


def test_dequantize_model_makes_permanent_weights():
    model = _gpt2()
    model.requires_grad_(False)
    ref = _reference_copy(model, "int8", 64)
    ramstream.quantize_model(model, "int8")
    n = ramstream.dequantize_model(model)
    assert n == 2 * 4
    assert not any(is_quantized(m) for m in model.modules())
    assert type(model.transformer.h[0].attn.c_attn).__name__ == "Conv1D"
    for (k, v), (k2, v2) in zip(model.named_parameters(), ref.named_parameters()):
        assert k == k2 and not v.requires_grad
        assert_bits_equal(v, v2)


def test_quantized_model_moves_between_devices_with_to():
    model = _llama()
    model.requires_grad_(False)
    ramstream.quantize_model(model, "nf4", pin_budget=1 << 20)
    w = model.model.layers[0].self_attn.q_proj.weight
    model.to("cpu")
    assert_bits_equal(model.model.layers[0].self_attn.q_proj.weight, w)


@pytest.mark.cuda
@pytest.mark.parametrize("fmt", ["nf4", "int8"])
def test_cuda_expansion_in_training_equals_the_host_expansion(fmt):
    """The same quantized LoRA model trained on the GPU (codes in VRAM, the CUDA kernel expands)
    and the reference with host-dequantized weights on the GPU: identical losses and adapters."""
    base = _llama()
    base.requires_grad_(False)
    ref = _lora(_reference_copy(base, fmt, 64)).cuda()
    ramstream.quantize_model(base, fmt)
    model = _lora(base).cuda()
    assert model.base_model.model.model.layers[0].self_attn.q_proj.base_layer.weight_codes.is_cuda
    for n, m in model.named_modules():
        if is_quantized(m):
            host = ref.get_submodule(n).weight
            assert_bits_equal(m.weight, host)
    opt = lambda ps: torch.optim.AdamW(ps, lr=1e-2, foreach=False)  # noqa: E731
    losses = []
    for mdl in (model, ref):
        o = opt([p for p in mdl.parameters() if p.requires_grad])
        out = []
        for i in range(3):
            ids = _batch(seed=i).cuda()
            loss = mdl(input_ids=ids, labels=ids).loss
            loss.backward()
            o.step()
            o.zero_grad()
            out.append(loss.detach().cpu())
        losses.append(out)
    for a, b in zip(*losses):
        assert_bits_equal(a, b)
