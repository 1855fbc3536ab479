"""Helpers of the pinned host arena tests: sizes and dtypes, the arena's counters, random
tensors, a fixture that restores the page-lock budget.

Fixtures are found by pytest once imported into a test module:
``from _memory_helpers import restore_budget  # noqa: F401``.
"""

from __future__ import annotations

import pytest
import torch

import ramstream

MiB = 1 << 20
ALL_DTYPES = [
    torch.float32,
    torch.bfloat16,
    torch.float16,
    torch.uint8,
    torch.int8,
    torch.int16,
    torch.int32,
    torch.int64,
    torch.float64,
    torch.bool,
]


def stats() -> dict:
    return ramstream.memory_stats()


def pinning() -> bool:
    return bool(stats()["pinning_available"])


def random_like(shape, dtype, gen) -> torch.Tensor:
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=gen).bool()
    if dtype.is_floating_point:
        return torch.randn(shape, generator=gen).to(dtype)
    info = torch.iinfo(dtype)
    return torch.randint(max(info.min, -1000), min(info.max, 1000), shape, generator=gen).to(dtype)


@pytest.fixture
def restore_budget():
    before = ramstream.pin_budget()
    yield before
    ramstream.set_pin_budget(before)
