"""Blockwise NF4 / int8 quantization: bitsandbytes parity, a pure-torch reference of the spec,
round-trip error, the CUDA dequantization against the host (every ISA and thread count giving the
same bytes: test_quant_isa.py; argument checking: test_quant_input.py)."""

from __future__ import annotations

import math

import pytest
import torch

import ramstream.functional as rf

# isa is a fixture: pytest finds it here once imported
from _isa import isa, supported_isas, using_isa  # noqa: F401
from _quant_helpers import FLOAT_DTYPES, NF4_CODE, NF4_MID, assert_bits_equal, bits

BNB_BLOCKS = [32, 64, 128, 256, 512, 1024, 2048, 4096]  # what bitsandbytes.quantize_4bit accepts


@pytest.fixture(scope="module")
def bnbf():
    return pytest.importorskip("bitsandbytes.functional")


# ---- pure-torch references of docs/NUMERICS.md rules 4 and 5 -------------------------------------


def ref_absmax(xf: torch.Tensor, block: int) -> torch.Tensor:
    n = xf.numel()
    blocks = -(-n // block)
    padded = torch.zeros(blocks * block, dtype=torch.float32)
    padded[:n] = xf.abs()
    return padded.view(blocks, block).amax(dim=1)


def ref_quantize_nf4(x: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    xf = x.reshape(-1).float()
    n = xf.numel()
    absmax = ref_absmax(xf, block)
    d = absmax.clamp(min=1e-38).repeat_interleave(block)[:n]
    s = xf * (1.0 / d)  # float reciprocal, then multiply (full blocks)
    full = (n // block) * block
    s[full:] = xf[full:] / d[full:]  # true division in the final partial block
    q = torch.bucketize(s.clamp(-1, 1), NF4_MID)  # midpoints strictly below s
    if n % 2:
        q = torch.cat([q, torch.tensor([7])])
    q = q.to(torch.uint8)
    return (q[0::2] << 4) | q[1::2], absmax


def ref_dequantize_nf4(packed, absmax, n, block, dtype):
    q = torch.stack([packed >> 4, packed & 15], dim=1).reshape(-1)[:n].long()
    return (NF4_CODE[q] * absmax.repeat_interleave(block)[:n]).to(dtype)


def ref_quantize_int8(x: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    xf = x.reshape(-1).float()
    n = xf.numel()
    absmax = ref_absmax(xf, block)
    a = absmax.repeat_interleave(block)[:n]
    q = torch.round((xf / a) * 127.0)  # torch.round: half to even
    q = torch.where(a == 0, torch.zeros_like(q), q)
    return q.to(torch.int8).reshape(x.shape), absmax


def ref_dequantize_int8(codes, absmax, n, block, dtype):
    scale = (absmax / 127.0).repeat_interleave(block)[:n]
    return (codes.reshape(-1).float() * scale).to(dtype)


# ---- inputs ---------------------------------------------------------------------------------------


def make_input(kind: str, n: int, block: int, dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=g)
    blocks = -(-n // block)
    if kind == "heavy":
        x = torch.empty(n).cauchy_(generator=g).clamp(-6e4, 6e4)
    elif kind == "zero_blocks":  # every other full block is all zeros
        for b in range(0, n // block, 2):
            x[b * block : (b + 1) * block] = 0
    elif kind == "const_blocks":  # a constant per block, negative ones too
        consts = torch.randn(blocks, generator=g) * 3
        x = consts.repeat_interleave(block)[:n].clone()
    elif kind == "at_absmax":  # +m and -m exactly, the rest inside
        for b in range(blocks):
            lo, hi = b * block, min(n, (b + 1) * block)
            m = x[lo:hi].abs().max() * 1.5
            x[lo] = m
            if hi - lo > 1:
                x[lo + 1] = -m
    elif kind == "tiny":  # subnormal inputs (the 1e-38 floor)
        x = x * (1e-6 if dtype == torch.float16 else 1e-39)
    return x.to(dtype)


CASES = ["normal", "heavy", "zero_blocks", "const_blocks", "at_absmax", "tiny"]
REF_BLOCKS = [2, 4, 6, 14, 16, 18, 30, 32, 34, 64, 100, 130]
REF_SIZES = [0, 1, 7, 8, 9, 15, 16, 17, 31, 32, 33, 2001]


# ---- NF4 against bitsandbytes --------------------------------------------------------------------


@pytest.mark.parametrize("kind", CASES)
@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=str)
def test_nf4_quantize_matches_bitsandbytes(bnbf, isa, dtype, kind):
    for block in BNB_BLOCKS:
        for n in (1, block - 1, block + 1, 2 * block + 3, 2 * block):
            x = make_input(kind, n, block, dtype, seed=n + block)
            if kind == "zero_blocks":
                x[: (n // block) * block] = 0  # all full blocks zero; partial block nonzero
            packed, absmax = rf.quantize_nf4(x, block_size=block)
            ref_packed, state = bnbf.quantize_4bit(x, blocksize=block, quant_type="nf4")
            assert ref_packed.shape == (packed.numel(), 1)
            assert torch.equal(packed, ref_packed.view(-1)), (block, n)
            if n % block:  # bnb floors only the final partial block's absmax at 1e-38
                assert_bits_equal(absmax[-1:].clamp(min=1e-38), state.absmax[-1:])
                assert_bits_equal(absmax[:-1], state.absmax[:-1])
            else:
                assert_bits_equal(absmax, state.absmax)


def test_nf4_zero_partial_block_absmax(bnbf):
    # docs/NUMERICS.md: absmax is the true max (0 for an all-zero block), also for the final
    # partial block, where bitsandbytes stores its 1e-38 floor instead; the codes agree.
    x = torch.cat([torch.randn(64), torch.zeros(10)])
    packed, absmax = rf.quantize_nf4(x)
    ref_packed, state = bnbf.quantize_4bit(x, blocksize=64, quant_type="nf4")
    assert torch.equal(packed, ref_packed.view(-1))
    assert absmax[1].item() == 0.0 and absmax[0] == state.absmax[0]
    assert torch.equal(packed[32:], torch.full((5,), 0x77, dtype=torch.uint8))


@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=str)
def test_nf4_dequantize_matches_bitsandbytes(bnbf, isa, dtype):
    # Flat shapes: bnb's CPU kernel takes the wrong absmax for some 2-D shapes whose rows are not
    # a multiple of the block (e.g. (8, 96) with blocks of 64); the format itself is flat.
    g = torch.Generator().manual_seed(1)
    for block in BNB_BLOCKS:
        for shape in [(3 * block,), (2 * block + 4,), (35,), (block + 1,)]:
            n = math.prod(shape)
            packed = torch.randint(0, 256, ((n + 1) // 2,), dtype=torch.uint8, generator=g)
            absmax = torch.rand(-(-n // block), generator=g) * 10
            absmax[0] = 0.0
            out = rf.dequantize_nf4(packed, absmax, shape, dtype, block_size=block)
            with torch.compiler.set_stance("force_eager"):  # bnb's fallback path is compiled
                ref = torch.ops.bitsandbytes.dequantize_4bit.default(
                    packed.view(-1, 1), absmax, block, "nf4", list(shape), torch.float32
                )
            assert out.shape == shape and out.dtype == dtype
            assert_bits_equal(out, ref.reshape(shape).to(dtype))


def test_nf4_bitsandbytes_roundtrip_through_its_dequantize(bnbf):
    x = torch.randn(8, 128)
    packed, absmax = rf.quantize_nf4(x)
    _, state = bnbf.quantize_4bit(x, blocksize=64, quant_type="nf4")
    ref = bnbf.dequantize_4bit(packed.view(-1, 1), state)
    assert_bits_equal(rf.dequantize_nf4(packed, absmax, x.shape, torch.float32), ref)


# ---- NF4 against the pure-torch reference --------------------------------------------------------


@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=str)
def test_nf4_matches_reference(isa, dtype):
    for block in REF_BLOCKS:
        for n in REF_SIZES:
            for kind in ("normal", "const_blocks", "at_absmax"):
                x = make_input(kind, n, block, dtype, seed=block * 7 + n)
                packed, absmax = rf.quantize_nf4(x, block_size=block)
                ref_packed, ref_absmax = ref_quantize_nf4(x, block)
                assert torch.equal(packed, ref_packed), (block, n, kind)
                assert_bits_equal(absmax, ref_absmax)
                for out_dtype in FLOAT_DTYPES:
                    out = rf.dequantize_nf4(packed, absmax, (n,), out_dtype, block_size=block)
                    assert_bits_equal(out, ref_dequantize_nf4(packed, absmax, n, block, out_dtype))


def test_nf4_midpoints_take_the_lower_code(isa):
    assert torch.equal(NF4_MID, torch.tensor([(a + b) / 2 for a, b in zip(NF4_CODE[:-1], NF4_CODE[1:])]))
    up = torch.nextafter(NF4_MID, torch.tensor(2.0))
    down = torch.nextafter(NF4_MID, torch.tensor(-2.0))
    for values, expect in ((NF4_MID, torch.arange(15)), (up, torch.arange(1, 16)), (down, torch.arange(15))):
        # blocks of 2: [1.0, v] -> absmax 1, s = v exactly (full blocks: reciprocal path)
        x = torch.stack([torch.ones(15), values], dim=1).reshape(-1)
        packed, absmax = rf.quantize_nf4(x, block_size=2)
        assert torch.equal(absmax, torch.ones(15))
        assert torch.equal(packed, (15 << 4) | expect.to(torch.uint8))
        # the final partial block (division path): one block of 4 holding [1.0, v]
        for k in range(15):
            p, _ = rf.quantize_nf4(torch.stack([torch.tensor(1.0), values[k]]), block_size=4)
            assert p.item() == (15 << 4) | int(expect[k])


def test_nf4_full_blocks_multiply_partial_blocks_divide(bnbf, isa):
    # values next to a midpoint where x * (1/d) and x / d fall on different sides of it
    g = torch.Generator().manual_seed(12)
    cases = []
    for d in (torch.rand(60, generator=g) * 9 + 1).tolist():
        x = NF4_MID * d
        for _ in range(3):
            for y in (x, -x):
                dt = torch.tensor(d)
                c_mul = torch.bucketize(y * (1.0 / dt), NF4_MID)
                c_div = torch.bucketize(y / dt, NF4_MID)
                cases += [(d, v, int(a), int(b)) for v, a, b in zip(y.tolist(), c_mul, c_div) if a != b]
            x = torch.nextafter(x, torch.tensor(1e9))
    assert len(cases) > 20
    for d, v, c_mul, c_div in cases[:40]:
        full = torch.zeros(32)
        full[0], full[1] = d, v
        packed, _ = rf.quantize_nf4(full, block_size=32)  # a full block: reciprocal
        assert packed[0].item() == (15 << 4) | c_mul
        assert torch.equal(packed, bnbf.quantize_4bit(full, blocksize=32, quant_type="nf4")[0].view(-1))
        part = torch.tensor([d, v])
        packed, _ = rf.quantize_nf4(part, block_size=32)  # the final partial block: division
        assert packed[0].item() == (15 << 4) | c_div
        assert torch.equal(packed, bnbf.quantize_4bit(part, blocksize=32, quant_type="nf4")[0].view(-1))


def test_nf4_packing_and_odd_n(isa):
    x = torch.tensor([-1.0, 1.0, 0.0, 0.5, -0.3])  # codes 0, 15, 7, 12, 4 (absmax 1), pad 7
    packed, absmax = rf.quantize_nf4(x, block_size=64)
    assert absmax.tolist() == [1.0]
    assert packed.tolist() == [0x0F, 0x7C, 0x47]


def test_nf4_nan_is_ignored_and_coded_as_zero():
    x = torch.randn(200)
    x[[3, 77, 150]] = float("nan")
    results = []
    for name in supported_isas():
        with using_isa(name):
            results.append(rf.quantize_nf4(x, block_size=64) + rf.quantize_int8(x, block_size=64))
    for r in results[1:]:
        for a, b in zip(results[0], r):
            assert torch.equal(
                a.view(torch.uint8) if a.dtype != torch.float32 else bits(a),
                b.view(torch.uint8) if b.dtype != torch.float32 else bits(b),
            )
    packed, absmax, codes, absmax8 = results[0]
    clean = torch.nan_to_num(x, nan=0.0)
    ref_packed, ref_absmax = ref_quantize_nf4(clean, 64)
    assert torch.equal(packed, ref_packed) and torch.equal(absmax, ref_absmax)
    assert torch.equal(absmax8, ref_absmax)
    assert torch.equal(codes, ref_quantize_int8(clean, 64)[0])


# ---- int8 ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=str)
def test_int8_matches_reference(isa, dtype):
    for block in REF_BLOCKS + [4096]:
        for n in REF_SIZES:
            for kind in ("normal", "heavy", "zero_blocks", "const_blocks", "at_absmax", "tiny"):
                x = make_input(kind, n, block, dtype, seed=block + n)
                codes, absmax = rf.quantize_int8(x, block_size=block)
                ref_codes, ref_absmax = ref_quantize_int8(x, block)
                assert codes.shape == x.shape and codes.dtype == torch.int8
                assert torch.equal(codes, ref_codes), (block, n, kind)
                assert_bits_equal(absmax, ref_absmax)


def test_int8_rounds_half_to_even(isa):
    # values v for which (v / 1.0) * 127 is exactly k + 0.5 in float32
    found = []
    for k in range(-127, 127):
        v = torch.tensor((k + 0.5) / 127, dtype=torch.float32)
        for _ in range(4):
            if ((v / 1.0) * 127.0).item() == k + 0.5:
                found.append((v.item(), k))
                break
            v = torch.nextafter(v, torch.tensor(2.0))
    assert len(found) > 100
    vals = torch.tensor([v for v, _ in found])
    x = torch.stack([torch.ones_like(vals), vals], dim=1).reshape(-1)  # blocks of 2, absmax 1
    codes, _ = rf.quantize_int8(x, block_size=2)
    got = codes[1::2].tolist()
    for (_, k), q in zip(found, got):
        expect = k if k % 2 == 0 else k + 1  # k + 0.5 -> the even neighbour
        assert q == expect, (k, q)
    assert any(k % 2 == 0 for _, k in found) and any(k % 2 for _, k in found)


@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=str)
def test_int8_agrees_with_bitsandbytes_blockwise(bnbf, dtype):
    # bitsandbytes with a linear code (index i <-> (i - 127) / 127) stores the same absmax; its CPU
    # search is only approximately nearest: it may pick the other neighbour when x/absmax*127 lies
    # within ~2e-3 of a half-integer. Everywhere else the codes are equal.
    code = torch.cat([torch.arange(-127, 128) / 127, torch.tensor([1.0])])
    x = torch.randn(1 << 18, generator=torch.Generator().manual_seed(5)).to(dtype)
    for block in (64, 256, 2048, 6, 100):
        codes, absmax = rf.quantize_int8(x, block_size=block)
        ref, state = bnbf.quantize_blockwise(x, code=code, blocksize=block)
        assert_bits_equal(absmax, state.absmax)
        diff = ref.long() - 127 - codes.long()
        assert diff.abs().max() <= 1
        agree = (diff == 0).double().mean().item()
        assert agree >= (0.998 if dtype == torch.float32 else 0.995), agree
        s = x.double() / absmax.double().repeat_interleave(block)[: x.numel()] * 127
        frac = s - s.floor()
        assert ((frac[diff != 0] - 0.5).abs() < 5e-3).all()
        assert ((codes.double() - s).abs() <= 0.5 + 1e-4).all()  # ours is the nearest level


@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=str)
def test_int8_dequantize_matches_reference(isa, dtype):
    g = torch.Generator().manual_seed(2)
    for block in (2, 6, 16, 18, 64, 100):
        for n in (0, 1, 15, 16, 17, 33, 1001):
            codes = torch.randint(-127, 128, (n,), dtype=torch.int8, generator=g)
            absmax = torch.rand(-(-n // block), generator=g) * 100
            if absmax.numel():
                absmax[0] = 0.0
            out = rf.dequantize_int8(codes, absmax, (n,), dtype, block_size=block)
            assert_bits_equal(out, ref_dequantize_int8(codes, absmax, n, block, dtype))


# ---- round trip ----------------------------------------------------------------------------------


def test_roundtrip_error_bounds(isa):
    x = torch.randn(1 << 16, generator=torch.Generator().manual_seed(3))
    codes, a8 = rf.quantize_int8(x)
    y8 = rf.dequantize_int8(codes, a8, x.shape, torch.float32)
    err8 = (y8 - x).abs()
    assert err8.mean() / x.abs().mean() < 0.008
    assert (err8 <= a8.repeat_interleave(64) / 254 * (1 + 1e-5)).all()  # half a level
    packed, a4 = rf.quantize_nf4(x)
    y4 = rf.dequantize_nf4(packed, a4, x.shape, torch.float32)
    err4 = (y4 - x).abs()
    assert err4.mean() / x.abs().mean() < 0.1
    max_half_gap = ((NF4_CODE[1:] - NF4_CODE[:-1]) / 2).max()
    assert (err4 <= a4.repeat_interleave(64) * max_half_gap * (1 + 1e-5)).all()


def test_shapes_and_empty():
    x = torch.randn(3, 5, 7)
    packed, absmax = rf.quantize_nf4(x, block_size=16)
    assert packed.shape == (53,) and absmax.shape == (7,)
    assert rf.dequantize_nf4(packed, absmax, x.shape, block_size=16).shape == (3, 5, 7)
    assert rf.dequantize_nf4(packed, absmax, torch.Size([105]), block_size=16).shape == (105,)
    codes, absmax = rf.quantize_int8(x)
    assert codes.shape == x.shape and absmax.shape == (2,)
    for shape in ((0,), (0, 5)):
        e = torch.empty(shape)
        p, a = rf.quantize_nf4(e)
        assert p.shape == (0,) and a.shape == (0,)
        assert rf.dequantize_nf4(p, a, shape).shape == shape
        c, a = rf.quantize_int8(e)
        assert c.shape == shape and rf.dequantize_int8(c, a, shape).shape == shape
    # requires_grad inputs are read without copies
    w = torch.randn(130, requires_grad=True)
    assert torch.equal(rf.quantize_nf4(w)[0], rf.quantize_nf4(w.detach())[0])


# ---- CUDA (run by the lead on a GPU machine) -----------------------------------------------------


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=str)
def test_cuda_dequantize_matches_host(dtype):
    g = torch.Generator().manual_seed(11)
    for block in (2, 6, 64, 100, 4096):
        for shape in ((1,), (17,), (3, 1001), (64, 64)):
            n = math.prod(shape)
            x = torch.randn(n, generator=g) * 3
            packed, absmax = rf.quantize_nf4(x, block_size=block)
            host = rf.dequantize_nf4(packed, absmax, shape, dtype, block_size=block)
            dev = rf.dequantize_nf4(packed.cuda(), absmax.cuda(), shape, dtype, block_size=block)
            assert dev.is_cuda and dev.shape == shape
            assert_bits_equal(dev.cpu(), host)
            codes, absmax8 = rf.quantize_int8(x, block_size=block)
            host = rf.dequantize_int8(codes, absmax8, shape, dtype, block_size=block)
            dev = rf.dequantize_int8(codes.cuda(), absmax8.cuda(), shape, dtype, block_size=block)
            assert dev.is_cuda and dev.shape == shape
            assert_bits_equal(dev.cpu(), host)
