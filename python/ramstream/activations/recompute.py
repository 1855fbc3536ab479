"""activation_checkpointing: chosen blocks keep only their inputs in forward and recompute the
rest in backward (torch.utils.checkpoint, non-reentrant, RNG state restored: dropout-safe).

The block's forward is replaced by a checkpointed call of the original, so module hooks on the
block (the weight streamer's loads, activation paging) run once per forward, and the recompute
happens inside the block's backward, after its output-gradient hook (weights are loaded by then).
Which blocks recompute is decided elsewhere: the plan, or without one planner/wrap_rules.py
auto_recompute on the numbers runtime/inspect.py counts; this module takes explicit indices.
"""

from __future__ import annotations

import inspect

import torch
import torch.utils.checkpoint as _tc

from ..blocks import chosen_blocks
from ..options import parse_checkpointing  # noqa: F401  (recompute.parse_checkpointing: its old name)


def checkpoint_indices(option, n: int) -> list[int]:
    return chosen_blocks("activation_checkpointing", option, n)


# A KV cache written in forward would be written again by the recompute (Hugging Face layers):
# under checkpointing a layer runs without one, as with HF's own gradient checkpointing.
_CACHE_KWARGS = ("past_key_values", "past_key_value", "layer_past", "cache")


def checkpointed(fn, *args, **kwargs):
    """torch.utils.checkpoint(fn, *args, use_reentrant=False, **kwargs), closing its hooks when fn
    raises. torch 2.11's non-reentrant checkpoint (the GPU machine's) leaves its saved-tensor
    hooks pushed when the function raises (its generator stays suspended in the traceback's
    frame): they stay active for later code on this thread and are popped whenever the traceback
    is collected, on whatever thread and under whatever hooks are pushed then (an internal
    assert, SavedTensorHooks.cpp:69, measured there). torch 2.13 throws the error into its
    generator itself. Here a generator still suspended is closed before the exception leaves:
    its hooks pop in order, on this thread."""
    try:
        return _tc.checkpoint(fn, *args, use_reentrant=False, **kwargs)
    except BaseException as e:
        _close_checkpoint_generators(e.__traceback__)
        raise


def _close_checkpoint_generators(tb) -> None:
    while tb is not None:
        frame = tb.tb_frame
        if frame.f_code.co_filename == _tc.__file__:
            gen = frame.f_locals.get("gen")
            if inspect.isgenerator(gen) and gen.gi_frame is not None and not gen.gi_running:
                gen.close()
        tb = tb.tb_next


def _without_cache(kwargs: dict) -> dict:
    if kwargs.get("use_cache"):
        kwargs["use_cache"] = False
    for k in _CACHE_KWARGS:
        if kwargs.get(k) is not None:
            kwargs[k] = None
    return kwargs


def _drop_casts() -> None:
    torch.clear_autocast_cache()


def _autocasting() -> bool:
    try:
        return torch.is_autocast_enabled("cuda") or torch.is_autocast_enabled("cpu")
    except TypeError:  # pragma: no cover - torch < 2.4
        return torch.is_autocast_enabled() or torch.is_autocast_cpu_enabled()


class Recompute:
    """Checkpoints the forward of `blocks[i]` for i in `indices`; keep() lets chosen ones keep
    their activations again (and recompute_again() undoes that), bit for bit either way: the
    recompute runs the same forward. With ``memory_fn`` (bytes allocated on the device now;
    runtime/keep.py measured_memory_fn), each recompute records in ``kept_bytes[i]`` what the
    block's recomputed forward left allocated: its saved activations and output, what the block
    would hold if it kept its activations; ``stop_measuring()`` ends that. close() restores the
    blocks."""

    def __init__(self, blocks, indices: list[int], memory_fn=None) -> None:
        self.indices = list(indices)
        self.active = set(self.indices)
        self.kept_bytes: dict[int, int] = {}
        self._memory = memory_fn
        self._patched: list = []
        for i in self.indices:
            self._patch(blocks[i], i)

    def _patch(self, m, i: int) -> None:
        had = "forward" in m.__dict__
        orig = m.__dict__.get("forward", None)
        fwd = m.forward

        def inner(*args, _fwd=fwd, _i=i, **kwargs):
            if self._memory is None or torch._C._current_graph_task_id() == -1:
                return _fwd(*args, **kwargs)
            m0 = self._memory()  # the recompute, inside backward
            try:
                return _fwd(*args, **kwargs)
            finally:  # also when the checkpoint stops the recompute early
                self.kept_bytes[_i] = max(self.kept_bytes.get(_i, 0), self._memory() - m0)

        def run(*args, _fwd=fwd, _inner=inner, _i=i, **kwargs):
            if not torch.is_grad_enabled() or _i not in self.active:
                return _fwd(*args, **kwargs)
            out = checkpointed(_inner, *args, **_without_cache(kwargs))
            if _autocasting():
                # autocast keeps the low-precision cast of every weight it casts until the
                # outermost region ends: for a recomputed block nothing else holds them (its
                # backward casts again), so they would only fill VRAM until the loss
                _drop_casts()
            return out

        m.forward = run
        self._patched.append((m, had, orig))

    def add(self, blocks, indices) -> None:
        """These blocks recompute from the next forward on (between steps: StepCheck's re-plan),
        patched now when they were not; kept ones recompute again. Values do not change."""
        for i in sorted(set(indices) - set(self.indices)):
            self._patch(blocks[i], i)
            self.indices.append(i)
        self.indices.sort()
        self.active |= set(indices)

    def stop_measuring(self) -> None:
        self._memory = None

    def recomputed(self) -> list[int]:
        return sorted(self.active)

    def keep(self, indices) -> None:
        """These blocks keep their activations from the next forward on."""
        self.active -= set(indices)

    def recompute_again(self, indices) -> None:
        self.active |= set(indices) & set(self.indices)

    def close(self) -> None:
        for m, had, orig in self._patched:
            if had:
                m.forward = orig
            else:
                del m.forward
        self._patched = []
