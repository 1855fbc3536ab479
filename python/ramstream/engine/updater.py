"""The updater: turns landed gradients into new weights and hands those to the weight return.

It owns the engine thread (worker.py) and queues its host jobs (host_jobs.py: land, accumulate,
norm, AdamW); a mapped bucket's update runs on the GPU instead (gpu_updates.py). Eagerly, a
bucket is updated as soon as its gradients landed in the last micro-batch's backward; otherwise
(clipping, which needs the global norm first; eager_updates=False) step() queues the updates,
in bucket order, i.e. the order the next forward reads the weights. Each host update ends with
the weight return's send() on the engine thread.

Training thread, except the job bodies (_land_job, _update_and_send: engine thread).
"""

from __future__ import annotations

import math
import time

import torch

from .._faults import fault_point
from ..trace import current as _trace_current
from .buckets import GPU_UPDATED
from .gpu_updates import MappedUpdates
from .host_jobs import Piece, add_sq_norm, land, update
from .nonfinite import find_nonfinite


class NonFinite(Exception):
    """Updater.step() found a non-finite global norm and queued nothing (Engine.step handles it)."""

    def __init__(self, norm: float, slots: list) -> None:
        super().__init__(norm)
        self.norm, self.slots = norm, slots


class Updater:
    def __init__(
        self,
        *,
        buckets,
        dev,
        device,
        parallel,
        weights,
        inflight,
        worker,
        hypers,
        stats: dict,
        seed: int,
        accumulation_steps: int,
        max_grad_norm: float | None,
        eager_updates: bool,
    ) -> None:
        """hypers(): the param groups' hyper-parameters, validated (a list of Hyper)."""
        self.buckets, self.dev, self.parallel, self.weights = buckets, dev, parallel, weights
        self.worker = worker
        self.hypers = hypers
        self.stats, self.seed = stats, seed
        self.accumulation_steps = accumulation_steps
        self.max_grad_norm = max_grad_norm
        self.eager_updates = eager_updates
        self.mapped = MappedUpdates(
            dev=dev, device=device, seed=seed, inflight=inflight, weights=weights, stats=stats
        )
        self.last_grad_norm: float | None = None
        self.bad_buckets: set[int] = set()  # host buckets whose squared norm was not finite
        self.clip_now = None  # (max_norm, norm, micro): clip_grad_norm_ for this step
        self._pass_hypers = None
        self.delay = None  # delayed.Delayed with delayed_update (Engine sets it)
        self.disk = None  # disk_tier.DiskTier with nvme_offload (Engine sets it): reads ahead

    def delaying(self) -> bool:
        """Whether the step being gathered (the next step() to be taken) is delayed."""
        return self.delay is not None and self.delay.delays(self.stats["steps"] + 1)

    # ---- the engine thread ----------------------------------------------------------------------
    def wait_job(self, seq: int) -> None:
        self.worker.wait(seq)

    def drain(self) -> None:
        self.worker.drain()

    def raise_if_failed(self) -> None:
        self.worker.raise_if_failed()

    # ---- during backward ------------------------------------------------------------------------
    def begin_pass(self) -> None:
        self.worker.raise_if_failed()
        self._pass_hypers = None

    def pass_hypers(self):
        """param_groups' hyper-parameters, read (and validated) once per backward pass."""
        if self._pass_hypers is None:
            self._pass_hypers = self.hypers()
        return self._pass_hypers

    def mapped_gradient(self, b, s) -> None:
        """The last micro-batch's gradient of mapped slot s is in s.param.grad."""
        if self.max_grad_norm is not None:
            self.mapped.norm_add(s.param.grad)  # the update waits for the global norm
            return
        if not self.eager_updates:
            return  # step() launches it
        hyper = self.pass_hypers()[s.group]
        s.step += 1
        s.updated = True
        self.mapped.launch(b, [s], hyper_of=lambda g: hyper, grad_scale=1.0)

    def landed(self, b, slots, ev, final: bool) -> None:
        """The gradients of `slots` are on their way into b's landing buffer (done at device
        event `ev`): queues the job that folds them in (accumulation, norm) and, eagerly in the
        last micro-batch without clipping, updates the bucket."""
        accumulate = self.accumulation_steps > 1
        pieces = [Piece(s.offset, s.numel, s.group, s.step + 1, s.arrivals == 1) for s in slots]
        eager = final and self.max_grad_norm is None and self.eager_updates and not self.delaying()
        want_norm = final and self.max_grad_norm is not None
        hypers = self.pass_hypers() if eager else None
        scale = 1.0 / self.parallel.world
        src, acc = b.landing, b.acc  # as now: a delayed step() may swap them before the job runs
        if eager:
            if self.disk is not None:
                self.disk.expect(b)
            self.stats["eager_updates"] += 1  # a bucket's share updated during backward
            for s in slots:
                s.step += 1
                s.updated = True
            self.weights.mark_pending(b)

        def job() -> None:
            self.dev.host_wait(ev)
            t0 = time.perf_counter()
            land(b, pieces, accumulate, want_norm, src, acc)
            t1 = time.perf_counter()
            self.stats["host_land_s"] += t1 - t0
            tr = _trace_current()
            if tr is not None:
                tr.span("host optimizer", f"land bucket {b.index}", t0, t1, bucket=b.index)
            if eager:
                self._update_and_send(b, pieces, hypers, scale, accumulate)

        seq = self.worker.submit(job, priority=b.index, deps=(b.last_seq,))
        b.last_seq = b.landing_seq = seq
        if eager:
            b.update_seq = seq

    def _update_and_send(self, b, pieces, hypers, grad_scale: float, accumulate: bool) -> None:
        """Engine thread: AdamW on a host bucket's pieces, then the new weights to the device."""
        t0 = time.perf_counter()
        if b.streamed:
            out = b.slab.home  # the next load of its block copies it to the device
        else:
            out = b.device_flat if self.dev.type == "cpu" else b.landing
        ranges = update(b, pieces, hypers, grad_scale, accumulate, out, self.seed)
        t1 = time.perf_counter()
        self.stats["host_update_s"] += t1 - t0
        self.stats["host_updated_numel"] += sum(p.numel for p in pieces)
        tr = _trace_current()
        if tr is not None:
            tr.span("host optimizer", f"adamw bucket {b.index}", t0, t1, bucket=b.index)
        self.weights.send(b, ranges)

    # ---- step() -----------------------------------------------------------------------------------
    def step(self, todo, micro: int) -> None:
        """Queues the updates of the slots in `todo` (they got gradients, their update is not
        queued yet) after `micro` backward passes."""
        hypers = self.hypers()  # validated before anything is changed
        clip = self.clip_now
        if clip is not None and clip[2] != micro:
            raise RuntimeError(
                "ramstream: a backward pass ran after clip_grad_norm_ and "
                "before step(); call clip_grad_norm_ after the last one"
            )
        if clip is None and self.max_grad_norm is not None and micro < self.accumulation_steps:
            self.norms_now(todo)
        norm = clip[1] if clip is not None else self.total_norm() if self.max_grad_norm is not None else None
        if norm is not None and not math.isfinite(norm):
            raise NonFinite(norm, self.nonfinite_slots(todo))  # before anything is queued
        max_norm = clip[0] if clip is not None else self.max_grad_norm
        grad_scale = (1.0 if norm is None else clip_coefficient(max_norm, norm)) / self.parallel.world
        accumulate = self.accumulation_steps > 1
        delayed = self.delaying()
        fault_point("step.updates")  # the last point before the first update is queued
        by_bucket: dict[int, list] = {}
        for s in todo:
            by_bucket.setdefault(s.bucket.index, []).append(s)
        for bi in sorted(by_bucket):
            b, slots = self.buckets[bi], by_bucket[bi]
            for s in slots:
                s.step += 1
            if not self.parallel.owns(b):
                continue
            if b.placement in GPU_UPDATED:
                self.mapped.launch(b, slots, hyper_of=lambda g: hypers[g], grad_scale=grad_scale)
                continue
            pieces = [Piece(s.offset, s.numel, s.group, s.step, False) for s in slots]
            if self.disk is not None:
                self.disk.expect(b)  # its state is read ahead in this order
            if delayed:  # the next forward reads the weights as they are (delayed.py)
                self.delay.queue(
                    b,
                    lambda grad, b=b, pieces=pieces: (
                        lambda: self.delay.run_update(
                            b, pieces, hypers, grad_scale, accumulate, grad, self.seed
                        )
                    ),
                )
                continue
            self.weights.mark_pending(b)
            seq = self.worker.submit(
                lambda b=b, pieces=pieces: self._update_and_send(b, pieces, hypers, grad_scale, accumulate),
                priority=b.index,
                deps=(b.last_seq,),
            )
            b.last_seq = b.update_seq = b.landing_seq = seq

    def norms_now(self, todo, accumulated: bool = True) -> None:
        """step() after fewer backward passes than accumulation_steps (the end of an epoch,
        say): the squared norms, otherwise taken in the last micro-batch, of what was summed
        (in the accumulator; with accumulated=False, in the landing buffer: clip_grad_norm_
        with eager_updates=False and no max_grad_norm, where landings take no norm)."""
        by_bucket: dict[int, list[Piece]] = {}
        for s in todo:
            if s.bucket.placement in GPU_UPDATED:
                self.mapped.norm_add(s.param.grad)  # its gradients wait in .grad
            elif self.parallel.owns(s.bucket):
                by_bucket.setdefault(s.bucket.index, []).append(
                    Piece(s.offset, s.numel, s.group, s.step, False)
                )
        for bi, pieces in by_bucket.items():
            b = self.buckets[bi]
            seq = self.worker.submit(
                lambda b=b, pieces=pieces: add_sq_norm(b, pieces, b.acc if accumulated else b.landing),
                priority=b.index,
                deps=(b.last_seq,),
            )
            b.last_seq = b.landing_seq = seq

    def nonfinite_slots(self, todo) -> list:
        """After a non-finite global norm: the slots of `todo` whose gradients hold a NaN or Inf,
        as far as this process holds them (host buckets whose squared norm was not finite, and
        mapped slots' .grad), in slot (forward) order."""
        accumulate = self.accumulation_steps > 1

        def grad_of(s):
            b = s.bucket
            if b.placement in GPU_UPDATED:
                g = s.param.grad
                return None if g is None else g.reshape(-1)
            if not self.parallel.owns(b) or b.index not in self.bad_buckets:
                return None
            src = b.acc if accumulate else b.landing
            return src[s.offset : s.offset + s.numel]

        return find_nonfinite(sorted(todo, key=lambda s: (s.bucket.index, s.offset)), grad_of)

    def total_norm(self) -> float:
        """Waits for every gradient's squared norm (host buckets: computed as they landed;
        mapped ones: on the GPU) and returns the global L2 norm (consumed: set to zero)."""
        total = 0.0
        self.bad_buckets = set()
        for b in self.buckets:
            if b.placement == "host" and self.parallel.owns(b):
                self.worker.wait(b.landing_seq)
                if not math.isfinite(b.sq_norm):
                    self.bad_buckets.add(b.index)
                total += b.sq_norm
                b.sq_norm = 0.0
        total += self.mapped.take_sq_norm()
        total = self.parallel.all_reduce_norm(total)  # data parallel: of the averaged gradient
        self.last_grad_norm = math.sqrt(total)
        return self.last_grad_norm

    def discard(self) -> None:
        """The gradients gathered since the last step were dropped: so are their GPU norms."""
        self.mapped.discard()
        self.clip_now = None

    def close(self) -> None:
        self.worker.close()


def clip_coefficient(max_norm: float, total_norm: float) -> float:
    """torch.nn.utils.clip_grad_norm_'s factor, in float32 as torch computes it."""
    t = torch.tensor(total_norm, dtype=torch.float32)
    coef = torch.tensor(max_norm, dtype=torch.float32) / (t + 1e-6)
    return float(torch.clamp(coef, max=1.0))
