"""quantize="auto" with the planner's numbers on the CPU (the GPU's size and the available RAM
injected): prefer="speed" picks NF4 exactly when that keeps every block in VRAM while the
unquantized weights would stream; param_offload="auto" counts the packed bytes; a base that does
not fit even as NF4 (in VRAM + pinned RAM) is refused with a MemoryError showing the arithmetic."""

from __future__ import annotations

import copy
import sys

import pytest
import torch

import ramstream
import ramstream.hardware as hw
import ramstream.planner.profile as profile
from ramstream.activations import find_blocks
from ramstream.options import WrapOptions
from ramstream.planner.policy import auto_streamed
from ramstream.planner.quantize import decide
from ramstream.planner.wrap_rules import weight_share
from ramstream.quant import is_quantized
from ramstream.runtime.inspect import block_elements, model_shape
from ramstream.runtime.quantize import apply_quantize
from test_quantize_model import _llama

pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning")
CUDA = torch.device("cuda")  # only named: nothing is allocated on it
GIB = 2**30
HEADROOM = 0.10  # wrap()'s default vram_headroom
PROJ = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def _model(r: int):
    peft = pytest.importorskip("peft")
    base = _llama(layers=4).requires_grad_(False)
    torch.manual_seed(10)
    cfg = peft.LoraConfig(r=r, lora_alpha=2 * r, lora_dropout=0.0, target_modules=PROJ)
    return peft.get_peft_model(base, cfg)


def _fake_gpu(monkeypatch, free: int) -> None:
    mem = {"total": free, "cap": free, "free": free, "reserved": 0, "allocated": 0}
    monkeypatch.setattr(hw, "gpu_memory", lambda device: dict(mem))


def _fake_ram(monkeypatch, avail: int) -> None:
    ram = {"total": avail, "available": avail, "cgroup_limit": None, "cgroup_usage": None}
    monkeypatch.setattr(profile, "available_ram", lambda *a, **k: dict(ram))


def _streamed(model, free: int) -> int:
    """The front blocks param_offload="auto" streams (the planner's policy.auto_streamed on the
    model's shape, packed codes counted as frozen weight bytes) with `free` bytes of VRAM."""
    shape = model_shape(model, find_blocks(model), batch=1, seq=8, loss="dense")
    return auto_streamed(shape, free, HEADROOM, lambda part: part.weight_bytes)[0]


def _numbers(model, block_size=64):
    """(all weight bytes, NF4 bytes, the share) computed here from the model's own tensors."""
    tensors = {id(t): t for t in list(model.parameters()) + list(model.buffers())}.values()
    total = sum(t.nbytes for t in tensors)
    frozen = [
        m.weight
        for b in find_blocks(model)
        for m in b.modules()
        if isinstance(m, torch.nn.Linear) and not m.weight.requires_grad
    ]
    numel = sum(w.numel() for w in frozen)
    nf4 = total - sum(w.nbytes for w in frozen) + numel * (0.5 + 4 / block_size)
    trained = sum(p.numel() for b in find_blocks(model) for p in b.parameters() if p.requires_grad)
    every = sum(p.numel() for b in find_blocks(model) for p in b.parameters())
    return total, nf4, (0.7 if trained < 0.1 * every else 0.5)


@pytest.mark.parametrize("r,share", [(2, 0.7), (4, 0.5)])  # LoRA-like (< 10 % trained) or not
def test_speed_picks_nf4_exactly_when_it_keeps_every_block_in_vram(monkeypatch, r, share):
    model = _model(r)
    twin = copy.deepcopy(model)
    total, nf4, want_share = _numbers(model)
    assert want_share == share == weight_share(*block_elements(find_blocks(model)))
    _fake_ram(monkeypatch, 64 * GIB)
    # room for NF4 on the device, not for the unquantized weights
    free = int((nf4 + total) / 2 / (1 - HEADROOM) / share)
    _fake_gpu(monkeypatch, free)
    log = []
    assert _streamed(twin, free) > 0  # the unquantized weights would stream
    exact, _ = apply_quantize(twin, WrapOptions.parse(prefer="exact"), CUDA, log.append)
    assert exact["format"] is None and "blocks stream instead" in exact["reason"]
    assert not any(is_quantized(m) for m in twin.modules())
    rep, removed = apply_quantize(model, WrapOptions.parse(prefer="speed"), CUDA, log.append)
    assert rep["format"] == "nf4" and "prefer='speed'" in rep["reason"] and len(removed) == 4 * 7
    assert _streamed(model, free) == 0  # every block resident, its packed codes counted
    # a GPU too small for NF4 too: speed streams the unquantized weights as exact does
    _fake_gpu(monkeypatch, int(nf4 * 0.9 / (1 - HEADROOM) / share))
    again, _ = apply_quantize(_model(r), WrapOptions.parse(prefer="speed"), CUDA, log.append)
    assert again["format"] is None


