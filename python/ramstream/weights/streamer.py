"""The weight streamer: streamed blocks' weights visit the device only while the block runs.

One component for every front end (wrap(param_offload=...), later OffloadModel). A streamed
block's weights are slabs (slab.py) at home in pinned host memory. The streamer:

  forward   block i's pre-hook loads block i if needed and waits (GPU-side) for its copy, and
            prefetches the next `ahead` streamed blocks on the copy stream; the post-hook
            evicts block i (except the last `ahead` + 1 blocks of a forward that will be
            followed by a backward: they are the first ones backward needs, and the pre-hooks
            keep them: farthest next use is evicted).
  backward  a hook on block i's output gradient reloads block i before its backward runs (a
            no-op when prefetched) and prefetches the `ahead` blocks before it; a hook on block
            i's input gradient evicts it once its backward is done; the end of the backward pass
            evicts whatever is still loaded.
  recompute a forward that runs inside backward (activation checkpointing) neither prefetches
            forward nor evicts: the backward hooks own the window then.
  driven    while `driven` is set, the hooks do nothing: a caller that runs one block over several
            inputs in a row (a pipeline stage, chunk-major: pipeline/chunk_major.py) moves the
            window itself with window() and use(), and evicts at the end.

At most `ahead` + 1 streamed blocks are loaded at once (the one running and those ahead of it).
`ahead` = 0 is fully serial: each block loads on demand at its hook, after the compute queued
before it, so a load never overlaps compute. (wrap()'s `weight_window` is `ahead`; OffloadModel's
`window`, RamTorch's meaning, counts the running block too: `ahead` = `window` - 1.)

Trained parameters' updates are written by the host optimizer into the slab's home copy; a load
first waits (`ready`, the engine's bucket wait) for the update of the buckets it reads.
Frozen parameters (a LoRA base) never change: their slabs are built here, and so are those of a
quantized block's packed codes and absmax (buffers, carried like frozen parameters: at home in
pinned memory at rest, on the device while the block runs, where the layer expands them).
"""

from __future__ import annotations

import time

import torch

from ..trace import _first_grad_tensor
from ..trace import current as _trace_current
from .slab import Slab


class Block:
    """One streamed block: its slabs, and what its loads wait for."""

    def __init__(self, index: int, module: torch.nn.Module, slabs: list, ready: list) -> None:
        self.index, self.module, self.slabs = index, module, slabs
        self.ready = ready  # callables: block until the slab's home holds the current weights
        self.nbytes = sum(s.nbytes for s in slabs)

    @property
    def loaded(self) -> bool:
        return any(s.loaded for s in self.slabs)


