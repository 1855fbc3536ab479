"""prefer="speed": the fused LoRA node over a quantized base (quant/lora_fused.py) against a float64
computation on the same dequantized weight, against peft's own path in training, the calls it
leaves to peft (bit for bit), and unwrap() removing it."""

from __future__ import annotations

import pytest
import torch

import ramstream
from ramstream.quant.lora_fused import FusedQuantLoraFn, fuse_lora_, is_fused
from ramstream.quant.packed import expand_weight, quantize_module_
from test_quantize_model import _batch, _llama, _lora

from _quant_helpers import assert_bits_equal

pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning")


def _case(dtype, bias, seed=0):
    g = torch.Generator().manual_seed(seed)
    base = torch.nn.Linear(64, 48, bias=bias).to(dtype)
    base.requires_grad_(False)
    quantize_module_(base, "nf4", 32)
    if bias:
        base.bias.requires_grad_(True)
    a = (torch.randn(8, 64, generator=g) * 0.1).requires_grad_(True)  # fp32 adapters, as peft's
    b = (torch.randn(48, 8, generator=g) * 0.1).requires_grad_(True)
    x = torch.randn(3, 5, 64, generator=g).to(dtype).requires_grad_(True)
    gy = torch.randn(3, 5, 48, generator=g).to(dtype)
    return base, a, b, x, gy


def _reference(base, a, b, x, gy, s):
    """float64: y = x W^T + bias + s (x A^T) B^T and its gradients, W the dequantized weight."""
    w = expand_weight(base, reuse=False).double()
    leaves = [t.detach().double().requires_grad_(True) for t in (x, a, b)]
    xd, ad, bd = leaves
    y = xd @ w.t() + s * (xd @ ad.t()) @ bd.t()
    if base.bias is not None:
        bias = base.bias.detach().double().requires_grad_(True)
        y = y + bias
        leaves.append(bias)
    y.backward(gy.double())
    return y.detach(), [t.grad for t in leaves]


