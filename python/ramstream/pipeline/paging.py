"""Activation paging per pipeline stage (`offload_activations=True`): the tensors a stage's forward
saves for backward stay on the device for at most `slots` (chunk, microbatch) forwards at a time;
the others go to host memory (pinned on a GPU) as they are saved and come back when the backward
of their microbatch starts. Host buffers and copy engines are activation paging's own (HostPool,
CpuCopies/CudaCopies in activations/buffers.py); this file only decides per microbatch.

Threads: saving() and fetch() run on the stage's thread; unpack runs on autograd's thread of the
device (the stage thread itself on the CPU), after fetch() for its microbatch. One StagePager
per stage; the Run calls begin/fetch/release in the stage's op order.
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn as nn

from ..activations.buffers import CpuCopies, CudaCopies, HostPool

__all__ = ["StagePager"]


class _Paged:
    """One saved tensor's bytes in a host buffer: the storage span its view covers, restored
    with the same size and strides (storage offset 0) on the device."""

    __slots__ = ("buf", "dtype", "event", "gpu", "nbytes", "size", "stride")

    def __init__(self, buf, t: torch.Tensor, nbytes: int, event) -> None:
        self.buf, self.nbytes, self.event = buf, nbytes, event
        self.dtype, self.size, self.stride = t.dtype, tuple(t.shape), t.stride()
        self.gpu = None  # the device copy, once fetched


class _Group:
    """The saved tensors of one (chunk, microbatch) forward: kept (on the device) or paged."""

    __slots__ = ("items", "key", "live", "paged", "saved")

    def __init__(self, key, paged: bool) -> None:
        self.key, self.paged = key, paged
        self.saved = False  # its forward has run (it may be prefetched)
        self.items: list = []  # its _Paged records
        # during the forward only: (storage address, offset, shape, stride, dtype) -> (tensor,
        # _Paged), so a tensor saved twice is copied once; the tensor is held until the forward
        # ends, so that no new tensor reuses its address meanwhile
        self.live: dict = {}


def _ident(t: torch.Tensor) -> tuple:
    """What tells a saved tensor is one of the given ones (autograd may hand over another Python
    object viewing the same memory)."""
    return (t.data_ptr(), t.dtype, tuple(t.shape), t.stride())


def _span(t: torch.Tensor) -> int:
    """Elements of the storage the view reaches, from its offset (strides are never negative)."""
    return 1 + sum((n - 1) * s for n, s in zip(t.shape, t.stride()))


class StagePager:
    """Saved-tensor paging of one stage on `device` with at most `slots` forwards' saved tensors
    on the device. Parameters, their views and the stage's buffers are never paged (they are
    on the device anyway), nor empty tensors. A paged tensor modified in place after being saved
    is not detected (torch checks no versions behind hooks). stats() counts packs and bytes."""

    def __init__(self, device: torch.device, slots: int) -> None:
        self.device = device
        self.slots = slots
        self.copies = CudaCopies(device) if device.type == "cuda" else CpuCopies(device)
        self.pool = HostPool(pinned=self.copies.pinned)
        self.groups: dict = {}
        self.resident: set = set()  # keys whose saved tensors stay on the device
        self.counts = dict.fromkeys(
            (
                "packs",
                "kept",
                "paged",
                "paged_bytes",
                "fetched",
                "fetched_bytes",
                "prefetched",
                "resident_peak",
            ),
            0,
        )
        self._skip: set = set()

    # ---- forward -----------------------------------------------------------------------------
    def saving(self, key, modules, alive=()):
        """The context of the forward of `key` = (chunk, microbatch) of `modules`: its saved
        tensors are kept while fewer than `slots` forwards keep theirs on the device, else paged,
        but for the modules' parameters and buffers and the tensors of `alive` (held until the
        backward anyway: the chunk's inputs, the output the loss reads)."""
        g = self.groups.get(key)
        if g is None:
            keep = len(self.resident) < self.slots
            g = self.groups[key] = _Group(key, not keep)
            if keep:
                self.resident.add(key)
                self.counts["resident_peak"] = max(self.counts["resident_peak"], len(self.resident))
        self._skip = {_ident(b) for m in modules for b in m.buffers()}
        self._skip.update(_ident(t) for t in alive if torch.is_tensor(t))
        return self._hooks(g)

    @contextlib.contextmanager
    def _hooks(self, g: _Group):
        try:
            with torch.autograd.graph.saved_tensors_hooks(lambda t: self._pack(g, t), self._unpack):
                yield
        finally:
            g.live.clear()  # the forward is over: its device tensors may go
            g.saved = True

    def _pack(self, g: _Group, t: torch.Tensor):
        self.counts["packs"] += 1
        if (
            not g.paged
            or isinstance(t, nn.Parameter)
            or isinstance(t._base, nn.Parameter)
            or _ident(t) in self._skip
            or t.device != self.device
            or t.numel() == 0
            or t.layout != torch.strided
        ):
            self.counts["kept"] += 1
            return t
        key = (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), t.stride(), t.dtype)
        hit = g.live.get(key)
        if hit is not None:
            return hit[1]
        n = _span(t)
        flat = t.detach().as_strided((n,), (1,), t.storage_offset()).view(torch.uint8)
        buf = self.pool.take(flat.numel())
        self.copies.to_host(buf, flat)
        p = _Paged(buf, t, flat.numel(), self.copies.d2h_event())
        g.live[key] = (t, p)
        g.items.append(p)
        self.counts["paged"] += 1
        self.counts["paged_bytes"] += flat.numel()
        return p

    # ---- backward ----------------------------------------------------------------------------
    def fetch(self, key, stream) -> None:
        """Before the backward of `key`: its paged tensors come back to the device (on a GPU: on
        the copy stream, `stream` (the stage's) waiting for them)."""
        g = self.groups.get(key)
        if g is None or not g.paged:
            return
        for p in g.items:
            if p.gpu is None:
                raw, ev = self.copies.to_device(p.buf, p.nbytes, p.event)
                if ev is not None:
                    stream.wait_event(ev)
                    raw.record_stream(stream)
                p.gpu = raw.view(p.dtype).as_strided(p.size, p.stride, 0)
                self.counts["fetched"] += 1
                self.counts["fetched_bytes"] += p.nbytes
                self._give(p, ev)  # reusable once the copy out of it has run

    def _unpack(self, x):
        if isinstance(x, _Paged):
            if x.gpu is None:
                raise RuntimeError("Pipeline: a paged activation was used before its microbatch's backward")
            return x.gpu
        return x

    def release(self, key, stream, upcoming=()) -> None:
        """The backward of `key` is done: its host buffers go back to the pool, and its slot goes
        to the first paged forward of `upcoming` (the stage's next backwards, up to its next
        forward, which would rather take the slot itself), whose tensors start coming back now
        (on a GPU on the copy stream, `stream` (the stage's) waiting for them)."""
        self._drop(key)
        if len(self.resident) >= self.slots:
            return
        for k in upcoming:
            g = self.groups.get(k)
            if g is not None and g.paged and g.saved and k not in self.resident:
                self.resident.add(k)
                self.counts["prefetched"] += 1
                self.counts["resident_peak"] = max(self.counts["resident_peak"], len(self.resident))
                self.fetch(k, stream)
                return

    def _drop(self, key) -> None:
        g = self.groups.pop(key, None)
        self.resident.discard(key)
        if g is not None:
            for p in g.items:
                self._give(p, p.event)  # never fetched (a failed step): after its copy in
                p.gpu = None

    def _give(self, p: _Paged, event) -> None:
        if p.buf is not None:
            buf, p.buf = p.buf, None
            self.pool.give(buf, event)

    def reset(self) -> None:
        """The step ended (done or failed): every group left is released (nothing prefetched)."""
        for key in list(self.groups):
            self._drop(key)
        self.resident.clear()

    def stats(self) -> dict:
        """Counts since construction: packs (saved tensors seen), kept, paged (tensors copied to
        host), paged_bytes, fetched, fetched_bytes, prefetched (paged forwards brought back into a
        freed slot ahead of their backward), resident_peak (most forwards holding a slot at
        once), and the host pool's byte counts."""
        return {**self.counts, **self.pool.stats()}

    def close(self) -> None:
        self.reset()
        self.pool.close()
