"""ramstream: train PyTorch models larger than GPU memory by streaming state from host RAM."""
from __future__ import annotations

__version__ = "0.1.0"

__all__ = ["__version__"]
