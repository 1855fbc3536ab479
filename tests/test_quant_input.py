"""Blockwise NF4 / int8 quantization: argument checking in Python and in the bindings."""

from __future__ import annotations

import pytest
import torch

import ramstream.functional as rf
from ramstream._native import lib

C = lib()


# ---- bad input -----------------------------------------------------------------------------------


@pytest.mark.parametrize("block_size", [3, 0, 1, -2, 63, 64.0, "64", True, None])
def test_bad_block_size(block_size):
    x = torch.randn(100)
    packed, absmax = rf.quantize_nf4(x)
    codes, absmax8 = rf.quantize_int8(x)
    calls = [
        lambda: rf.quantize_nf4(x, block_size=block_size),
        lambda: rf.quantize_int8(x, block_size=block_size),
        lambda: rf.dequantize_nf4(packed, absmax, x.shape, block_size=block_size),
        lambda: rf.dequantize_int8(codes, absmax8, x.shape, block_size=block_size),
    ]
    for call in calls:
        with pytest.raises(ValueError, match="block_size"):
            call()


def test_bad_dtypes():
    x = torch.randn(128)
    packed, absmax = rf.quantize_nf4(x)
    codes, absmax8 = rf.quantize_int8(x)
    for bad in (x.double(), x.long(), x.to(torch.int8)):
        with pytest.raises(TypeError, match="x must be float32/bfloat16/float16"):
            rf.quantize_nf4(bad)
        with pytest.raises(TypeError, match="x must be float32/bfloat16/float16"):
            rf.quantize_int8(bad)
    with pytest.raises(TypeError, match="packed must be uint8"):
        rf.dequantize_nf4(packed.view(torch.int8), absmax, x.shape)
    with pytest.raises(TypeError, match="absmax must be float32"):
        rf.dequantize_nf4(packed, absmax.half(), x.shape)
    with pytest.raises(TypeError, match="codes must be int8"):
        rf.dequantize_int8(codes.view(torch.uint8), absmax8, x.shape)
    with pytest.raises(TypeError, match="absmax must be float32"):
        rf.dequantize_int8(codes, absmax8.double(), x.shape)
    for bad_dtype in (torch.float64, torch.int8, "bfloat16"):
        with pytest.raises(TypeError, match="dtype must be"):
            rf.dequantize_nf4(packed, absmax, x.shape, bad_dtype)
        with pytest.raises(TypeError, match="dtype must be"):
            rf.dequantize_int8(codes, absmax8, x.shape, bad_dtype)
    with pytest.raises(TypeError, match="torch.Tensor"):
        rf.quantize_nf4([1.0, 2.0])
    with pytest.raises(TypeError, match="shape"):
        rf.dequantize_nf4(packed, absmax, 128.0)


def test_non_contiguous():
    x = torch.randn(64, 64)
    with pytest.raises(ValueError, match=r"contiguous.*\.contiguous\(\)"):
        rf.quantize_nf4(x.t())
    with pytest.raises(ValueError, match="contiguous"):
        rf.quantize_int8(x[:, ::2])
    packed, absmax = rf.quantize_nf4(x)
    p2 = torch.stack([packed, packed], 1)[:, 0]
    with pytest.raises(ValueError, match="packed must be contiguous"):
        rf.dequantize_nf4(p2, absmax, x.shape)
    a2 = torch.stack([absmax, absmax], 1)[:, 0]
    with pytest.raises(ValueError, match="absmax must be contiguous"):
        rf.dequantize_nf4(packed, a2, x.shape)
    codes, absmax8 = rf.quantize_int8(x)
    with pytest.raises(ValueError, match="codes must be contiguous"):
        rf.dequantize_int8(codes.t(), absmax8, x.shape)


def test_mismatched_sizes():
    x = torch.randn(1000)
    packed, absmax = rf.quantize_nf4(x)
    with pytest.raises(ValueError, match=r"packed has 500 bytes, expected 501"):
        rf.dequantize_nf4(packed, absmax, (1001,))
    with pytest.raises(ValueError, match=r"absmax has 15 entries, expected 16"):
        rf.dequantize_nf4(packed, absmax[:-1], x.shape)
    with pytest.raises(ValueError, match=r"absmax has 16 entries, expected 8"):
        rf.dequantize_nf4(packed, absmax, x.shape, block_size=128)
    codes, absmax8 = rf.quantize_int8(x)
    with pytest.raises(ValueError, match=r"codes has 1000 elements, expected 999"):
        rf.dequantize_int8(codes, absmax8, (999,))
    with pytest.raises(ValueError, match=r"absmax has 16 entries, expected 4"):
        rf.dequantize_int8(codes, absmax8, x.shape, block_size=256)
    with pytest.raises(ValueError, match="negative"):
        rf.dequantize_int8(codes, absmax8, (-1000,))


def test_quantize_rejects_non_host_input():
    x = torch.empty(100, device="meta")
    for fn in (rf.quantize_nf4, rf.quantize_int8):
        with pytest.raises(ValueError, match=r"runs on the host.*x\.cpu\(\)"):
            fn(x)


def test_binding_checks():
    x = torch.randn(100)
    packed = torch.empty(50, dtype=torch.uint8)
    absmax = torch.empty(2)
    with pytest.raises(ValueError, match="block_size must be even"):
        C.quantize_nf4(x, packed, absmax, 3)
    with pytest.raises(ValueError, match=r"packed has 49 elements, expected 50"):
        C.quantize_nf4(x, packed[:49], absmax, 64)
    with pytest.raises(ValueError, match=r"absmax has 2 elements, expected 1"):
        C.quantize_nf4(x, packed, absmax, 128)
    with pytest.raises(TypeError):
        C.quantize_nf4(x.double(), packed, absmax, 64)
    with pytest.raises(TypeError):
        C.quantize_int8(x, packed, absmax, 64)  # codes must be int8
    out = torch.empty(10, 20)
    with pytest.raises(ValueError, match="contiguous"):
        C.dequantize_nf4(packed, absmax, out.t(), 64)  # in-place output is never copied


# ---- CUDA (run by the lead on a GPU machine) -----------------------------------------------------


@pytest.mark.cuda
def test_quantize_rejects_cuda_input():
    x = torch.randn(100, device="cuda")
    for fn in (rf.quantize_nf4, rf.quantize_int8):
        with pytest.raises(ValueError, match=r"runs on the host.*x\.cpu\(\)"):
            fn(x)
