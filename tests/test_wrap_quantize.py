"""wrap()'s quantize / quant_block_size / prefer options: the auto decision under injected VRAM,
explicit int8/NF4 training (resident and streamed) bit for bit against the dequantized base,
memory_report, unwrap making the weights permanent, refused values."""

from __future__ import annotations

import pytest
import torch

import ramstream
from ramstream.planner.quantize import decide
from ramstream.quant import is_quantized
from test_quantize_model import _batch, _llama, _lora, _reference_copy

from _quant_helpers import assert_bits_equal

pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning")
GIB = 2**30


def _decide(total, packable, room, prefer="exact", can_stream=True):
    return decide(
        total=total,
        packable_bytes=packable,
        packable_numel=packable // 2,
        room=room,
        prefer=prefer,
        can_stream=can_stream,
        block_size=64,
    )[0]


def test_auto_decisions_under_injected_vram():
    # bf16: 10 GiB of weights, 8 of them frozen block weights (4 Gi elements)
    t, w = 10 * GIB, 8 * GIB
    assert _decide(t, w, None) == "none"  # the CPU engine
    assert _decide(t, w, 12 * GIB) == "none"  # fits
    assert _decide(t, w, 7 * GIB) == "none"  # exact: blocks stream instead
    assert _decide(t, w, 7 * GIB, prefer="speed") == "nf4"  # NF4 (~4.25 GiB) keeps all resident
    assert _decide(t, w, 7 * GIB, can_stream=False) == "int8"  # int8 (~6.5 GiB) before NF4
    assert _decide(t, w, 5 * GIB, can_stream=False) == "nf4"
    with pytest.raises(MemoryError, match="even as NF4"):  # even NF4 does not fit: refused
        _decide(t, w, 3 * GIB, can_stream=False)
    assert _decide(t, w, 3 * GIB, prefer="speed") == "none"
    assert _decide(t, 0, 3 * GIB, can_stream=False) == "none"  # nothing frozen to pack


def _train(model, steps=3):
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2, foreach=False)
    return model, opt


@pytest.mark.parametrize("fmt", ["nf4", "int8"])
@pytest.mark.parametrize("stream", [False, True], ids=["resident", "streamed"])
def test_wrap_quantize_trains_like_the_dequantized_base(fmt, stream):
    base = _llama()
    base.requires_grad_(False)
    ref = _lora(_reference_copy(base, fmt, 32))
    model = _lora(base)
    common = dict(device="cpu", param_offload=stream, activation_checkpointing=False)
    m, opt = ramstream.wrap(model, _train(model)[1], quantize=fmt, quant_block_size=32, **common)
    r, ropt = ramstream.wrap(ref, _train(ref)[1], quantize="none", **common)
    assert sum(is_quantized(x) for x in m.modules()) == 21
    rep = ramstream.memory_report(m)["params"]["quantization"]
    assert rep["format"] == fmt and rep["tensors"] == 21
    assert rep["bytes_saved"] == rep["bytes_before"] - rep["bytes_after"] > 0
    assert ramstream.memory_report(r)["params"]["quantization"] is None
    if stream:
        assert ramstream.memory_report(m)["params"]["streamed_blocks"] == [0, 1, 2]
    for i in range(3):
        losses = []
        for mdl, o in ((m, opt), (r, ropt)):
            ids = _batch(seed=i)
            loss = mdl(input_ids=ids, labels=ids).loss
            loss.backward()
            o.step()
            o.zero_grad()
            losses.append(loss.detach())
        assert_bits_equal(*losses)
    ramstream.unwrap(m)
    ramstream.unwrap(r)
    assert not any(is_quantized(x) for x in m.modules())
    rp = dict(r.named_parameters())
    for n, p in m.named_parameters():
        assert_bits_equal(p.detach(), rp[n].detach())


def test_auto_never_quantizes_on_the_cpu_engine():
    model = _lora(_llama().requires_grad_(False))
    m, _ = ramstream.wrap(model, device="cpu", param_offload=False)
    rep = ramstream.memory_report(m)["params"]["quantization"]
    assert rep["format"] is None and "CPU engine" in rep["reason"]
    assert not any(is_quantized(x) for x in m.modules())
    ramstream.unwrap(m)


@pytest.mark.parametrize(
    "kw,match",
    [
        (dict(quantize="fp4"), r"quantize='fp4'.*accepted: 'auto', 'none', None, False, 'int8', 'nf4'"),
        (dict(quant_block_size=3), r"quant_block_size=3.*even integer"),
        (dict(prefer="fast"), r"prefer='fast'.*accepted: 'exact', 'speed'"),
    ],
)
def test_bad_quantize_options(kw, match):
    with pytest.raises(ValueError, match=match):
        ramstream.wrap(_lora(_llama().requires_grad_(False)), device="cpu", **kw)


@pytest.mark.cuda
def test_cuda_auto_speed_picks_nf4_when_it_keeps_every_block_resident(monkeypatch):
    import ramstream.hardware as hw

    base = _llama()
    base.requires_grad_(False)
    ref = _lora(_reference_copy(base, "nf4", 64)).cuda()
    model = _lora(base)
    total = sum(p.nbytes for p in model.parameters())
    real = hw.gpu_memory

    def fake(device):  # room for NF4, not for the fp32 weights
        out = dict(real(device))
        out["free"] = int(total * 0.6 / 0.7 / 0.9)
        return out

    monkeypatch.setattr(hw, "gpu_memory", fake)
    m, opt = ramstream.wrap(
        model,
        device="cuda",
        quantize="auto",
        prefer="speed",
        param_offload=False,
        check_memory=False,
        activation_checkpointing=False,
    )
    monkeypatch.setattr(hw, "gpu_memory", real)
    rep = ramstream.memory_report(m)["params"]["quantization"]
    assert rep["format"] == "nf4", rep
    r, ropt = ramstream.wrap(
        ref, device="cuda", quantize="none", param_offload=False, activation_checkpointing=False
    )
    for i in range(3):
        losses = []
        for mdl, o in ((m, opt), (r, ropt)):
            ids = _batch(seed=i).cuda()
            loss = mdl(input_ids=ids, labels=ids).loss
            loss.backward()
            o.step()
            o.zero_grad()
            losses.append(loss.detach().cpu())
        assert_bits_equal(*losses)
