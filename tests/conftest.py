"""Test configuration: the `cuda` marker skips without a GPU (fails with RAMSTREAM_REQUIRE_CUDA=1);
the hardware profile's cache goes to a folder of the test session's own, so that a profile measured
under a test's conditions never reaches the user's cache (and the benchmarks run after the tests)."""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile

import pytest

if "RAMSTREAM_CACHE_DIR" not in os.environ:
    os.environ["RAMSTREAM_CACHE_DIR"] = tempfile.mkdtemp(prefix="ramstream-test-cache-")
    atexit.register(shutil.rmtree, os.environ["RAMSTREAM_CACHE_DIR"], ignore_errors=True)  # the session's own


def _gpu_ready() -> tuple[bool, str]:
    try:
        import torch

        from ramstream._native import cuda_available
    except Exception as e:  # pragma: no cover
        return False, f"import failed: {e}"
    if not torch.cuda.is_available():
        return False, "torch sees no GPU"
    if not cuda_available():
        from ramstream._native import lib

        return False, f"ramstream built without usable CUDA: {lib().cuda_unavailable_reason()}"
    return True, ""


def pytest_collection_modifyitems(config, items):
    from ramstream import env

    try:
        require = env.get("RAMSTREAM_REQUIRE_CUDA")  # "0" or "1"; another value is an error
    except ValueError as e:
        raise pytest.UsageError(str(e)) from None
    ok, why = _gpu_ready()
    if ok:
        return
    cuda_items = [item for item in items if item.get_closest_marker("cuda") is not None]
    if cuda_items and require:
        raise pytest.UsageError(f"RAMSTREAM_REQUIRE_CUDA=1 but no usable GPU: {why}")
    for item in cuda_items:
        item.add_marker(pytest.mark.skip(reason=f"needs a GPU: {why}"))
