"""tests/compat: scripts written as TrainStream's and RamTorch's documentation shows them; the
helpers in tests/ (_models.py) are importable from here too."""

from __future__ import annotations

import os
import sys

_TESTS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _TESTS not in sys.path:
    sys.path.insert(0, _TESTS)
