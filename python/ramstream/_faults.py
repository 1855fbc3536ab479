"""Test-only fault injection: named points in a training step that raise torch.OutOfMemoryError
while a test has armed them (zero cost otherwise: one dict lookup on an empty dict).

    with ramstream._faults.inject("backward.landing"):
        ...  # the first time the step reaches that point, it raises torch.OutOfMemoryError

Points (where the call sits): forward.pre_hook (engine/core.py, a module's forward pre-hook),
activations.pack / activations.unpack (activations.py, saved-tensor hooks), activations.buffer
(activation_buffers.py, a new host buffer), backward.grad_hook / backward.landing
(engine/backward.py, a gradient's hook and its copy to the landing buffer), step.begin /
step.updates (engine/core.py, step() before anything and between queued buckets),
resident.switch (engine/resident.py, building the device-side state) and resident.step.
"""

from __future__ import annotations

import contextlib

import torch

POINTS = (
    "forward.pre_hook",
    "activations.pack",
    "activations.unpack",
    "activations.buffer",
    "backward.grad_hook",
    "backward.landing",
    "step.begin",
    "step.updates",
    "resident.switch",
    "resident.step",
)

_armed: dict[str, list[int]] = {}  # name -> [calls to let pass, times to raise]


def fault_point(name: str) -> None:
    """Raises torch.OutOfMemoryError when `name` is armed (and its skips are used up)."""
    if _armed:
        _fire(name)


def _fire(name: str) -> None:
    state = _armed.get(name)
    if state is None:
        return
    if state[0] > 0:
        state[0] -= 1
        return
    if state[1] > 0:
        state[1] -= 1
        raise torch.OutOfMemoryError(f"ramstream._faults: injected out of memory at {name!r}")


@contextlib.contextmanager
def inject(name: str, *, skip: int = 0, times: int = 1):
    """Arms `name`: its first `skip` calls pass, the `times` after them raise. Yields a dict whose
    "fired" says how many raised (a test checks that the point was reached)."""
    if name not in POINTS:
        raise ValueError(f"inject: name={name!r} is not a fault point; accepted: {POINTS}")
    if isinstance(skip, bool) or not isinstance(skip, int) or skip < 0:
        raise ValueError(f"inject: skip={skip!r}; accepted: an integer >= 0")
    if isinstance(times, bool) or not isinstance(times, int) or times < 1:
        raise ValueError(f"inject: times={times!r}; accepted: an integer >= 1")
    state = [skip, times]
    _armed[name] = state
    info = {"fired": 0}
    try:
        yield info
    finally:
        info["fired"] = times - state[1]
        _armed.pop(name, None)
