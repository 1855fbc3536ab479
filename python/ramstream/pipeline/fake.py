"""Pipeline(fake_compute=...), RamTorch's schedule-timing aid: the option's check (FakeCompute: the
seconds slept before each op, and `replace`) and replace mode's stand-ins for a chunk's kernels.

Replace mode: a chunk's forward returns zeros of the shape, dtype, device and requires_grad its
real forward would give, found by running that forward once on torch's fake tensors
(FakeTensorMode: shapes are propagated, no kernel runs, no memory is allocated), with the chunk's
parameters and buffers swapped for fakes (torch.func.functional_call), so no real tensor of the
model is read or written, not even a buffer the forward updates (BatchNorm's counter). The result
is cached per chunk and input signature (shapes, dtypes, devices, requires_grad, grad mode). A
backward hands zeros of each input's shape to the chunk before. Parameters, buffers and `.grad`
keep their values bit for bit.

Threads: a chunk is traced on its stage's thread (FakeTensorMode's mode stack is per thread); the
cache is a dict per chunk written by that thread only.
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.func import functional_call

from .streamed import StreamedStage

__all__ = ["ACCEPTED", "FakeCompute", "check_fake_compute", "refuse_replace"]

ACCEPTED = (
    "None, 'replace', or a dict {'fwd': s, 'bwd': s, 'replace': bool} (any of the keys; seconds >= 0, "
    "or a list of one per stage; replace defaults to False)"
)
_CACHE_LIMIT = 64  # input signatures kept per chunk (a new shape beyond: the oldest is dropped)


class _Zeros:
    """The shape, dtype, device and requires_grad of one output tensor."""

    __slots__ = ("device", "dtype", "grad", "shape")

    def __init__(self, t: torch.Tensor) -> None:
        self.shape, self.dtype, self.device, self.grad = tuple(t.shape), t.dtype, t.device, t.requires_grad

    def make(self) -> torch.Tensor:
        z = torch.zeros(self.shape, dtype=self.dtype, device=self.device)
        return z.requires_grad_(True) if self.grad and z.is_floating_point() else z


def _shapes(v):
    """v (a fake output) with every tensor replaced by its _Zeros; tuples, lists and dicts kept."""
    if torch.is_tensor(v):
        return _Zeros(v)
    if isinstance(v, tuple):
        items = [_shapes(x) for x in v]
        return type(v)(*items) if hasattr(v, "_fields") else tuple(items)
    if isinstance(v, list):
        return [_shapes(x) for x in v]
    if type(v) is dict:
        return {k: _shapes(x) for k, x in v.items()}
    return v


def _make(v):
    if isinstance(v, _Zeros):
        return v.make()
    if isinstance(v, tuple):
        items = [_make(x) for x in v]
        return type(v)(*items) if hasattr(v, "_fields") else tuple(items)
    if isinstance(v, list):
        return [_make(x) for x in v]
    if type(v) is dict:
        return {k: _make(x) for k, x in v.items()}
    return v


def _signature(args):
    """A hashable key of the chunk's arguments and the grad mode, or None (an unhashable value)."""
    key = [torch.is_grad_enabled()]
    for a in args:
        if torch.is_tensor(a):
            key.append((tuple(a.shape), a.dtype, a.device, a.requires_grad))
        else:
            try:
                hash(a)
            except TypeError:
                return None
            key.append((type(a), a))
    return tuple(key)


class _Bare(nn.Module):
    """Runs a streamed chunk's own forward without its module hooks (the weight streamer's loads)
    and without the recompute wrapper ramstream may have put on its instance."""

    def __init__(self, part: nn.Module) -> None:
        super().__init__()
        self.part = part

    def forward(self, *args):
        return type(self.part).forward(self.part, *args)


def _fake_call(mode, module: nn.Module, args, device: torch.device, bare: bool):
    """module(*args) on fakes: its parameters and buffers become fakes on `device` (a streamed
    chunk's live in host memory and run on the stage's device)."""
    target = _Bare(module) if bare else module
    prefix = "part." if bare else ""
    state = {}
    for name, t in list(module.named_parameters()) + list(module.named_buffers()):
        f = mode.from_tensor(t)
        state[prefix + name] = f if f.device == device else f.to(device)
    return functional_call(target, state, tuple(args))


