"""Activation paging: saved tensors of chosen blocks go to host RAM in forward and come back ahead
of backward. The choice of blocks (fixed, a fraction, or "auto" from measured steps) is
runtime/activation_policy.py ActivationPolicy's.

    hooks.py    ActivationOffloader: the saved-tensor hooks, prefetch order, counters
    buffers.py  the host buffer pool, the copy engines (CUDA streams or CPU copies), records
    blocks.py   find_blocks(): a model's repeated layer stack
"""

from __future__ import annotations

from ..blocks import find_blocks
from .hooks import ActivationOffloader

__all__ = ["find_blocks", "ActivationOffloader"]
