"""ramstream.quant: packed int8/NF4 frozen weights expanded right before use (quantize_model)."""

from __future__ import annotations

from .model import dequantize_model, quantize_model
from .packed import QuantLinearFn, is_quantized

__all__ = ["quantize_model", "dequantize_model", "QuantLinearFn", "is_quantized"]