def test_auto_streaming_counts_the_packed_bytes():
    model = _model(2)
    ramstream.quantize_model(model, "nf4")
    blocks = find_blocks(model)
    params = sum(p.nbytes for p in model.parameters())
    packed = [sum(t.nbytes for n, t in b.named_buffers() if n.endswith(("codes", "absmax"))) for b in blocks]
    per_block = [sum(p.nbytes for p in b.parameters()) + k for b, k in zip(blocks, packed)]
    # the room holds every parameter and half of the packed bytes
    room = params + sum(packed) / 2
    free = int(room / (1 - HEADROOM) / 0.7) + 1
    resident, k = params + sum(packed), 0
    while resident > room:
        resident -= per_block[k]
        k += 1
    assert k >= 1  # streaming only happens because the packed bytes count
    assert _streamed(model, free) == k


def test_decide_streams_then_int8_then_nf4_within_vram_plus_pinned_ram():
    t, w = 10 * GIB, 8 * GIB  # 10 GiB of bf16 weights, 8 of them frozen block weights
    kw = dict(total=t, packable_bytes=w, packable_numel=w // 2, block_size=64, can_stream=True)
    assert decide(room=4 * GIB, host_room=7 * GIB, prefer="exact", **kw)[0] == "none"  # streams
    fmt, why = decide(room=2 * GIB, host_room=5 * GIB, prefer="exact", **kw)
    assert fmt == "int8" and "blocks stream" in why  # int8 (6.25 GiB) before NF4
    assert decide(room=2 * GIB, host_room=3 * GIB, prefer="exact", **kw)[0] == "nf4"  # ~4.25 GiB
    with pytest.raises(MemoryError) as err:
        decide(room=2 * GIB, host_room=GIB, prefer="speed", explain="from the test", **kw)
    msg = str(err.value)
    for part in (
        "even as NF4",
        "4,294,967,296 frozen block weight elements x (0.5 + 4/64) B + 2.00 GiB of other weights = 4.25 GiB",
        "> 2.00 GiB on the device + 1.00 GiB of pinned host memory for streamed blocks = 3.00 GiB",
        "(from the test)",
        "Unquantized 10.00 GiB, int8 6.25 GiB",
    ):
        assert part in msg
    fmt, why = decide(room=2 * GIB, host_room=GIB, prefer="exact", check=False, **kw)
    assert fmt == "none" and "check_memory=False" in why
    with pytest.raises(MemoryError, match="param_offload='auto' or True"):
        decide(room=2 * GIB, prefer="exact", **{**kw, "can_stream": False})


def test_wrap_refuses_a_base_that_does_not_fit_even_as_nf4(monkeypatch):
    model = _model(2)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    total, nf4, _ = _numbers(model)
    _fake_gpu(monkeypatch, int(nf4 / 4))
    _fake_ram(monkeypatch, int(nf4 / 4))  # VRAM + pinned RAM: about a third of NF4's bytes
    # wrap() as on a GPU machine up to its quantize decision (which refuses before any CUDA call)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(sys.modules["ramstream.wrap"], "_check_cuda_device", lambda device, mode: None)
    with pytest.raises(MemoryError, match=r"quantize='auto': the weights do not fit even as NF4") as err:
        ramstream.wrap(model, device="cuda:0", quantize="auto")
    assert "of host optimizer state" in str(err.value) and "available RAM" in str(err.value)
    # nothing changed: not quantized, not wrapped, every weight where and as it was
    assert not any(is_quantized(m) for m in model.modules())
    assert getattr(model, "_ramstream", None) is None
    for n, p in model.named_parameters():
        assert p.device.type == "cpu" and torch.equal(p, before[n])
