"""ramstream.functional: the low-level kernels on tensors (CPU; CUDA where a CUDA kernel exists).

Every function validates its arguments and raises ValueError/TypeError naming the bad one;
in-place arguments are never copied silently.
"""
from __future__ import annotations

from .ops.quant import dequantize_int8, dequantize_nf4, quantize_int8, quantize_nf4

__all__: list[str] = [
    "quantize_nf4",
    "dequantize_nf4",
    "quantize_int8",
    "dequantize_int8",
]
