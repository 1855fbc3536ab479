"""Streamed quantized blocks: a block's packed codes and absmax travel in its slabs (at home in
pinned memory at rest, on the device only while it runs); LoRA training on a streamed quantized
base equals the same run with every block resident, bit for bit (CPU engine; `cuda` copies);
param_offload="auto" counts the packed bytes; memory_report's plan says where they live."""

from __future__ import annotations

import copy

import pytest
import torch

import ramstream
from ramstream.quant import is_quantized
from ramstream.quant.packed import packed_buffers
from test_quantize_model import _batch, _llama, _lora

from _quant_helpers import assert_bits_equal

pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning")
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)]


def _pair(dtype=torch.float32):
    base = _llama().to(dtype)
    base.requires_grad_(False)
    twin = copy.deepcopy(base)
    return _lora(base), _lora(twin)


def _wrap(model, device, fmt, stream, **kw):
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    # offload=True: on a GPU the resident run would switch to torch's fused AdamW (other rounding)
    kw = dict(device=device, quantize=fmt, quant_block_size=32, offload=True, **kw)
    return ramstream.wrap(model, opt, param_offload=stream, **kw)


def _steps(pairs, device, n=4):
    """Trains every (model, optimizer) on the same batches; returns each one's losses."""
    out = [[] for _ in pairs]
    for i in range(n):
        ids = _batch(seed=i).to(device)
        for j, (m, o) in enumerate(pairs):
            loss = m(input_ids=ids, labels=ids).loss
            loss.backward()
            o.step()
            o.zero_grad()
            out[j].append(loss.detach().float().cpu())
    return out


def _slab_of(streamer, t):
    for b in streamer.blocks:
        for s in b.slabs:
            for p, hv in zip(s.params, s.hviews):
                if p is t:
                    return s, hv
    return None, None


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("fmt", ["nf4", "int8"])
@pytest.mark.parametrize(
    "dtype,stream,ckpt",
    [
        (torch.float32, True, False),
        (torch.bfloat16, True, True),
        (torch.float32, [1], True),  # part of the stack streams
    ],
    ids=["fp32-all", "bf16-all-recompute", "fp32-block1-recompute"],
)
def test_streamed_quantized_base_trains_like_the_resident_one(device, fmt, dtype, stream, ckpt):
    res, stm = _pair(dtype)
    r, ropt = _wrap(res, device, fmt, False, activation_checkpointing=ckpt)
    s, sopt = _wrap(stm, device, fmt, stream, activation_checkpointing=ckpt, weight_window=1)
    w = s._ramstream
    idx = [0, 1, 2] if stream is True else stream
    assert ramstream.memory_report(s)["params"]["streamed_blocks"] == idx
    packed = [t for k in idx for _, _, t in packed_buffers(w.streamer.blocks[idx.index(k)].module)]
    assert len(packed) == 2 * 7 * len(idx)  # codes and absmax of 7 projections per block
    for t in packed:  # at home (pinned on a GPU machine) between steps
        slab, hv = _slab_of(w.streamer, t)
        assert slab is not None and t.data_ptr() == hv.data_ptr() and t.device.type == "cpu"
        assert t.is_pinned() == (device == "cuda")
    lr, ls = _steps([(r, ropt), (s, sopt)], device)
    for a, b in zip(lr, ls):
        assert_bits_equal(a, b)
    assert w.streamer.loaded_bytes() == 0  # everything evicted after the backward
    assert all(t.data_ptr() == _slab_of(w.streamer, t)[1].data_ptr() for t in packed)
    rsd, ssd = r.state_dict(), s.state_dict()  # dequantized weights under their original keys
    assert rsd.keys() == ssd.keys()
    for k in rsd:
        assert_bits_equal(rsd[k].cpu(), ssd[k].cpu())
    ramstream.unwrap(r)
    ramstream.unwrap(s)
    rp = dict(r.named_parameters())
    for n, p in s.named_parameters():
        assert_bits_equal(rp[n].detach().cpu(), p.detach().cpu())


@pytest.mark.parametrize("device", DEVICES)
def test_packed_codes_are_on_the_device_only_while_their_block_runs(device):
    model, _ = _pair()
    m, opt = _wrap(model, device, "nf4", True, activation_checkpointing=False, weight_window=1)
    st = m._ramstream.streamer
    seen = []

    def record(mod, args):
        slab, hv = _slab_of(st, mod.weight_codes)
        flat = slab.flat
        lo, hi = flat.data_ptr(), flat.data_ptr() + flat.untyped_storage().nbytes()
        on = mod.weight_codes.device.type == device
        seen.append(
            on and lo <= mod.weight_codes.data_ptr() < hi and mod.weight_codes.data_ptr() != hv.data_ptr()
        )

    quantized = [x for x in m.modules() if is_quantized(x)]
    hooks = [x.register_forward_pre_hook(record) for x in quantized]
    ids = _batch().to(device)
    m(input_ids=ids, labels=ids).loss.backward()
    for h in hooks:
        h.remove()
    assert len(seen) == len(quantized) and all(seen)  # every layer read its codes from the slab's device copy
    assert st.loaded_bytes() == 0
    assert st.stats["bytes_h2d"] >= 2 * sum(t.nbytes for _, _, t in packed_buffers(m))  # forward + backward
    opt.step()
    ramstream.unwrap(m)


def test_memory_report_plan_counts_the_streamed_packed_bytes():
    model, _ = _pair()
    m, _ = _wrap(model, "cpu", "int8", [0, 2], activation_checkpointing=False)
    rep = ramstream.memory_report(m)
    want = sum(t.nbytes for k in (0, 2) for _, _, t in packed_buffers(m.base_model.model.model.layers[k]))
    plan = rep["plan"]["weights"]
    assert plan["streamed"] == [0, 2] and plan["resident"] == [1]
    assert plan["packed_bytes"] == want > 0
    # the streamed bytes: the packed buffers plus the blocks' parameters (norms, LoRA), padded
    params = sum(p.nbytes for k in (0, 2) for p in m.base_model.model.model.layers[k].parameters())
    assert want + params <= plan["streamed_bytes"] <= want + params + 512 * 64
    q = rep["params"]["quantization"]
    assert q["packed_streamed_bytes"] == want and q["bytes_after"] > want  # block 1's codes resident
    assert any("packed quantized codes" in e for e in rep["events"])
    ramstream.unwrap(m)


def test_to_keeps_the_packed_codes_at_home_and_refuses_a_dtype_change():
    model, _ = _pair()
    m, opt = _wrap(model, "cpu", "nf4", True, activation_checkpointing=False)
    st = m._ramstream.streamer
    packed = [t for _, _, t in packed_buffers(m)]
    m.to("cpu")
    for owner, name, t in packed_buffers(m):
        assert t is packed.pop(0)
        assert owner._buffers[name].data_ptr() == _slab_of(st, t)[1].data_ptr()
    ids = _batch()
    m(input_ids=ids, labels=ids).loss.backward()  # still trains
    opt.step()
    assert st.stats["loads"] > 0 and st.loaded_bytes() == 0
    with pytest.raises(RuntimeError, match="convert the model before wrap"):
        m.half()
    assert all(t.dtype in (torch.uint8, torch.float32) for _, _, t in packed_buffers(m))
    ramstream.unwrap(m)
