"""Independent references of docs/NUMERICS.md rules 1-5 in torch/numpy (CPU), for the kernel tests."""

from __future__ import annotations

import math

import numpy as np
import torch

from _quant_helpers import NF4_CODE

# the NF4 table, typed in once for every test (tests/_quant_helpers.py)
NF4_TABLE = NF4_CODE

M32 = 0xFFFFFFFF


# ---- dequantization (rules 4, 5; torch's float -> bf16/fp16 casts are RNE, rule 1) -----------
def dequant_nf4(packed: torch.Tensor, absmax: torch.Tensor, n: int, block: int, dtype) -> torch.Tensor:
    p = packed.cpu().to(torch.int64)
    codes = torch.stack([p >> 4, p & 15], dim=1).reshape(-1)[:n]
    scale = absmax.cpu().repeat_interleave(block)[:n]
    return (NF4_TABLE[codes] * scale).to(dtype)


def dequant_int8(codes: torch.Tensor, absmax: torch.Tensor, n: int, block: int, dtype) -> torch.Tensor:
    a = absmax.cpu()
    scale = (a / torch.full_like(a, 127.0)).repeat_interleave(block)[:n]  # tensor / tensor: true division
    return (codes.cpu().to(torch.float32) * scale).to(dtype)


# ---- stochastic rounding (rule 2), uint32 arithmetic in int64 tensors -----------------------
def _mul32(a: torch.Tensor, c: int) -> torch.Tensor:
    """(a * c) mod 2^32 for int64 a in [0, 2^32) without overflowing int64."""
    return (a * (c & 0xFFFF) + (((a * (c >> 16)) & 0xFFFF) << 16)) & M32


def sr_bits(seed: int, step: int, idx: torch.Tensor, moment: int) -> torch.Tensor:
    """The 16 random bits of rule 2 for int64 indices idx (= index + offset)."""
    base = (
        (seed & M32) * 0xC2B2AE3D
        + (seed >> 32) * 0x27D4EB2F
        + (step & M32) * 0x165667B1
        + moment * 0xD3A2646C
    ) & M32
    k = (_mul32(idx & M32, 0x9E3779B1) + _mul32(idx >> 32, 0x85EBCA77) + base) & M32
    k = k ^ (k >> 16)
    k = _mul32(k, 0x7FEB352D)
    k = k ^ (k >> 15)
    k = _mul32(k, 0x846CA68B)
    k = k ^ (k >> 16)
    return k & 0xFFFF


def _bits16_to_bf16(h: torch.Tensor) -> torch.Tensor:
    h = torch.where(h >= 0x8000, h - 0x10000, h)
    return h.to(torch.int16).view(torch.bfloat16)


def bf16_sr(x: torch.Tensor, r: torch.Tensor) -> torch.Tensor:
    """float32 -> bfloat16 with the random bits r (rule 2)."""
    u = x.contiguous().view(torch.int32).to(torch.int64) & M32
    special = (u & 0x7F800000) == 0x7F800000
    nan = special & ((u & 0x007FFFFF) != 0)
    h = torch.where(special, (u >> 16) | torch.where(nan, 0x40, 0), (u + r) >> 16)
    return _bits16_to_bf16(h)


def bf16_rne_bits(x: torch.Tensor) -> torch.Tensor:
    """float32 -> bf16 bit patterns (int64) by rule 1, NaN -> 0x7FC0 with the sign kept."""
    u = x.contiguous().view(torch.int32).to(torch.int64) & M32
    nan = (u & 0x7FFFFFFF) > 0x7F800000
    return torch.where(nan, ((u >> 16) & 0x8000) | 0x7FC0, ((u + 0x7FFF + ((u >> 16) & 1)) >> 16) & 0xFFFF)


# ---- AdamW (rule 3) in numpy float32; fma emulated in float64 ------------------------------
def adamw_coefficients(*, lr, beta1, beta2, eps, weight_decay, step, grad_scale=1.0):
    f = np.float32
    w = f(1.0 - beta1)
    from_grad = not (abs(w) < f(0.5))
    return {
        "decay": f(1.0 - lr * weight_decay),
        "apply_decay": weight_decay != 0.0,
        "coeff": f(w - f(1.0)) if from_grad else w,
        "from_grad": from_grad,
        "beta2": f(beta2),
        "c2": f(1.0 - beta2),
        "bc2_sqrt": f(math.sqrt(1.0 - beta2**step)),
        "nss": f(-(lr / (1.0 - beta1**step))),
        "eps": f(eps),
        "grad_scale": f(grad_scale),
        "apply_scale": f(grad_scale) != f(1.0),
    }


def adamw_step(p, g, m, v, **hyper):
    """One step of the vector-body formula on float32 numpy arrays; returns new (p, m, v)."""
    c = adamw_coefficients(**hyper)
    p, g, m, v = (np.asarray(a, dtype=np.float32).copy() for a in (p, g, m, v))
    if c["apply_scale"]:
        g = g * c["grad_scale"]
    if c["apply_decay"]:
        p = p * c["decay"]
    base = g if c["from_grad"] else m
    m = (np.float64(c["coeff"]) * (g - m).astype(np.float64) + base.astype(np.float64)).astype(np.float32)
    v = (
        (c["c2"] * g).astype(np.float64) * g.astype(np.float64) + (v * c["beta2"]).astype(np.float64)
    ).astype(np.float32)  # fma, as torch fuses it
    d = np.sqrt(v) / c["bc2_sqrt"] + c["eps"]
    p = p + (c["nss"] * m) / d
    return p, m, v
