"""ramstream: train PyTorch models larger than GPU memory by streaming state from host RAM.

    model, optimizer = ramstream.wrap(model, optimizer)
"""
from __future__ import annotations

__version__ = "0.1.0"

from . import functional  # noqa: E402
from .optim import OffloadAdamW  # noqa: E402
from .wrap import memory_report, unwrap, wrap  # noqa: E402

__all__ = ["OffloadAdamW", "functional", "memory_report", "unwrap", "wrap", "__version__"]
