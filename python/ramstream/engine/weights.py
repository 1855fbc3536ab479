"""The weight return path: new weights back to the device, and the waits that read them.

A bucket is "pending" from the moment its update is queued until a wait for it returned. The
updater hands each bucket over here: a host bucket's new weights are copied from the landing
buffer to the device on the H2D stream (engine thread, send), a mapped bucket's are written in
place by the GPU kernel (updated_in_place); under data parallel the owner's weights are then
broadcast (the strategy's comm thread). The next forward waits, in its modules' pre-hooks, only
for the buckets a module reads; the read guard (guard.py) waits for a weight read elsewhere.
"""

from __future__ import annotations

import time

import torch

from .._faults import fault_point
from . import guard as _guard


class WeightReturn:
    def __init__(self, *, buckets, dev, parallel, wait_job, stats) -> None:
        """wait_job(seq): blocks until engine-thread job seq ran (the updater's worker)."""
        self.buckets, self.dev, self.parallel = buckets, dev, parallel
        self._wait_job = wait_job
        self.stats = stats
        self._module_hooks: list = []

    def mark_pending(self, b) -> None:
        """Training thread, when b's update is queued: reads of b's weights wait from now on."""
        if not b.pending:
            b.pending = True
            _guard._pending[0] += 1

    # ---- from the updater -----------------------------------------------------------------------
    def send(self, b, ranges) -> None:
        """Engine thread, after the host AdamW wrote b's new weights (into the landing buffer on
        a GPU, the device buffer itself on the CPU): H2D of the updated ranges; b.h2d_event marks
        their arrival (and the moment the landing buffer may take gradients again)."""
        if b.streamed:  # the weights are in the slab's home: its block's next load copies them
            b.h2d_event = None
            return
        if self.dev.type != "cpu":
            for start, n in ranges:
                self.dev.weights_to_device(b.device_flat[start : start + n], b.landing[start : start + n])
                self.stats["bytes_h2d"] += n * b.landing.element_size()
        b.h2d_event = self.dev.record_h2d()

    def updated_in_place(self, b, event) -> None:
        """Training thread: the GPU kernel queued before `event` writes b's new weights."""
        b.h2d_event = event
        self.mark_pending(b)

    def broadcast(self, buckets) -> bool:
        """The owners' new weights of `buckets` to every process (the same buckets, in the same
        order, on every rank); True when any weights here will change."""
        out = False
        for b in buckets:
            if self.parallel.broadcast(b):
                self.mark_pending(b)
                out = True
        return out

    # ---- waits ----------------------------------------------------------------------------------
    def wait(self, b) -> None:
        """Blocks until b's new weights are usable by work queued after this call."""
        if not b.pending:
            return
        t0 = time.perf_counter()
        if not self.parallel.wait(b):  # data parallel: the owner's broadcast landed
            if b.placement == "host":
                self._wait_job(b.update_seq)  # the host AdamW ran (and queued the H2D)
            self.dev.device_wait(b.h2d_event)
        b.pending = False
        _guard._pending[0] -= 1
        self.stats["wait_s"] += time.perf_counter() - t0
        self.stats["waits"] += 1

    def attach_forward_waits(self, model: torch.nn.Module, wait) -> None:
        """Forward pre-hooks: a module waits (wait(b)) only for the buckets of its own
        parameters."""
        for m in model.modules():
            own = [p for p in m.parameters(recurse=False) if hasattr(p, "_ramstream_slot")]
            idx = sorted({p._ramstream_slot.bucket.index for p in own})
            if not idx:
                continue
            bl = [self.buckets[i] for i in idx]

            def pre_hook(module, args, bl=bl):
                fault_point("forward.pre_hook")
                for b in bl:
                    if b.pending:
                        wait(b)

            self._module_hooks.append(m.register_forward_pre_hook(pre_hook))

    def close(self) -> None:
        for h in self._module_hooks:
            h.remove()
        self._module_hooks = []
