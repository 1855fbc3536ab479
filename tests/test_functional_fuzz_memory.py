"""Bad input for ramstream.functional's pinned host memory functions (the kernels are in
test_functional_fuzz.py): shapes, dtypes, huge sizes, budgets, registration. Each case works or
raises ValueError/TypeError/MemoryError naming the function and the argument."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import ramstream.functional as F
from test_functional_fuzz import ALL_DTYPES, BAD_OBJECTS, raises

# ---- pinned host memory -----------------------------------------------------------------------


@pytest.fixture
def keep_budget():
    b = F.pin_budget()
    yield
    F.set_pin_budget(b)


@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=str)
def test_pinned_empty_dtypes_and_shapes(dtype):
    if dtype == torch.complex64:
        raises(TypeError, "pinned_empty", "dtype", lambda: F.pinned_empty(3, dtype))
        return
    for shape, want in (
        (np.int64(3), (3,)),
        (torch.Size([2, 0]), (2, 0)),
        ((), ()),
        (torch.tensor(4), (4,)),
        ([np.int32(2), 3], (2, 3)),
    ):
        t = F.pinned_empty(shape, dtype)
        assert t.shape == want and t.dtype == dtype and t.is_contiguous()
    for bad in (None, -1, (2, -1), 2.5, "3", torch.tensor(2.5), (True,), [[2]]):
        raises(ValueError, "pinned_empty", "shape", lambda: F.pinned_empty(bad, dtype))
    for bad in (None, "float32", float, np.float32):
        raises(TypeError, "pinned_empty", "dtype", lambda: F.pinned_empty(3, bad))


@pytest.mark.parametrize(
    "shape,dtype",
    [
        (2**62, torch.uint8),
        (2**62, torch.float32),
        (2**63, torch.uint8),
        ((2**31, 2**31, 8), torch.float64),
        ((2**40, 0, 2**40), torch.float64),
    ],
)
def test_pinned_empty_huge_is_memory_error_with_arithmetic(shape, dtype):
    if 0 in (shape if isinstance(shape, tuple) else (shape,)):
        assert F.pinned_empty(shape, dtype).numel() == 0
        return
    with pytest.raises(
        MemoryError, match=r"pinned_empty: shape .* needs \d+ elements x \d bytes = \d+ bytes"
    ):
        F.pinned_empty(shape, dtype)


def test_pin_budget_strings_numbers_and_types(keep_budget):
    for bad in ("abc", "-5G", "200%", "", "5Q", "99999999999999999999999G", "1.5.2G"):
        raises(ValueError, "set_pin_budget", "bytes_or_fraction", lambda: F.set_pin_budget(bad))
    for bad in (-1, 2**64, float("nan"), -0.5, 1.5, float("inf")):
        raises(ValueError, "set_pin_budget", "", lambda: F.set_pin_budget(bad))
    for bad in (None, [1], True, torch.tensor(1.0)):
        raises(TypeError, "set_pin_budget", "", lambda: F.set_pin_budget(bad))
    assert F.set_pin_budget("1G") == 2**30 == F.pin_budget()
    assert F.set_pin_budget(np.int64(2**20)) == 2**20 == F.pin_budget()
    ram = F.memory_stats()["physical_memory"]
    assert F.set_pin_budget(0.25) == int(ram * 0.25) == F.pin_budget()
    for fn in (F.memory_stats, F.pin_budget, F.empty_cache, F.reset_peak_memory_stats):
        with pytest.raises(TypeError):
            fn(1)


def test_register_unregister_bad_input_and_double_unregister():
    for fn in (F.register_host_memory, F.unregister_host_memory):
        op = fn.__name__
        for bad in BAD_OBJECTS:
            raises(TypeError, op, "t", lambda: fn(bad))
        raises(ValueError, op, "t", lambda: fn(torch.zeros(4, 4).t()))
        raises(ValueError, op, "t", lambda: fn(torch.zeros(4, device="meta")))
        raises(ValueError, op, "t", lambda: fn(torch.zeros(0)))
    t = torch.zeros(1 << 14)
    try:
        F.register_host_memory(t)
    except RuntimeError as e:  # no driver/GPU: documented, and the reason is given
        assert "CUDA" in str(e)
        with pytest.raises(RuntimeError, match="CUDA"):
            F.unregister_host_memory(t)
        return
    F.unregister_host_memory(t)
    raises(ValueError, "unregister_host_memory", "t", lambda: F.unregister_host_memory(t))
    raises(ValueError, "unregister_host_memory", "t", lambda: F.unregister_host_memory(torch.zeros(4)))
