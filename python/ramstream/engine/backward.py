"""The backward half of the engine: what each gradient hook does, and the end of a backward pass.

A host bucket's gradients land in its pinned buffer (large ones directly, small ones gathered on
the device first) and the bucket's job is queued once every expected gradient arrived; a mapped
bucket's gradient is updated on the GPU right away; with data parallel a bucket's gradients are
summed onto its owner first. Mixed into Engine (core.py), whose state these methods use.

A backward pass that raises leaves the engine mid-pass (autograd never runs its end callback);
recover_if_abandoned(), called before anything else touches the engine, discards what the pass
and the micro-batches before it gathered, so the next step starts clean.
"""
from __future__ import annotations

import sys
import time
import warnings

import torch

from .._faults import fault_point
from .buckets import Bucket, Slot
from .gpu_updates import dev_norm_add, launch_mapped
from .host_jobs import Piece, land


_NESTED = (
    "ramstream: a backward pass started inside another one's backward reached the wrapped "
    "parameters: reentrant activation checkpointing (torch.utils.checkpoint with "
    "use_reentrant=True) does this, and ramstream cannot tell where the outer pass ends. Use "
    "use_reentrant=False: torch.utils.checkpoint(fn, *args, use_reentrant=False), or with "
    "Hugging Face model.gradient_checkpointing_enable(gradient_checkpointing_kwargs="
    "{'use_reentrant': False}) (transformers' default when given no kwargs; kwargs without "
    "'use_reentrant', as peft's prepare_model_for_kbit_training passes by default, get torch's "
    "default, use_reentrant=True)")


def _in_nested_backward() -> bool:
    """True when this gradient hook runs in a backward pass started from inside a Python autograd
    Function's backward (CheckpointFunction of a reentrant checkpoint): such a frame is on this
    thread's stack only then, since a leaf's gradient is accumulated by the engine itself."""
    fn = getattr(getattr(torch.autograd.function, "BackwardCFunction", None), "apply", None)
    code = getattr(fn, "__code__", None)
    if code is None:  # pragma: no cover - torch internals changed: not detected
        return False
    f = sys._getframe(1)
    while f is not None:
        if f.f_code is code:
            return True
        f = f.f_back
    return False


def track_pass(owner) -> None:
    """What every gradient hook does first (owner: the engine, or the resident optimizer): at the
    first gradient of a pass, refuse a nested (reentrant) backward, drop the last pass if it
    raised before its end, and start the new one (owner._begin_backward)."""
    task = torch._C._current_graph_task_id()
    if owner._in_backward and task == owner._task:
        return
    if _in_nested_backward():
        raise RuntimeError(_NESTED)
    if owner._in_backward:
        owner._abandon_backward()                 # the last pass raised before its end
    owner._begin_backward()
    owner._task = task


