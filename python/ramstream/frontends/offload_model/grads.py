"""OffloadModel's gradient write-back: streamed parameters' gradients go home (pinned host memory
on a GPU) as autograd produces them, on a D2H stream, and become `.grad` when the step succeeds.

One logic for both devices: land() takes a gradient off the device into a pending record (CUDA:
a non-blocking copy into a pooled pinned buffer, ordered after the compute that made it; CPU:
the gradient itself, already at home); commit() waits once for the D2H stream and makes every
pending record the parameter's `.grad` (added into the previous `.grad` when there was one);
discard() drops them (a failed step leaves `.grad` as it was before it).
"""

from __future__ import annotations

import sys

import torch

from ...trace import current as _trace_current


class GradWriteback:
    """Pending gradients of one step. Training thread only (autograd's hooks)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.cuda = device.type == "cuda"
        self.stream = torch.cuda.Stream(device) if self.cuda else None
        self._pool: dict[int, torch.Tensor] = {}  # id(param) -> pinned buffer (CUDA)
        self._pending: dict[int, tuple] = {}  # id(param) -> (param, host gradient)
        self.chunk_of: dict[int, int] = {}  # id(param) -> chunk index (trace spans)
        self.stats = {"bytes_d2h": 0, "landed": 0}
        probe = {0: object()}
        held_here = probe[0]
        self._refs_alone = sys.getrefcount(held_here)  # the pool's, a local's (and the argument's)

    def _buffer(self, p, g: torch.Tensor) -> torch.Tensor:
        """A pinned buffer for p's gradient; reused unless someone still holds the last one (a
        `.grad` taken before zero_grad(set_to_none=True))."""
        buf = self._pool.get(id(p))
        if buf is None or buf.dtype != g.dtype or sys.getrefcount(buf) > self._refs_alone:
            from ...functional import pinned_empty

            buf = pinned_empty(g.numel(), g.dtype).view(g.shape)
            self._pool[id(p)] = buf
        return buf

    def forget(self, ids) -> None:
        """Drops the pooled buffers of these parameters (another owner takes their gradients)."""
        for pid in ids:
            self._pool.pop(pid, None)

    def land(self, p, g: torch.Tensor) -> None:
        """p's gradient of this backward (a device tensor on CUDA; freed by the caller at once)."""
        tr = _trace_current()
        again = id(p) in self._pending  # a parameter used by two backward passes of one step
        if not self.cuda:
            t0 = tr.now() if tr is not None else None
            self._pending.setdefault(id(p), (p, []))[1].append(g)
            if tr is not None:
                tr.span("d2h", "grad", t0, tr.now(), chunk=self.chunk_of.get(id(p), -1))
            return
        compute = torch.cuda.current_stream(self.device)
        self.stream.wait_stream(compute)
        if again:
            from ...functional import pinned_empty

            dst = pinned_empty(g.numel(), g.dtype).view(g.shape)
        else:
            dst = self._buffer(p, g)
        t0 = tr.now(self.stream) if tr is not None else None
        with torch.cuda.stream(self.stream):
            dst.copy_(g, non_blocking=True)
        g.record_stream(self.stream)  # its memory is reused only after the copy
        if tr is not None:
            tr.span("d2h", "grad", t0, tr.now(self.stream), chunk=self.chunk_of.get(id(p), -1))
        self._pending.setdefault(id(p), (p, []))[1].append(dst)
        self.stats["bytes_d2h"] += g.nbytes
        self.stats["landed"] += 1

    def commit(self, before: dict) -> None:
        """Every pending gradient into `.grad` (before: id(param) -> `.grad` at the step's start),
        added in the order autograd produced them, as torch accumulates."""
        self.wait()
        pending, self._pending = self._pending, {}
        for key, (p, gs) in pending.items():
            acc = before.get(key)
            if acc is None:
                acc, gs = gs[0], gs[1:]
            for g in gs:
                acc.add_(g)
            p.grad = acc

    def discard(self) -> None:
        self.wait()
        self._pending = {}

    def wait(self) -> None:
        if self.stream is not None:
            self.stream.synchronize()  # once per step, not per copy
