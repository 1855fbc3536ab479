"""ramstream: train PyTorch models larger than GPU memory by streaming state from host RAM."""
from __future__ import annotations

__version__ = "0.1.0"

# pinned host memory (ops/memory.py)
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

__all__ = [
    "__version__",
    # pinned host memory
    "pinned_empty",
    "memory_stats",
    "set_pin_budget",
    "pin_budget",
    "empty_cache",
    "reset_peak_memory_stats",
    "register_host_memory",
    "unregister_host_memory",
]
