"""Delayed parameter update (wrap(delayed_update=...), ZeRO-Offload's one-step DPU).

After `warmup` undelayed steps, step() queues the host AdamW of step t and returns at once: the
new weights go to a side buffer (`b.dpu_out`), not to the model, so the forward and backward of
step t+1 run on the weights of update t-1 while update t runs on the engine thread. step() of
step t+1 first waits for update t and installs it (`install`), then queues update t+1:
w[t+1] = AdamW(w[t], g(w[t-1])). synchronize() (state dicts, checkpoints, close, unwrap) installs
too. The gradient buffers are double-buffered (`b.dpu_landing`, `b.dpu_acc`): update t reads one
pair while step t+1's gradients land in the other, so the backward never waits for the update.

Only host-updated buckets (the "host" placement, streamed or not) are delayed: their update is
what takes the host's time. Buckets the GPU updates ("mapped", "device": optimizer_mode="auto"'s
shares) are updated as without delay, during the backward or at step(), and the next forward
reads their new weights: in one step some parameters are one update behind and the others are
not. A bucket that layout.relocate moves (the VRAM share, the split refiner, the watchdog) gets its
side buffers, or loses them, in `placed`.
Training thread, except `run_update`'s body (engine thread).
"""

from __future__ import annotations

import time

import torch

from ..trace import current as _trace_current
from .host_jobs import update


class Delayed:
    def __init__(self, warmup: int, *, dev, worker, weights, stats: dict) -> None:
        """warmup: the first `warmup` steps are taken without delay."""
        self.warmup = warmup
        self.dev, self.worker, self.weights, self.stats = dev, worker, weights, stats
        self.pending: list = []  # buckets whose delayed update is queued, not installed

    def allocate(self, b) -> None:
        """The side buffers of an owned host bucket (layout.py made its state already); a bucket
        the GPU updates ("mapped", "device") is not delayed and gets none."""
        if b.placement != "host":
            self.release(b)
            return
        b.dpu_out = self.dev.host_buffer(b.numel, b.dtype)  # update t's weights until installed
        b.dpu_landing = self.dev.host_buffer(b.numel, b.dtype)
        b.dpu_acc = None if b.acc is None else torch.empty_like(b.acc)
        b.dpu_seq, b.dpu_ranges, b.dpu_event = 0, None, None
        if b.streamed and b.master is not None and b.master.data_ptr() == b.slab.home.data_ptr():
            b.master = b.slab.home.clone()  # an fp32 home is no longer its master: loads read home

    def release(self, b) -> None:
        """b has no side buffers (a GPU-updated bucket)."""
        b.dpu_out = b.dpu_landing = b.dpu_acc = None
        b.dpu_seq, b.dpu_ranges, b.dpu_event = 0, None, None

    def placed(self, b) -> None:
        """After layout.relocate moved quiescent bucket b (synchronize() installed what was
        pending): side buffers when it became host-updated, none when the GPU updates it now."""
        if b.placement == "host" and getattr(b, "dpu_out", None) is None:
            self.allocate(b)
        elif b.placement != "host":
            self.release(b)

    def delays(self, step: int) -> bool:
        """Whether step number `step` (1-based, counting taken steps) is delayed."""
        return step > self.warmup

    # ---- step() ---------------------------------------------------------------------------------
    def queue(self, b, job_of) -> int:
        """Queues b's delayed update (job_of(grad) builds the job, which reads `grad`), then
        swaps b's gradient buffers so that the next step's gradients land beside it."""
        grad = b.acc if b.acc is not None else b.landing
        seq = self.worker.submit(job_of(grad), priority=b.index, deps=(b.last_seq,))
        # not b.update_seq: the weights the next forward reads are the installed ones (a wait for
        # this job there would serialise the update with the step it is meant to overlap)
        b.dpu_seq = seq
        b.landing, b.dpu_landing = b.dpu_landing, b.landing
        b.acc, b.dpu_acc = b.dpu_acc, b.acc
        # the buffers now in use were last read by update t-1, which install() waited for
        b.last_seq = b.landing_seq = 0
        self.pending.append(b)
        return seq

    def run_update(self, b, pieces, hypers, grad_scale, accumulate, grad, seed) -> None:
        """Engine thread: AdamW on b's pieces with `grad`; the new weights into b.dpu_out."""
        if b.dpu_event is not None:
            self.dev.host_wait(b.dpu_event)  # the last install's H2D has read dpu_out
        t0 = time.perf_counter()
        b.dpu_ranges = update(b, pieces, hypers, grad_scale, accumulate, b.dpu_out, seed, grad=grad)
        t1 = time.perf_counter()
        self.stats["host_update_s"] += t1 - t0
        self.stats["host_updated_numel"] += sum(p.numel for p in pieces)
        tr = _trace_current()
        if tr is not None:
            tr.span("host optimizer", f"adamw bucket {b.index} (delayed)", t0, t1, bucket=b.index)

    def install(self) -> None:
        """Waits for every queued delayed update and puts its weights where the model reads them:
        the device buffer (CPU engine: copied; GPU: H2D, which the next forward waits for on the
        device), or a streamed block's home (its next load copies it)."""
        pending, self.pending = self.pending, []
        if pending and self.dev.type == "cuda":
            compute = torch.cuda.current_stream(self.dev.device)
            if any(b.streamed for b in pending):
                # a streamed block's last load (a DMA out of its home) was consumed by compute
                # queued before this call: done once that compute is
                compute.synchronize()
            # the copies into device_flat come after the kernels already queued that read it
            self.dev.h2d.wait_stream(compute)
        for b in pending:
            self.worker.wait(b.dpu_seq)
            ranges, b.dpu_ranges = b.dpu_ranges, None
            if not ranges:
                continue
            if b.streamed or self.dev.type == "cpu":
                dst = b.slab.home if b.streamed else b.device_flat
                for a, n in ranges:
                    dst[a : a + n].copy_(b.dpu_out[a : a + n])
                continue
            for a, n in ranges:
                self.dev.weights_to_device(b.device_flat[a : a + n], b.dpu_out[a : a + n])
                self.stats["bytes_h2d"] += n * b.dpu_out.element_size()
            b.h2d_event = b.dpu_event = self.dev.record_h2d()
            self.weights.mark_pending(b)  # the forward waits for the copy (on the device)
        if pending:
            self.stats["delayed_installs"] += 1
