"""Loads the compiled core, ``ramstream._C``, with an error that says what to do when it is missing."""

from __future__ import annotations

import functools


@functools.cache
def lib():
    """The compiled module. Raises ImportError with a fix when the package was not built."""
    try:
        from . import _C  # noqa: PLC0415
    except ImportError as e:  # pragma: no cover - only when run from an unbuilt source tree
        raise ImportError(
            "ramstream._C (the compiled core) is missing: install the package with "
            "'pip install .' (or a ramstream-cu12 / ramstream-cu13 wheel) instead of importing "
            f"it from the source tree ({e})"
        ) from e
    return _C  # a bad RAMSTREAM_* value the core reads is reported at `import ramstream` (env.py)


def cuda_available() -> bool:
    """True when this build has CUDA kernels and the CUDA runtime sees a GPU."""
    c = lib()
    return bool(c.built_with_cuda()) and c.cuda_device_count() > 0
