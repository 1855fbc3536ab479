"""Helpers of the quantization tests: the float dtypes, the NF4 format typed in independently of
the C++, bitwise comparison."""

from __future__ import annotations

import torch

FLOAT_DTYPES = [torch.float32, torch.bfloat16, torch.float16]

# The NF4 format, typed in independently of the C++ (docs/NUMERICS.md rule 4).
NF4_CODE = torch.tensor(
    [
        -1.0,
        -0.6961928009986877,
        -0.5250730514526367,
        -0.39491748809814453,
        -0.28444138169288635,
        -0.18477343022823334,
        -0.09105003625154495,
        0.0,
        0.07958029955625534,
        0.16093020141124725,
        0.24611230194568634,
        0.33791524171829224,
        0.44070982933044434,
        0.5626170039176941,
        0.7229568362236023,
        1.0,
    ],
    dtype=torch.float32,
)
NF4_MID = (NF4_CODE[:-1] + NF4_CODE[1:]) / 2  # float32 arithmetic


def bits(t: torch.Tensor) -> torch.Tensor:
    """Raw bits of a float tensor, for bitwise comparison (NaNs compare by payload)."""
    view = {torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float16: torch.int16}
    return t.contiguous().view(view[t.dtype])


def assert_bits_equal(a: torch.Tensor, b: torch.Tensor) -> None:
    assert a.dtype == b.dtype and a.shape == b.shape
    diff = (bits(a) != bits(b)).nonzero()
    assert diff.numel() == 0, (
        f"{diff.shape[0]} differ, first at {diff[0].tolist()}: "
        f"{a.flatten()[diff[0]]} vs {b.flatten()[diff[0]]}"
    )
