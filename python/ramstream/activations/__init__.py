"""Activation paging: saved tensors of chosen blocks go to host RAM in forward and come back ahead
of backward.

    hooks.py    ActivationOffloader: the saved-tensor hooks, prefetch order, counters
    buffers.py  the host buffer pool, the copy engines (CUDA streams or CPU copies), records
    policy.py   ActivationPolicy: wrap()'s choice of blocks (fixed, a fraction, or "auto")
    blocks.py   find_blocks(): a model's repeated layer stack
"""

from __future__ import annotations

from ..blocks import find_blocks
from .hooks import ActivationOffloader
from .policy import ActivationPolicy

__all__ = ["find_blocks", "ActivationOffloader", "ActivationPolicy"]
