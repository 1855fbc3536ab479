"""What the engine thread does to a bucket: land gradients, accumulate, norm, AdamW, send back.

Every function here runs on the engine thread; the heavy loops are in ramstream._C with the
GIL released. Arguments are snapshots taken on the training thread when the job was queued.
"""
from __future__ import annotations

import bisect
from dataclasses import dataclass

import torch

from .._native import lib
from .buckets import Bucket

_DTYPE_CODE = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}


def dtype_code(dtype: torch.dtype) -> int:
    return _DTYPE_CODE[dtype]


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


def land(b: Bucket, pieces: list[Piece], accumulate: bool, want_norm: bool) -> None:
    """Gradients are in b.landing: fold them into b.acc (accumulation) and add their squared
    norm to b.sq_norm (clipping)."""
    src = b.landing
    if accumulate:
        for p in pieces:
            dst = b.acc[p.offset:p.offset + p.numel]
            piece = src[p.offset:p.offset + p.numel]
            if p.first:
                dst.copy_(piece)
            else:
                lib().accumulate_ptr(_ptr(b.acc, p.offset), _ptr(src, p.offset),
                                     dtype_code(src.dtype), p.numel)
    if want_norm:
        add_sq_norm(b, pieces, b.acc if accumulate else src)


def add_sq_norm(b: Bucket, pieces: list[Piece], g: torch.Tensor) -> None:
    """Adds the squared norm of the pieces' gradients in `g` to b.sq_norm (clipping)."""
    code = dtype_code(g.dtype)
    b.sq_norm += sum(lib().sq_norm_ptr(_ptr(g, p.offset), code, p.numel) for p in pieces)


def update(b: Bucket, pieces: list[Piece], hypers: list[Hyper], grad_scale: float,
           accumulate: bool, out: torch.Tensor, seed: int) -> list[tuple[int, int]]:
    """AdamW over the pieces, one call per parameter (so each parameter's result is bit-identical
    to torch.optim.AdamW(fused=True) on that tensor); the new weights, cast to the working dtype,
    are written to `out` in the same pass. Returns the updated ranges, merged."""
    C = lib()
    grad = b.acc if accumulate else b.landing
    gcode, mcode, ocode = dtype_code(grad.dtype), dtype_code(b.exp_avg.dtype), dtype_code(out.dtype)
    ordered = sorted(pieces, key=lambda p: p.offset)
    for p in ordered:
        h = hypers[p.group]
        start = p.offset
        C.adamw_ptr(_ptr(b.master, start), _ptr(grad, start), gcode,
                    _ptr(b.exp_avg, start), _ptr(b.exp_avg_sq, start), mcode,
                    _ptr(out, start), ocode, p.numel, b.state_offset + start,
                    h.lr, h.beta1, h.beta2, h.eps, h.weight_decay, p.step, grad_scale, seed)
    # merged for the copy back across small gaps of padding only: a slot not in this job keeps
    # in `out` whatever was there (never written, its gradient, weights older than the device's)
    taken = {p.offset for p in pieces}
    others = sorted(s.offset for s in b.slots if s.offset not in taken)
    ranges: list[list[int]] = []
    for p in ordered:
        end = ranges[-1][0] + ranges[-1][1] if ranges else 0
        if ranges and p.offset - end <= 4096 and \
                bisect.bisect_left(others, end) == bisect.bisect_left(others, p.offset):
            ranges[-1][1] = p.offset + p.numel - ranges[-1][0]
        else:
            ranges.append([p.offset, p.numel])
    return [(a, n) for a, n in ranges]