@pytest.mark.parametrize("bias", [False, True], ids=["no_bias", "bias"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_node_equals_float64(dtype, bias):
    base, a, b, x, gy = _case(dtype, bias)
    s = 2.0
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype == torch.bfloat16):
        y = FusedQuantLoraFn.apply(x, a, b, base.bias, base, s, dtype)
    y.backward(gy)
    ref_y, ref_grads = _reference(base, a, b, x, gy, s)
    got = [x.grad, a.grad, b.grad] + ([base.bias.grad] if bias else [])
    assert y.dtype == dtype and x.grad.dtype == dtype and a.grad.dtype == b.grad.dtype == torch.float32
    tol = 1e-5 if dtype == torch.float32 else 3e-2  # bf16: inputs and products rounded to 8 bits
    for t, ref in zip([y] + got, [ref_y] + ref_grads):
        err = (t.double() - ref).abs().max().item()
        assert err <= tol * max(1.0, ref.abs().max().item()), err


@pytest.mark.parametrize("limit", [1 << 30, 0], ids=["stashed", "over_the_limit"])
def test_a_recomputed_forward_keeps_its_expanded_weight_for_the_backward(monkeypatch, limit):
    import gc

    import ramstream.quant.lora_fused as lf

    base, a, b, x, gy = _case(torch.float32, True)
    fn = lambda t: FusedQuantLoraFn.apply(t, a, b, base.bias, base, 2.0, torch.float32)  # noqa: E731
    fn(x).backward(gy)  # plain: expanded in forward and again in backward
    ref = [t.grad.clone() for t in (x, a, b, base.bias)]
    for t in (x, a, b, base.bias):
        t.grad = None
    calls = []
    expand = lf.expand_weight
    monkeypatch.setattr(lf, "expand_weight", lambda m, reuse: calls.append(reuse) or expand(m, reuse=reuse))
    monkeypatch.setattr(lf.STASH, "limit", limit)
    y = torch.utils.checkpoint.checkpoint(fn, x, use_reentrant=False)
    y.backward(gy)
    # forward (shared buffer), the recompute (its own tensor when stashed), and the backward only
    # when nothing was stashed
    assert calls == ([True, False] if limit else [True, True, True])
    for t, r in zip((x, a, b, base.bias), ref):
        assert_bits_equal(t.grad, r)
    del y
    gc.collect()
    assert lf.STASH.held == 0  # given back when the stashed weight was freed


def _pair(**lora_kw):
    """The same frozen base with LoRA (_lora draws a nonzero B: both adapters get gradients), twice."""
    return [_lora(_llama(seed=0).requires_grad_(False), **lora_kw) for _ in range(2)]


def _opt(m):
    return torch.optim.AdamW([p for p in m.parameters() if p.requires_grad], lr=1e-2, foreach=False)


def test_prefer_speed_trains_like_peft_within_rounding(monkeypatch):
    calls = []
    apply = FusedQuantLoraFn.apply
    monkeypatch.setattr(FusedQuantLoraFn, "apply", lambda *a: calls.append(1) or apply(*a))
    fused, plain = _pair()
    common = dict(device="cpu", quantize="nf4", quant_block_size=32, param_offload=False)
    f, fopt = ramstream.wrap(fused, _opt(fused), prefer="speed", **common)
    p, popt = ramstream.wrap(plain, _opt(plain), prefer="exact", **common)
    assert ramstream.memory_report(f)["params"]["quantization"]["lora_fused"] == 21
    assert ramstream.memory_report(p)["params"]["quantization"].get("lora_fused") is None
    assert sum(is_fused(m) for m in f.modules()) == 21 and not any(is_fused(m) for m in p.modules())
    for i in range(4):
        losses = []
        for mdl, o in ((f, fopt), (p, popt)):
            ids = _batch(seed=i)
            loss = mdl(input_ids=ids, labels=ids).loss
            loss.backward()
            o.step()
            o.zero_grad()
            losses.append(loss.item())
        assert abs(losses[0] - losses[1]) <= 1e-5 * abs(losses[1]), losses
    assert len(calls) == 4 * 21  # every LoRA layer of every step took the fused node
    pp = dict(p.named_parameters())
    for n, t in f.named_parameters():
        if t.requires_grad:
            assert torch.allclose(t, pp[n], rtol=1e-4, atol=1e-6), n
    ramstream.unwrap(f)
    assert not any(is_fused(m) or "forward" in m.__dict__ for m in f.modules())


def _out(m, ids):
    return m(input_ids=ids).logits.detach()


def test_calls_the_fused_node_does_not_cover_take_pefts_path_bit_for_bit(monkeypatch):
    from ramstream.quant import quantize_model

    a, b = _pair(lora_dropout=0.1)
    for m in (a, b):
        quantize_model(m, "nf4", block_size=32)
    assert fuse_lora_(a) == 21
    monkeypatch.setattr(FusedQuantLoraFn, "apply", lambda *a: pytest.fail("fused node used"))
    ids = _batch(seed=5)
    a.train(), b.train()
    torch.manual_seed(1)
    out_a = _out(a, ids)  # dropout in training: peft's own path, same random draws
    torch.manual_seed(1)
    assert_bits_equal(out_a, _out(b, ids))
    with a.disable_adapter(), b.disable_adapter():
        assert_bits_equal(_out(a, ids), _out(b, ids))
    a.eval(), b.eval()  # dropout p>0 is still not the plain case in eval: peft's path
    assert_bits_equal(_out(a, ids), _out(b, ids))


@pytest.mark.cuda
@pytest.mark.parametrize("bias", [False, True], ids=["no_bias", "bias"])
def test_fused_node_equals_float64_cuda(bias):
    base, a, b, x, gy = _case(torch.bfloat16, bias)
    dev = torch.device("cuda")
    base = base.to(dev)
    a, b = (t.detach().to(dev).requires_grad_(True) for t in (a, b))
    x = x.detach().to(dev).requires_grad_(True)
    gy = gy.to(dev)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        y = FusedQuantLoraFn.apply(x, a, b, base.bias, base, 2.0, torch.bfloat16)
    y.backward(gy)
    ref_y, ref_grads = _reference(base, a, b, x, gy, 2.0)
    got = [x.grad, a.grad, b.grad] + ([base.bias.grad] if bias else [])
    for t, ref in zip([y] + got, [ref_y] + ref_grads):
        err = (t.double() - ref).abs().max().item()
        assert err <= 3e-2 * max(1.0, ref.abs().max().item()), err


@pytest.mark.cuda
def test_prefer_speed_trains_like_peft_cuda():
    fused, plain = (m.to(torch.bfloat16) for m in _pair())
    for m in (fused, plain):  # adapters in fp32, as peft keeps them under autocast
        for n, p in m.named_parameters():
            if "lora_" in n:
                p.data = p.data.float()
    common = dict(device="cuda", quantize="nf4", quant_block_size=32, param_offload=False)
    f, fopt = ramstream.wrap(fused.cuda(), _opt(fused), prefer="speed", **common)
    p, popt = ramstream.wrap(plain.cuda(), _opt(plain), prefer="exact", **common)
    assert ramstream.memory_report(f)["params"]["quantization"]["lora_fused"] == 21
    for i in range(3):
        losses = []
        for mdl, o in ((f, fopt), (p, popt)):
            ids = _batch(seed=i).cuda()
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = mdl(input_ids=ids, labels=ids).loss
            loss.backward()
            o.step()
            o.zero_grad()
            losses.append(loss.item())
        assert abs(losses[0] - losses[1]) <= 2e-2 * abs(losses[1]), losses  # bf16 rounding order
