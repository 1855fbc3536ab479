"""Bad input for ramstream.functional's NF4/int8 quantization (see test_functional_fuzz.py): block
sizes, dtypes, layouts, wrong types, shapes inconsistent with the packed data. Each case works
(checked against an independent reference) or raises ValueError/TypeError naming the argument."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

import ramstream.functional as F
from test_functional_fuzz import ALL_DTYPES, BAD_OBJECTS, FLOATS, LAYOUTS, N, layout, raises

from _quant_helpers import NF4_CODE

# ---- quantization -----------------------------------------------------------------------------


def check_quant(x, block_size, nf4):
    q, absmax = (F.quantize_nf4 if nf4 else F.quantize_int8)(x, block_size=block_size)
    xf = x.float().reshape(-1)
    pad = (-xf.numel()) % block_size
    blocks = torch.cat([xf, xf.new_zeros(pad)]).reshape(-1, block_size)
    assert torch.equal(absmax, blocks.abs().amax(1))
    deq = (F.dequantize_nf4 if nf4 else F.dequantize_int8)(q, absmax, x.shape, torch.float32, block_size)
    scale = absmax.repeat_interleave(block_size)[: xf.numel()]
    if nf4:  # every element decodes to its nearest NF4 code (ties either way)
        best = ((xf / scale).nan_to_num()[:, None] - NF4_CODE).abs().amin(1) * scale
        assert bool(((xf - deq.reshape(-1)).abs() <= best + 1e-6 * scale).all())
    else:
        want = torch.round((xf / scale).nan_to_num() * 127).to(torch.int8)
        assert torch.equal(q.reshape(-1), want)


@pytest.mark.parametrize("block_size", [2, 6, 10, 96, np.int64(64), 2**20 + 2])
@pytest.mark.parametrize("nf4", [True, False])
def test_quant_block_sizes_not_powers_of_two(block_size, nf4):
    for x in (torch.randn(101), torch.randn(3, 7).bfloat16(), torch.tensor(-2.5).half(), torch.zeros(0)):
        check_quant(x, int(block_size), nf4)


@pytest.mark.parametrize("block_size", [0, -2, 1, 3, 63, 2**31, 2**70, 64.0, "64", None, True, [64]])
@pytest.mark.parametrize("fn", ["quantize_nf4", "quantize_int8", "dequantize_nf4", "dequantize_int8"])
def test_quant_bad_block_size(fn, block_size):
    x = torch.randn(100)
    args = (x,) if fn.startswith("q") else (*getattr(F, "quantize" + fn[10:])(x), x.shape, torch.float32)
    raises(ValueError, fn, "block_size", lambda: getattr(F, fn)(*args, block_size=block_size))


@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=str)
@pytest.mark.parametrize("nf4", [True, False])
def test_quant_dtypes_layouts_types(dtype, nf4):
    qfn, dfn = (F.quantize_nf4, F.dequantize_nf4) if nf4 else (F.quantize_int8, F.dequantize_int8)
    op, name = ("nf4", "packed") if nf4 else ("int8", "codes")
    x = torch.randn(N).to(dtype)
    if dtype in FLOATS:
        check_quant(x, 4, nf4)
        for kind in LAYOUTS:
            raises(ValueError, "quantize_" + op, "x", lambda: qfn(layout(x, kind), 4))
    else:
        raises(TypeError, "quantize_" + op, "x", lambda: qfn(x, 4))
    q, absmax = qfn(torch.randn(N), 4)
    if dtype != q.dtype:
        raises(TypeError, "dequantize_" + op, name, lambda: dfn(q.view(torch.uint8).to(dtype), absmax, N))
    if dtype != torch.float32:
        raises(TypeError, "dequantize_" + op, "absmax", lambda: dfn(q, absmax.to(dtype), N, block_size=4))
    if dtype not in FLOATS:
        raises(TypeError, "dequantize_" + op, "dtype", lambda: dfn(q, absmax, N, dtype, 4))
    for bad in BAD_OBJECTS:
        raises(TypeError, "quantize_" + op, "x", lambda: qfn(bad))
        raises(TypeError, "dequantize_" + op, name, lambda: dfn(bad, absmax, N, block_size=4))
        raises(TypeError, "dequantize_" + op, "absmax", lambda: dfn(q, bad, N, block_size=4))
    big = torch.randn(2 * N)
    q2, a2 = qfn(big, 4)
    raises(
        ValueError,
        "dequantize_" + op,
        name,
        lambda: dfn(q2[::2] if not nf4 else q2.reshape(2, -1).t(), a2, N, block_size=4),
    )
    raises(ValueError, "dequantize_" + op, "absmax", lambda: dfn(q, a2[::2], N, block_size=4))
    raises(ValueError, "quantize_" + op, "x", lambda: qfn(torch.ones(4, device="meta")))


@pytest.mark.parametrize("nf4", [True, False])
def test_dequantize_shapes_inconsistent_with_data(nf4):
    dfn = F.dequantize_nf4 if nf4 else F.dequantize_int8
    op, name = ("dequantize_nf4", "packed") if nf4 else ("dequantize_int8", "codes")
    q, absmax = (F.quantize_nf4 if nf4 else F.quantize_int8)(torch.randn(12), 4)
    for shape in ((13,), (11,), (2**62,), (4, 4), 0):
        n = math.prod(shape) if isinstance(shape, tuple) else shape
        if nf4 and (n + 1) // 2 == 6:  # 11 elements fit in 6 bytes: absmax count must still match
            raises(ValueError, op, "absmax", lambda: dfn(q, absmax, shape, block_size=2))
            continue
        raises(ValueError, op, name, lambda: dfn(q, absmax, shape, block_size=4))
    raises(ValueError, op, "absmax", lambda: dfn(q, absmax[:2], (12,), block_size=4))
    raises(ValueError, op, "shape", lambda: dfn(q, absmax, (-12,), block_size=4))
    for bad in (None, "12", 12.0, (3.0, 4), (True, 12), np.zeros(2)):
        raises(TypeError, op, "shape", lambda: dfn(q, absmax, bad, block_size=4))
    raises(ValueError, op, "absmax", lambda: dfn(q, absmax.to("meta"), 12, block_size=4))
    out = dfn(q, absmax.requires_grad_(), torch.Size([3, 4]), torch.float16, np.int64(4))
    assert out.shape == (3, 4) and out.dtype == torch.float16