class BackwardHooks:
    # ---- backward ---------------------------------------------------------------------------
    def _begin_backward(self) -> None:
        if self._micro >= self.accumulation_steps:
            k = self.accumulation_steps
            raise RuntimeError(
                f"ramstream: backward pass {self._micro + 1} before optimizer.step(), but "
                f"accumulation_steps={k}. Gradients leave the GPU as they are produced and are "
                f"summed on the host only for declared micro-batches: pass "
                f"accumulation_steps={self._micro + 1} (or more) to wrap()/OffloadAdamW, or call "
                "optimizer.step() after each backward.")
        self.worker.raise_if_failed()
        self._bw_hypers = None
        self._dp_next = len(self.buckets) - 1
        self._in_backward = True
        torch.autograd.Variable._execution_engine.queue_callback(self._end_backward)

    def _backward_hypers(self):
        """param_groups' hyper-parameters, read (and validated) once per backward pass."""
        if self._bw_hypers is None:
            self._bw_hypers = self._hypers()
        return self._bw_hypers

    @property
    def _final_micro(self) -> bool:
        return self._micro == self.accumulation_steps - 1

    def _on_grad(self, p: torch.nn.Parameter) -> None:
        s: Slot = p._ramstream_slot
        self.check_param(p)
        track_pass(self)
        fault_point("backward.grad_hook")
        b = s.bucket
        if p.dtype != b.dtype or p.data_ptr() != b.device_flat.data_ptr() + s.offset * p.element_size():
            raise RuntimeError("ramstream: parameters were replaced or converted after wrap() "
                               "without the engine seeing it; call model.to(...) on the wrapped "
                               "model itself (it rebinds the engine) or wrap() again")
        if p.grad is None:
            return
        s.micro_arrived = True
        if b.placement == "mapped":
            self._on_grad_mapped(s, b, p)
        else:
            self._on_grad_host(s, b, p)

    def _landing_reusable(self, b: Bucket) -> None:
        """Before the first copy into b's landing buffer in this backward pass."""
        if not b.pending_landing_checked:
            self.worker.wait(b.landing_seq)          # the engine has finished reading the landing
            self.dev.wait_landing_reusable(b.h2d_event)
            b.pending_landing_checked = True

    def _on_grad_host(self, s: Slot, b: Bucket, p) -> None:
        self._landing_reusable(b)
        fault_point("backward.landing")
        g = p.grad
        if self.dp is not None:
            if b.staging is None:
                b.staging = self.dev.zeros(b.numel, b.dtype)
            self.dev.gather_on_device(b.staging[s.offset:s.offset + s.numel], g)
        elif s.direct or self.dev.type == "cpu":
            self._throttle(g.nbytes)
            self.dev.grad_to_host(b.landing[s.offset:s.offset + s.numel], g)
            self._track(self.dev.record_d2h(), g.nbytes)
        else:
            if b.staging is None:
                b.staging = self.dev.staging(b.numel - b.small_lo, b.dtype)
            lo = s.offset - b.small_lo
            self.dev.gather_on_device(b.staging[lo:lo + s.numel], g)
        p.grad = None
        s.arrivals += 1
        b.micro_list.append(s)
        if self.dp is not None:
            # every trainable slot is reduced in each pass, also one unfrozen after a step
            # without it (s.expected would not wait for it): the bucket is complete when all are
            if all(x.micro_arrived or not x.param.requires_grad for x in b.slots):
                self._dp_ready(b)
        elif all(x.micro_arrived for x in b.slots if x.expected):
            self._flush_bucket(b)

    def _dp_ready(self, b: Bucket) -> None:
        """Data parallel: b's gradients are complete on this rank. Every rank must issue the
        reduces in the same order, but which bucket completes when depends on this rank's graph
        (a branch taken on one rank only), so buckets are reduced in descending index order
        (backward order of a model whose parameters are registered in forward order): b waits
        for the buckets after it; _end_backward reduces whatever is left, in the same order."""
        b.dp_ready = True
        while self._dp_next >= 0 and self.buckets[self._dp_next].dp_ready:
            self.buckets[self._dp_next].dp_ready = False
            self._flush_bucket(self.buckets[self._dp_next])
            self._dp_next -= 1

    def _flush_dp(self, b: Bucket) -> list[Slot] | None:
        """Data parallel: sum the bucket's gradients onto its owner. Every trainable slot of the
        bucket counts as arrived on every rank (a missing gradient is zero), so all ranks agree
        on steps. Returns the slots the owner updates, None on other ranks."""
        staging = b.staging if b.staging is not None else self.dev.zeros(b.numel, b.dtype)
        b.staging = None
        for s in b.slots:
            if s.param.requires_grad and not s.micro_arrived:
                s.micro_arrived = True
                s.arrivals += 1
        self.dp.reduce(b, staging)
        slots = [s for s in b.slots if s.param.requires_grad]
        if not self.dp.owns(b):
            return None
        self._landing_reusable(b)    # no gradient of b may have arrived on this rank
        self.dev.flush_to_host(b.landing, staging)
        return slots

    def _on_grad_mapped(self, s: Slot, b: Bucket, p) -> None:
        """The GPU updates this slot itself; its gradient stays on the device until then."""
        s.arrivals += 1
        if not self._final_micro:
            return                               # autograd sums the next micro-batch into .grad
        if self.max_grad_norm is not None:
            dev_norm_add(self, p.grad)           # the update waits for the global norm
            return
        if not self.eager_updates:
            return                               # step() launches it
        hyper = self._backward_hypers()[s.group]
        s.step += 1
        s.updated = True
        launch_mapped(self, b, [s], hyper_of=lambda g: hyper, grad_scale=1.0)

    def _flush_bucket(self, b: Bucket) -> None:
        """Queues the engine job for the slots of b that arrived since the last flush."""
        slots, b.micro_list = b.micro_list, []
        if self.dp is not None:
            slots = self._flush_dp(b)
            if not slots:
                for s in b.slots:       # non-owner: the owner takes the step
                    if s.param.requires_grad and self._final_micro:
                        s.step += self.max_grad_norm is None
                        s.updated = self.max_grad_norm is None
                return
        elif not slots:
            return
        if b.staging is not None:
            self._throttle(b.staging.nbytes)
            small = [s for s in slots if not s.direct]
            if len(small) == sum(1 for s in b.slots if not s.direct):
                self.dev.flush_to_host(b.landing[b.small_lo:], b.staging)
            else:  # a partial flush must not overwrite ranges that landed earlier
                for s in small:
                    lo = s.offset - b.small_lo
                    self.dev.flush_to_host(b.landing[s.offset:s.offset + s.numel],
                                           b.staging[lo:lo + s.numel])
            nbytes = b.staging.nbytes
            b.staging = None
            self._track(self.dev.record_d2h(), nbytes)
        ev = self.dev.record_d2h()
        self.stats["bytes_d2h"] += sum(s.numel for s in slots) * b.landing.element_size()
        accumulate = self.accumulation_steps > 1
        pieces = [Piece(s.offset, s.numel, s.group, s.step + 1, s.arrivals == 1) for s in slots]
        eager = self._final_micro and self.max_grad_norm is None and self.eager_updates
        want_norm = self._final_micro and self.max_grad_norm is not None
        hypers = self._backward_hypers() if eager else None
        scale = 1.0 / self.dp.world if self.dp is not None else 1.0
        if eager:
            for s in slots:
                s.step += 1
                s.updated = True
            self._mark_pending(b)

        def job() -> None:
            self.dev.host_wait(ev)
            t0 = time.perf_counter()
            land(b, pieces, accumulate, want_norm)
            self.stats["host_land_s"] += time.perf_counter() - t0
            if eager:
                self._update_and_send(b, pieces, hypers, scale, accumulate)

        seq = self.worker.submit(job, priority=b.index, deps=(b.last_seq,))
        b.last_seq = b.landing_seq = seq
        if eager:
            b.update_seq = seq

    def recover_if_abandoned(self) -> None:
        """Outside a backward pass, a pass still marked as running raised before its end."""
        if self._in_backward and torch._C._current_graph_task_id() == -1:
            self._abandon_backward()

    def _abandon_backward(self) -> None:
        """The last backward pass raised before its end. Everything gathered since the last
        optimizer step is discarded: host sums of earlier micro-batches cannot be told apart from
        the failed pass's share, so the whole accumulation window goes (as zero_grad() would)."""
        if self.dp is not None:
            raise RuntimeError(
                "ramstream: a backward pass raised on this rank under data parallel; the other "
                "ranks wait in its collectives, so the process group cannot continue (as with "
                "DistributedDataParallel): restart from a checkpoint")
        self._discard_gathered("a backward pass raised before its end")
        for fn in self.on_abandon:
            fn()

    def discard_if_gathered(self) -> None:
        """zero_grad() between backward and step(): the gradients gathered since the last step
        are dropped, as torch drops them (the skip-this-batch pattern)."""
        if not self._in_backward and self._micro > 0:   # every finished pass counts in _micro
            self._discard_gathered("zero_grad() after backward, before step()")

    def _discard_gathered(self, why: str) -> None:
        """Drops every gradient gathered since the last step. Updates that wait for step()
        (clipping, accumulation, eager_updates=False) have not run, so weights and optimizer
        state are as they were. Updates that already ran during backward (eager: a bucket's
        gradients complete, no clipping) cannot be undone: those parameters keep their step, and
        a RuntimeWarning says how many."""
        self.worker.drain()                       # queued landings and norms have run
        self.dev.synchronize()                    # and the copies and GPU norms
        stepped = [s for s in self.slots if s.updated]
        dropped = sum(1 for s in self.slots if s.arrivals > 0 and not s.updated)
        if self.dp is not None:       # owners updated these: every rank takes the new weights
            for bi in sorted({s.bucket.index for s in stepped}):
                self._mark_pending(self.buckets[bi])
                self.dp.broadcast_after_update(self.buckets[bi])
        for b in self.buckets:
            b.micro_list, b.staging, b.sq_norm = [], None, 0.0
            b.pending_landing_checked = False
            for s in b.slots:
                if not s.updated:   # a mapped slot's gradient waits on the device; a host
                    s.param.grad = None           # slot's, when its landing raised
                s.arrivals, s.micro_arrived, s.updated = 0, False, False
        if self._dev_norm is not None:
            self._dev_norm.zero_()
        self._micro, self._in_backward, self._task = 0, False, -1
        self._clip_now = None
        msg = f"{why}: the gradients of {dropped} parameters gathered since the last step were " \
              "discarded"
        if stepped:
            msg += (f"; {len(stepped)} parameters had already taken their update during "
                    "backward and keep it (pass eager_updates=False, or use max_grad_norm, for "
                    "steps that can still be dropped)")
            warnings.warn("ramstream: " + msg, RuntimeWarning, stacklevel=4)
        self.log(msg)

    def _end_backward(self) -> None:
        if self.dp is not None:   # the buckets not reduced yet, in _dp_ready's order
            for i in range(self._dp_next, -1, -1):
                b = self.buckets[i]
                b.dp_ready = False
                if b.micro_list or any(s.param.requires_grad and not s.micro_arrived
                                       for s in b.slots):
                    self._flush_bucket(b)
            self._dp_next = -1
        for b in self.buckets:
            if self.dp is None and b.micro_list:
                self._flush_bucket(b)
            b.pending_landing_checked = False
            for s in b.slots:
                s.micro_arrived = False
        self._micro += 1
        self._in_backward = False