class FakeCompute:
    """Pipeline's fake_compute, checked: `fwd` / `bwd` (seconds per stage, slept before each
    forward / backward op, split over a stage's chunks) and `replace` (skip the kernels)."""

    def __init__(self, fwd: list, bwd: list, replace: bool) -> None:
        self.fwd, self.bwd, self.replace = fwd, bwd, replace
        self._cache: dict = {}  # chunk index -> {signature: output shapes}

    def output(self, c: int, module: nn.Module, args, device: torch.device):
        """Zeros shaped as chunk c's output for `args` (run under the chunk's autocast and the
        step's grad mode). Raises RuntimeError naming the chunk when its forward cannot run on
        fake tensors."""
        mine = self._cache.setdefault(c, {})
        key = _signature(args)
        spec = mine.get(key) if key is not None else None
        if spec is None:
            spec = self._trace(c, module, args, device)
            if key is not None:
                if len(mine) >= _CACHE_LIMIT:
                    mine.pop(next(iter(mine)))
                mine[key] = spec
        return _make(spec)

    def _trace(self, c: int, module: nn.Module, args, device: torch.device):
        try:
            with FakeTensorMode() as mode:
                x = tuple(mode.from_tensor(a) if torch.is_tensor(a) else a for a in args)
                if isinstance(module, StreamedStage):
                    for part in module.parts:
                        x = _fake_call(mode, part, x if isinstance(x, tuple) else (x,), device, bare=True)
                else:
                    x = _fake_call(mode, module, x, device, bare=False)
                return _shapes(x)
        except Exception as e:  # noqa: BLE001 - re-raised with the chunk and the way out
            raise RuntimeError(
                f"Pipeline(fake_compute='replace'): chunk {c}'s output shape could not be found without "
                f"running its kernels ({type(e).__name__}: {e}); replace runs the forward on torch's "
                "fake tensors, which excludes .item(), .numpy(), data-dependent shapes and custom "
                "kernels without a fake implementation. fake_compute={'fwd': s, 'bwd': s} (sleeps on "
                "top of the real kernels) works with any module"
            ) from e

    @staticmethod
    def input_grads(args) -> tuple:
        """Per argument of a chunk: zeros of its shape when it requires grad (the gradient the
        chunk before receives), else None."""
        return tuple(torch.zeros_like(a) if torch.is_tensor(a) and a.requires_grad else None for a in args)

    @staticmethod
    def loss(device: torch.device) -> torch.Tensor:
        """A replaced step's loss per microbatch: 0.0 (float32), loss_fn is not called."""
        return torch.zeros((), dtype=torch.float32, device=device)


def check_fake_compute(value, stages: int) -> FakeCompute | None:
    """RamTorch's fake_compute: None, "replace" (no sleeps), or {"fwd": s, "bwd": s} (each seconds
    >= 0 or a list of one per stage; a missing key: 0); ramstream adds "replace": True to that
    dict (the sleeps, on the replaced ops). Every other value: ValueError naming the accepted
    ones."""
    if value is None:
        return None
    if isinstance(value, str) and value == "replace":
        return FakeCompute([0.0] * stages, [0.0] * stages, True)
    if not isinstance(value, dict) or not value or set(value) - {"fwd", "bwd", "replace"}:
        raise ValueError(f"Pipeline: fake_compute={value!r} is not accepted; accepted: {ACCEPTED}")
    replace = value.get("replace", False)
    if not isinstance(replace, bool):
        raise ValueError(f"Pipeline: fake_compute['replace'] must be True or False, got {replace!r}")

    def per_stage(key: str) -> list[float]:
        v = value.get(key, 0.0)
        items = list(v) if isinstance(v, (list, tuple)) else [v] * stages
        if len(items) != stages:
            raise ValueError(f"Pipeline: fake_compute[{key!r}] has {len(items)} entries for {stages} stages")
        for x in items:
            if isinstance(x, bool) or not isinstance(x, (int, float)) or not math.isfinite(x) or x < 0:
                raise ValueError(f"Pipeline: fake_compute[{key!r}] entries must be seconds >= 0, got {x!r}")
        return [float(x) for x in items]

    return FakeCompute(per_stage("fwd"), per_stage("bwd"), replace)


def refuse_replace(fake: FakeCompute | None, what: str) -> None:
    """NotImplementedError for `what` (a real-kernel path: streaming inference, train_session) on a
    pipeline built with fake_compute replace."""
    if fake is not None and fake.replace:
        raise NotImplementedError(
            f"Pipeline.{what}: this pipeline was built with fake_compute replace, which step() and "
            "infer() honour; this path would run the real kernels (and train_session would update "
            "the weights): build a Pipeline without it for this"
        )
