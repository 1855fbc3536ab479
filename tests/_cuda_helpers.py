"""Helpers of the CUDA kernel tests: dtypes, AdamW hyper-parameters, the host kernels, a bitwise
comparison that lets NaN payloads differ, the `dev` fixture.

Fixtures are found by pytest once imported into a test module:
``from _cuda_helpers import dev  # noqa: F401``.
"""

from __future__ import annotations

import pytest
import torch

import ramstream.functional as F

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
HYPER = dict(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=1e-2)


def _host(name: str):
    """A host kernel from ramstream.functional (written by the quant / adamw areas)."""
    fn = getattr(F, name, None)
    if fn is None:
        pytest.fail(f"ramstream.functional.{name} is missing (it comes with the host kernels)")
    return fn


_BITS = {4: torch.int32, 2: torch.int16}


def _same(a: torch.Tensor, b: torch.Tensor) -> None:
    """Bit-identical, except that NaNs only have to sit at the same places (their payloads differ
    between CPU and GPU arithmetic)."""
    a, b = a.detach().cpu().reshape(-1), b.detach().cpu().reshape(-1)
    assert a.dtype == b.dtype and a.shape == b.shape, (a.dtype, b.dtype, a.shape, b.shape)
    nan = torch.isnan(a)
    assert torch.equal(nan, torch.isnan(b)), "NaNs at different places"
    bits = _BITS[a.element_size()]
    diff = torch.nonzero(a[~nan].view(bits) != b[~nan].view(bits))
    if diff.numel():
        i = diff[0].item()
        raise AssertionError(
            f"{diff.numel()} of {a.numel()} values differ; first at {i}: "
            f"{a[~nan][i].item()!r} != {b[~nan][i].item()!r}"
        )


@pytest.fixture
def dev():
    return torch.device("cuda", torch.cuda.current_device())
