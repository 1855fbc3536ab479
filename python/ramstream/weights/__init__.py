"""The weight streamer: streamed blocks' weights live in pinned host memory and visit the device
only while their block runs (slab.py: the mechanism of one flat run; streamer.py: the window and
its hooks; setup.py: which blocks stream, and wiring into a wrapped model; disk_slab.py: frozen
weights at home on disk instead, read through a window-sized staging ring)."""

from .slab import Slab, make_copier
from .streamer import Block, WeightStreamer

__all__ = ["Block", "Slab", "WeightStreamer", "make_copier"]
