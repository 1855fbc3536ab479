"""OffloadModel's gradient write-back: streamed parameters' gradients go home (pinned host memory
on a GPU) as autograd produces them, on a D2H stream, and become `.grad` when the step succeeds.

One logic for both devices: land() takes a gradient off the device into a pending record (CUDA:
a non-blocking copy into a pooled pinned buffer, ordered after the compute that made it; CPU:
the gradient itself, already at home); commit() waits once for the D2H stream and makes every
pending record the parameter's `.grad` (added into the previous `.grad` when there was one);
discard() drops them (a failed step leaves `.grad` as it was before it).

sum_as_landed (the pipeline's streamed stages, where a parameter lands once per microbatch): the
first landing is the sum; each later one is copied into a pinned staging buffer and added into it
on a host thread as soon as its copy is done, in landing order, so the adds overlap the rest of
the step and host memory holds one gradient per parameter plus at most `max_staged` bytes in
flight (instead of one per microbatch, summed after the last one). The same additions in the same
order as commit() makes: bit-identical.
"""

from __future__ import annotations

import sys
from collections import deque
from concurrent.futures import ThreadPoolExecutor

import torch

from ...trace import current as _trace_current


class GradWriteback:
    """Pending gradients of one step. Training thread only (autograd's hooks)."""

    def __init__(
        self, device: torch.device, *, sum_as_landed: bool = False, max_staged: int = 2 << 30
    ) -> None:
        self.device = device
        self.cuda = device.type == "cuda"
        if isinstance(max_staged, bool) or not isinstance(max_staged, int) or max_staged < 1:
            raise ValueError(f"GradWriteback: max_staged must be a positive int (bytes), got {max_staged!r}")
        self.sum_as_landed = sum_as_landed
        self.max_staged = max_staged
        self._staged = 0  # bytes of the queued additions' staging buffers
        self._adder = None  # one host thread (CUDA, sum_as_landed): the later landings' additions
        self._jobs: deque = deque()  # (future, staged bytes), oldest first
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
        self.land_many([(p, g)])

    def land_many(self, pairs) -> None:
        """land() for each (parameter, gradient) of `pairs`, in order, with one wait of the D2H
        stream for the compute stream (on CUDA): the landings of one chunk at once (a pipeline
        stage's land_part), for a fraction of the host time of one call each."""
        tr = _trace_current()
        if not self.cuda:
            for p, g in pairs:
                t0 = tr.now() if tr is not None else None
                if id(p) in self._pending and self.sum_as_landed:
                    self._pending[id(p)][1][0].add_(g)
                else:
                    self._pending.setdefault(id(p), (p, []))[1].append(g)
                if tr is not None:
                    tr.span("d2h", "grad", t0, tr.now(), chunk=self.chunk_of.get(id(p), -1))
            return
        if not pairs:
            return
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.stream):
            for p, g in pairs:
                self._copy_home(p, g, tr)

    def _copy_home(self, p, g: torch.Tensor, tr) -> None:
        """One landing on CUDA, on the D2H stream (current), after the compute that made g."""
        again = id(p) in self._pending  # a parameter used by two backward passes of one step
        if again:
            from ...functional import pinned_empty

            dst = pinned_empty(g.numel(), g.dtype).view(g.shape)
        else:
            dst = self._buffer(p, g)
        t0 = tr.now(self.stream) if tr is not None else None
        dst.copy_(g, non_blocking=True)
        done = None
        if again and self.sum_as_landed:
            done = torch.cuda.Event()
            done.record(self.stream)
        g.record_stream(self.stream)  # its memory is reused only after the copy
        if tr is not None:
            tr.span("d2h", "grad", t0, tr.now(self.stream), chunk=self.chunk_of.get(id(p), -1))
        if done is not None:
            self._add_later(self._pending[id(p)][1][0], dst, done)
        else:
            self._pending.setdefault(id(p), (p, []))[1].append(dst)
        self.stats["bytes_d2h"] += g.nbytes
        self.stats["landed"] += 1

    def _add_later(self, acc: torch.Tensor, staged: torch.Tensor, done) -> None:
        """acc += staged on the host thread once `done` (staged's copy; acc's came before it on
        the same stream) has completed; at most max_staged bytes wait (else the oldest first)."""
        if self._adder is None:
            self._adder = ThreadPoolExecutor(1, thread_name_prefix="ramstream-grad-sum")
        while self._jobs and self._staged + staged.nbytes > self.max_staged:
            fut, b = self._jobs.popleft()
            self._staged -= b
            fut.result()
        self._jobs.append((self._adder.submit(_add_after, acc, staged, done), staged.nbytes))
        self._staged += staged.nbytes

    def _drain(self, raising: bool = True) -> None:
        """Waits for every queued addition; the first that failed raises (after all ended)."""
        jobs, self._jobs, self._staged = self._jobs, deque(), 0
        err = None
        for fut, _ in jobs:
            e = fut.exception()
            err = err or e
        if err is not None and raising:
            raise err

    def commit(self, before: dict) -> None:
        """Every pending gradient into `.grad` (before: id(param) -> `.grad` at the step's start),
        added in the order autograd produced them, as torch accumulates."""
        if self.sum_as_landed and before:
            raise ValueError(
                "GradWriteback(sum_as_landed=True).commit: before must be {} (sums start at the first landing)"
            )
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
        """Drops the pending gradients (a failed step): waits for the copies and additions in
        flight, whose own errors are dropped with them."""
        try:
            if self.stream is not None:
                self.stream.synchronize()
            self._drain(raising=False)
        finally:
            self._pending = {}

    def wait(self) -> None:
        if self.stream is not None:
            self.stream.synchronize()  # once per step, not per copy
        self._drain()

    def close(self) -> None:
        """Ends the host thread (after its queued additions)."""
        if self._adder is not None:
            self._adder.shutdown(wait=True)
            self._adder = None


def _add_after(acc: torch.Tensor, staged: torch.Tensor, done) -> None:
    done.synchronize()
    acc.add_(staged)
