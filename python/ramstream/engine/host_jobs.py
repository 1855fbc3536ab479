"""What the engine thread does to a bucket: land gradients, accumulate, norm, AdamW, send back.

Every function here runs on the engine thread; the heavy loops are in ramstream._C with the
GIL released. Arguments are snapshots taken on the training thread when the job was queued.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass

import torch

from ..ops import _raw
from .buckets import Bucket


@dataclass(frozen=True)
class Hyper:
    """One param group's hyper-parameters, as read from param_groups when the update was queued."""

    lr: float
    beta1: float
    beta2: float
    eps: float
    weight_decay: float


@dataclass(frozen=True)
class Piece:
    """A slot's range in its bucket for one job: offset, numel, group, the step being taken and
    whether this is the slot's first gradient since the last optimizer step."""

    offset: int
    numel: int
    group: int
    step: int
    first: bool


def _ptr(t: torch.Tensor, offset: int) -> int:
    return t.data_ptr() + offset * t.element_size()


def land(b: Bucket, pieces: list[Piece], accumulate: bool, want_norm: bool, src=None, acc=None) -> None:
    """Gradients are in b.landing: fold them into b.acc (accumulation) and add their squared
    norm to b.sq_norm (clipping). src, acc: the buffers when the job was queued (a delayed update
    swaps b's buffers at step(), maybe before this job ran)."""
    src = b.landing if src is None else src
    acc = b.acc if acc is None else acc
    if accumulate:
        for p in pieces:
            dst = acc[p.offset : p.offset + p.numel]
            piece = src[p.offset : p.offset + p.numel]
            if p.first:
                dst.copy_(piece)
            else:
                _raw.accumulate_ptr(
                    dst=_ptr(acc, p.offset), src=_ptr(src, p.offset), src_dtype=src.dtype, n=p.numel
                )
    if want_norm:
        add_sq_norm(b, pieces, acc if accumulate else src)


def add_sq_norm(b: Bucket, pieces: list[Piece], g: torch.Tensor) -> None:
    """Adds the squared norm of the pieces' gradients in `g` to b.sq_norm (clipping)."""
    b.sq_norm += sum(_raw.sq_norm_ptr(ptr=_ptr(g, p.offset), dtype=g.dtype, n=p.numel) for p in pieces)


def update(
    b: Bucket,
    pieces: list[Piece],
    hypers: list[Hyper],
    grad_scale: float,
    accumulate: bool,
    out: torch.Tensor,
    seed: int,
    grad: torch.Tensor | None = None,
) -> list[tuple[int, int]]:
    """AdamW over the pieces, one call per parameter (so each parameter's result is bit-identical
    to torch.optim.AdamW(fused=True) on that tensor); the new weights, cast to the working dtype,
    are written to `out` in the same pass (none when `out` is the master itself). Returns the
    updated ranges, merged. grad: the gradients (default: b.acc with accumulation, else b.landing;
    a delayed update passes the buffer it was queued with)."""
    if grad is None:
        grad = b.acc if accumulate else b.landing
    if b.disk is not None:  # the state is on disk: paged in around the update (disk_tier.py)
        with b.disk.updating(b):
            return _update(b, pieces, hypers, grad_scale, out, seed, grad)
    return _update(b, pieces, hypers, grad_scale, out, seed, grad)


def _update(b, pieces, hypers, grad_scale, out, seed, grad) -> list[tuple[int, int]]:
    ordered = sorted(pieces, key=lambda p: p.offset)
    in_place = out.data_ptr() == b.master.data_ptr()  # a streamed fp32 bucket: home is the master
    for p in ordered:
        h = hypers[p.group]
        start = p.offset
        _raw.adamw_ptr(
            param=_ptr(b.master, start),
            grad=_ptr(grad, start),
            grad_dtype=grad.dtype,
            exp_avg=_ptr(b.exp_avg, start),
            exp_avg_sq=_ptr(b.exp_avg_sq, start),
            moment_dtype=b.exp_avg.dtype,
            out=0 if in_place else _ptr(out, start),
            out_dtype=out.dtype,
            n=p.numel,
            offset=b.state_offset + start,
            lr=h.lr,
            beta1=h.beta1,
            beta2=h.beta2,
            eps=h.eps,
            weight_decay=h.weight_decay,
            step=p.step,
            grad_scale=grad_scale,
            seed=seed,
        )
    # merged for the copy back across small gaps of padding only: a slot not in this job keeps
    # in `out` whatever was there (never written, its gradient, weights older than the device's)
    taken = {p.offset for p in pieces}
    others = sorted(s.offset for s in b.slots if s.offset not in taken)
    ranges: list[list[int]] = []
    for p in ordered:
        end = ranges[-1][0] + ranges[-1][1] if ranges else 0
        if (
            ranges
            and p.offset - end <= 4096
            and bisect.bisect_left(others, end) == bisect.bisect_left(others, p.offset)
        ):
            ranges[-1][1] = p.offset + p.numel - ranges[-1][0]
        else:
            ranges.append([p.offset, p.numel])
    return [(a, n) for a, n in ranges]
