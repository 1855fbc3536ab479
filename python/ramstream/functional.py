"""ramstream.functional: the low-level kernels on tensors (CPU; CUDA where a CUDA kernel exists).

Every function validates its arguments and raises ValueError/TypeError naming the bad one;
in-place arguments are never copied silently.
"""

from __future__ import annotations

from .ops.adamw import accumulate_, adamw_, sq_norm
from .ops.memory import (
    empty_cache,
    memory_stats,
    pin_budget,
    pinned_empty,
    register_host_memory,
    reset_peak_memory_stats,
    set_pin_budget,
    unregister_host_memory,
)
from .ops.quant import dequantize_int8, dequantize_nf4, quantize_int8, quantize_nf4

__all__: list[str] = [
    # host AdamW and norms (ops/adamw.py)
    "adamw_",
    "sq_norm",
    "accumulate_",
    # pinned host memory (ops/memory.py)
    "pinned_empty",
    "memory_stats",
    "set_pin_budget",
    "pin_budget",
    "empty_cache",
    "reset_peak_memory_stats",
    "register_host_memory",
    "unregister_host_memory",
    # blockwise quantization (ops/quant.py)
    "quantize_nf4",
    "dequantize_nf4",
    "quantize_int8",
    "dequantize_int8",
]
