"""The host kernels' ISAs in tests: each in turn (skipping those this CPU lacks), restored after.

Fixtures are found by pytest once imported into a test module:
``from _isa import ISAS, isa, restore_isa, restore_threads  # noqa: F401``.
"""

from __future__ import annotations

import contextlib

import pytest

from ramstream._native import lib

C = lib()
ISAS = ["scalar", "avx2", "avx512"]


def supported_isas() -> list[str]:
    """The ISAs this CPU runs, in ISAS order (up to ramstream._C.best_isa())."""
    return ISAS[: ISAS.index(C.best_isa()) + 1]


@contextlib.contextmanager
def using_isa(name: str):
    """Forces the host kernels' ISA for the block, then restores the previous one."""
    prev = C.active_isa()
    C.set_isa(name)
    try:
        yield
    finally:
        C.set_isa(prev)


@pytest.fixture(params=ISAS)
def isa(request):
    """Forces each ISA in turn (skipping those this CPU lacks) and restores the previous one."""
    if request.param not in supported_isas():
        pytest.skip(f"CPU supports at most {C.best_isa()}")
    with using_isa(request.param):
        yield request.param


@pytest.fixture
def restore_isa():
    """Restores the ISA active before the test (for tests that call set_isa themselves)."""
    prev = C.active_isa()
    yield
    C.set_isa(prev)


@pytest.fixture
def restore_threads():
    """Restores the host pool's thread count after the test."""
    prev = C.num_threads()
    yield
    C.set_num_threads(prev)