def frozen_slabs(module: torch.nn.Module, skip: set, copier, extra=()) -> list[Slab]:
    """Slabs for the parameters of `module` whose ids are not in `skip`, and the tensors in
    `extra` (a quantized block's packed codes and absmax buffers), one slab per dtype."""
    by_dtype: dict = {}
    for p in list(dict.fromkeys(module.parameters())) + list(extra):
        if id(p) not in skip and p.numel() > 0:
            by_dtype.setdefault(p.dtype, []).append(p)
    out = []
    for params in by_dtype.values():
        align = max(1, 512 // params[0].element_size())
        offsets, off = [], 0
        for p in params:
            offsets.append(off)
            off = (off + p.numel() + align - 1) // align * align
        out.append(Slab(params, offsets, off, copier=copier))
    return out


class WeightStreamer:
    """Streams the weights of `blocks` (Block objects, in forward order) through the device."""

    def __init__(self, blocks: list[Block], *, copier, ahead: int = 2, log=None) -> None:
        if isinstance(ahead, bool) or not isinstance(ahead, int) or ahead < 0:
            raise ValueError(
                f"WeightStreamer: ahead must be an int >= 0 (blocks loaded ahead), got {ahead!r}"
            )
        self.blocks = blocks
        self.copier = copier
        self.ahead = ahead
        self.log = log or (lambda msg: None)
        self.stats = {
            "loads": 0,
            "bytes_h2d": 0,
            "stream_wait_s": 0.0,
            "evictions": 0,
            "peak_loaded_bytes": 0,
        }
        self._task = None  # the backward pass whose end callback is queued
        self.driven = False  # the caller moves the window (window(), use()); the hooks stand aside
        self.disk = None  # DiskWeights of its disk slabs when the streamer owns them (wrap's nvme_weights)
        self._handles: list = []
        for k, blk in enumerate(blocks):
            m = blk.module
            self._handles.append(
                m.register_forward_pre_hook(lambda mod, args, k=k: self._pre_forward(k, args))
            )
            self._handles.append(
                m.register_forward_hook(lambda mod, args, out, k=k: self._post_forward(k, out))
            )

    # ---- mechanism ------------------------------------------------------------------------------
    def _load(self, k: int) -> None:
        blk = self.blocks[k]
        if all(s.loaded for s in blk.slabs):
            return
        t0 = time.perf_counter()
        for r in blk.ready:
            r()
        self.stats["stream_wait_s"] += time.perf_counter() - t0
        tr = _trace_current()
        t0 = None
        if tr is not None:
            self.copier.after_compute()  # (fill does it too) the span starts at the copy, not the wait
            t0 = tr.now(self.copier.stream)
        for s in blk.slabs:
            if not s.loaded:
                s.load()
                self.stats["bytes_h2d"] += s.nbytes
        self.stats["loads"] += 1
        if tr is not None:
            tr.span(
                "h2d", f"load {blk.index}", t0, tr.now(self.copier.stream), chunk=blk.index, bytes=blk.nbytes
            )
        loaded = sum(b.nbytes for b in self.blocks if b.loaded)
        self.stats["peak_loaded_bytes"] = max(self.stats["peak_loaded_bytes"], loaded)

    def _use(self, k: int) -> None:
        """Block k is about to run: loaded, and the current stream waits for its copies."""
        self._load(k)
        for s in self.blocks[k].slabs:
            s.wait()

    def _evict(self, k: int) -> None:
        blk = self.blocks[k]
        if blk.loaded:
            for s in blk.slabs:
                s.evict()
            self.stats["evictions"] += 1

    def home_bytes(self) -> dict:
        """{"streamed_bytes": the streamed blocks' slabs at home in pinned host memory,
        "packed_bytes": the packed quantized codes and absmax among them, "disk_bytes": the slabs
        at home on disk instead (weights/disk_slab.py, staged through a window of pinned buffers)}."""
        from ..quant.packed import packed_buffers  # noqa: PLC0415

        packed = {id(t) for b in self.blocks for _, _, t in packed_buffers(b.module)}
        slabs = [s for b in self.blocks for s in b.slabs]
        disk = sum(s.nbytes for s in slabs if getattr(s, "on_disk", False))
        carried = sum(
            p.nbytes for s in slabs if not getattr(s, "on_disk", False) for p in s.params if id(p) in packed
        )
        home = sum(s.nbytes for s in slabs) - disk
        return {"streamed_bytes": home, "packed_bytes": carried, "disk_bytes": disk}

    def loaded_bytes(self) -> int:
        return sum(s.device_bytes() for b in self.blocks for s in b.slabs)

    # ---- hooks ----------------------------------------------------------------------------------
    @staticmethod
    def _in_backward() -> bool:
        return torch._C._current_graph_task_id() != -1

    def _keep_set(self, k: int) -> set[int]:
        """The window at block k's forward: the `ahead` + 1 loaded blocks used next (farthest next
        use is evicted). Next are k, k+1, ..., the last block, then (when a backward follows, grad
        mode on) the blocks before k in reverse: near the end of the forward the blocks just run
        stay loaded for the backward, which starts with them."""
        n = len(self.blocks)
        keep = set(range(k, min(n, k + 1 + self.ahead)))
        if torch.is_grad_enabled():
            j = k - 1
            while len(keep) < self.ahead + 1 and j >= 0 and self.blocks[j].loaded:
                keep.add(j)
                j -= 1
        return keep

    # ---- driven by the caller (driven=True) ---------------------------------------------------------
    def window(self, keep) -> None:
        """Exactly the blocks `keep` (indices into `blocks`, the one needed first first) are
        loaded: the others are evicted, then the missing ones queued for loading in that order."""
        keep = list(keep)
        for j in range(len(self.blocks)):
            if j not in keep:
                self._evict(j)
        for j in keep:
            self._load(j)

    def use(self, k: int) -> None:
        """Block k is about to run: loaded, and the current stream waits for its copies."""
        self._use(k)

    # ---- hooks ----------------------------------------------------------------------------------
    def _pre_forward(self, k: int, args) -> None:
        if self.driven:
            return
        self._use(k)
        if self._in_backward():
            return  # a recompute inside backward
        keep = self._keep_set(k)
        for j in range(len(self.blocks)):
            if j not in keep:
                self._evict(j)
        for j in sorted(keep - {k}):
            self._load(j)
        x = _first_grad_tensor(args)
        if x is not None:
            x.register_hook(lambda g, k=k: self._input_grad(k))

    def _post_forward(self, k: int, out) -> None:
        if self.driven or self._in_backward():
            return
        if torch.is_autocast_enabled(self.copier.device.type):
            # autocast caches the low-precision cast of every weight that requires grad until its
            # region ends: all streamed blocks' casts would stay on the device. (A cleared cache
            # only means a weight used again is cast again, to the same values.)
            torch.clear_autocast_cache()
        y = _first_grad_tensor(out)
        if y is not None:
            y.register_hook(lambda g, k=k: self._output_grad(k))
            if k >= len(self.blocks) - 1 - self.ahead:
                return  # backward starts with it (_keep_set keeps it)
        self._evict(k)

    def _output_grad(self, k: int) -> None:
        if self.driven:
            return
        task = torch._C._current_graph_task_id()
        if task != self._task:
            self._task = task
            torch.autograd.Variable._execution_engine.queue_callback(self._end_backward)
        nxt = k + 1  # the block after k finished its backward: k's output gradient is complete
        if nxt < len(self.blocks) and self.blocks[nxt].index == self.blocks[k].index + 1:
            self._evict(nxt)
        self._use(k)
        for j in range(k - 1, max(-1, k - 1 - self.ahead), -1):
            self._load(j)

    def _input_grad(self, k: int) -> None:
        if not self.driven:
            self._evict(k)

    def _end_backward(self) -> None:
        self._task = None
        for j in range(len(self.blocks)):
            self._evict(j)

    # ---- outside the step ---------------------------------------------------------------------
    def evict_all(self) -> None:
        """Every streamed weight back at home (after a failed pass, before a state dict)."""
        self._task = None
        for j in range(len(self.blocks)):
            self._evict(j)

    def apply(self, model, fn, run):
        """model.to()/.cuda()/.half() on a model with streamed blocks: `run` (Module._apply) sees
        empty stand-ins for the streamed weights, which stay at home; a conversion that would
        change their dtype raises (convert the model before wrap())."""
        self.evict_all()
        self.copier.synchronize()
        slabs = [s for b in self.blocks for s in b.slabs]
        # Module._apply replaces buffers (packed codes) by new tensors: they are put back after
        ids = {id(p) for s in slabs for p in s.params}
        buffers = [
            (m, name, t)
            for b in self.blocks
            for m in b.module.modules()
            for name, t in m._buffers.items()
            if t is not None and id(t) in ids
        ]
        for s in slabs:  # (a disk slab's dtype is its record's bytes: its stand-ins have the tensors')
            for p, v in zip(s.params, s.hviews):
                p.data = torch.empty(0, dtype=v.dtype)
        try:
            out = run()
            changed = {str(p.dtype) for s in slabs for p, v in zip(s.params, s.hviews) if p.dtype != v.dtype}
            changed |= {str(m._buffers[n].dtype) for m, n, t in buffers if m._buffers[n].dtype != t.dtype}
            changed = sorted(changed)
        finally:
            for m, name, t in buffers:
                m._buffers[name] = t
            for s in slabs:
                for p, v in zip(s.params, s.hviews):
                    p.data = v
        if changed:
            raise RuntimeError(
                f"ramstream: converting a model with streamed weights to {', '.join(changed)} is not "
                "supported: convert the model before wrap() (or unwrap(), convert, wrap() again)"
            )
        return out

    def close(self) -> None:
        """Removes the hooks; the streamed parameters stay views of their pinned home copies. When
        the streamer owns its disk slabs' store (`disk`), their weights come back into host memory
        (ordinary tensors) and the store is closed (its file removed)."""
        self.evict_all()
        self.copier.synchronize()
        for h in self._handles:
            h.remove()
        self._handles = []
        if self.disk is not None:
            for s in (s for b in self.blocks for s in b.slabs if getattr(s, "on_disk", False)):
                s.restore()
            self.disk.close()
            self.disk = None
