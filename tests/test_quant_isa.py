"""Blockwise NF4 / int8 quantization on every ISA and thread count: the same bytes, and the
dequantized output rounded by docs/NUMERICS.md rule 1."""

from __future__ import annotations

import pytest
import torch

import ramstream.functional as rf
from ramstream._native import lib

# isa is a fixture: pytest finds it here once imported
from _isa import isa, supported_isas, using_isa  # noqa: F401
from _quant_helpers import FLOAT_DTYPES, NF4_CODE, NF4_MID, assert_bits_equal, bits

C = lib()


# ---- every ISA, every thread count: the same bytes -----------------------------------------------


def _random_bit_floats(n: int, g: torch.Generator) -> torch.Tensor:
    """Floats from random bit patterns: NaN payloads, infs, subnormals, huge and tiny values."""
    return (
        torch.randint(-(2**31), 2**31, (n,), dtype=torch.int64, generator=g)
        .to(torch.int32)
        .view(torch.float32)
    )


def _all_outputs(x: torch.Tensor, block: int, absmax_bits: torch.Tensor) -> list[torch.Tensor]:
    n = x.numel()
    outs = list(rf.quantize_nf4(x, block_size=block)) + list(rf.quantize_int8(x, block_size=block))
    packed = torch.full(((n + 1) // 2,), 0xF0, dtype=torch.uint8)  # codes 15 and 0: +-absmax exactly
    codes = torch.randint(-127, 128, (n,), dtype=torch.int8, generator=torch.Generator().manual_seed(9))
    for dt in FLOAT_DTYPES:
        outs.append(bits(rf.dequantize_nf4(packed, absmax_bits, (n,), dt, block_size=block)))
        outs.append(bits(rf.dequantize_int8(codes, absmax_bits, (n,), dt, block_size=block)))
    return [bits(o) if o.is_floating_point() else o for o in outs]


@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=str)
def test_every_isa_gives_identical_bytes(dtype):
    isas = supported_isas()
    if len(isas) < 2:
        pytest.skip("only one ISA on this CPU")
    g = torch.Generator().manual_seed(4)
    for block in (2, 6, 14, 16, 18, 64, 100):
        n = 40 * block + 11
        x = torch.randn(n, generator=g) * torch.exp(torch.randn(n, generator=g) * 4)
        x[::37] = 0.0
        x[5::101] = float("nan")
        x[7::211] = float("inf")
        x = x.to(dtype)
        absmax_bits = _random_bit_floats(-(-n // block), g)
        with using_isa("scalar"):
            ref = _all_outputs(x, block, absmax_bits)
        for name in isas[1:]:
            with using_isa(name):
                got = _all_outputs(x, block, absmax_bits)
            for i, (a, b) in enumerate(zip(ref, got)):
                assert torch.equal(a, b), (name, block, i)


def _around(values: torch.Tensor, ulps: int = 3) -> torch.Tensor:
    """values and the float32 numbers up to ``ulps`` steps either side of each."""
    out, lo, hi = [values], values, values
    for _ in range(ulps):
        lo, hi = torch.nextafter(lo, torch.tensor(-2.0)), torch.nextafter(hi, torch.tensor(2.0))
        out += [lo, hi]
    return torch.cat(out)


@pytest.mark.parametrize("block", [64, 62])
def test_nf4_codes_at_every_edge(isa, block):
    # The vector kernels find a code by a bin (trunc(16 s + 16)) and one compare: every bin edge
    # and every midpoint, with the floats beside them, get the code of the definition (midpoints
    # strictly below s, counted in float64), on each ISA; block 64 takes the in-register path.
    edges = torch.arange(33, dtype=torch.float64).div(16).sub(1).float()
    s = _around(torch.cat([edges, NF4_MID, NF4_CODE, torch.tensor([0.0, -0.0])])).clamp(-1, 1)
    per = block - 1  # each block starts with 1.0, so absmax is 1 and the scaled values are s
    s = torch.cat([s, torch.zeros(-s.numel() % per)]).view(-1, per)
    x = torch.cat([torch.ones(s.shape[0], 1), s], 1).reshape(-1)
    packed, absmax = rf.quantize_nf4(x, block_size=block)
    assert torch.equal(absmax, torch.ones_like(absmax))
    codes = torch.stack([packed >> 4, packed & 15], 1).reshape(-1)[: x.numel()].long()
    expect = (x.double()[:, None] > NF4_MID.double()[None, :]).sum(1)
    bad = (codes != expect).nonzero().flatten()
    assert bad.numel() == 0, [(x[i].item(), codes[i].item(), expect[i].item()) for i in bad[:5]]


def test_output_rounding_rule_1(isa):
    # code 15 is 1.0: the dequantized value is absmax itself, so out == absmax cast (rule 1).
    g = torch.Generator().manual_seed(6)
    vals = torch.cat(
        [
            _random_bit_floats(4000, g),
            torch.tensor(
                [
                    65504.0,
                    65519.99,
                    65520.0,
                    1e6,
                    6.1e-5,
                    5.96e-8,
                    2.98e-8,
                    2.99e-8,
                    1e-45,
                    0.0,
                    -0.0,
                    float("inf"),
                    -float("inf"),
                ]
            ),
            torch.randn(2000, generator=g) * 1e-5,  # fp16 subnormal range
        ]
    )
    packed = torch.full((vals.numel(),), 0xF0, dtype=torch.uint8)  # pairs: (+absmax, -absmax)
    for dt in (torch.bfloat16, torch.float16):
        out = rf.dequantize_nf4(packed, vals, (2 * vals.numel(),), dt, block_size=2)
        for got, v in ((out[0::2], vals), (out[1::2], NF4_CODE[0] * vals)):
            nan = torch.isnan(v)  # (the product keeps a NaN operand's sign)
            assert_bits_equal(got[~nan], v[~nan].to(dt))
            assert torch.isnan(got[nan]).all()
            if dt == torch.bfloat16:  # NaN -> sign | 0x7FC0
                vb = v[nan].view(torch.int32)
                expect = torch.where(vb < 0, -64, 0x7FC0).to(torch.int16)  # 0xFFC0 == -64
                assert torch.equal(bits(got[nan]), expect)


def test_thread_count_independence():
    prev = C.num_threads()
    x = torch.randn(600_001, generator=torch.Generator().manual_seed(8)).to(torch.bfloat16)
    results = []
    try:
        for threads in (1, 3, 7):
            C.set_num_threads(threads)
            p, a = rf.quantize_nf4(x, block_size=64)
            c, a8 = rf.quantize_int8(x, block_size=100)
            y = rf.dequantize_nf4(p, a, x.shape, torch.float16, block_size=64)
            z = rf.dequantize_int8(c, a8, x.shape, torch.bfloat16, block_size=100)
            results.append((p, bits(a), c, bits(a8), bits(y), bits(z)))
    finally:
        C.set_num_threads(prev)
    for r in results[1:]:
        for a, b in zip(results[0], r):
            assert torch.equal(a, b)
