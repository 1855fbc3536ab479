"""ramstream.functional: the low-level kernels on tensors (CPU; CUDA where a CUDA kernel exists).

Every function validates its arguments and raises ValueError/TypeError naming the bad one;
in-place arguments are never copied silently.
"""
from __future__ import annotations

from .ops.adamw import accumulate_, adamw_, sq_norm

__all__: list[str] = []
__all__ += ["adamw_", "sq_norm", "accumulate_"]
