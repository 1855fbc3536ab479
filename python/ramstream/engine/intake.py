"""Gradient intake: the gradient hooks, in-flight throttling, gathering and landing.

Training thread only. Autograd's post-accumulate-grad hook of every parameter calls on_grad();
a front end that runs its own backward calls (the pipeline) drives a pass instead: begin_driven(),
take() per final gradient, end_driven() (its callers serialise them).
A host bucket's gradient goes to the bucket's pinned landing buffer: on its own when the
strategy says it may (large ones; every one on the CPU), otherwise gathered into a device
staging buffer first (small ones on a GPU; every one under data parallel, which sums them
across ranks there). When the bucket got every expected gradient, the strategy decides when it
is flushed (single process: now; data parallel: in the order every rank reduces); the flush
copies the staging buffer to the landing buffer and hands the landed slots to the updater. A
mapped bucket's gradient stays on the device and goes to the updater as it is.

A backward pass that raises leaves the intake mid-pass (autograd never runs its end callback);
recover_if_abandoned(), called before anything else touches the engine, discards what the pass
and the micro-batches before it gathered, so the next step starts clean.
"""

from __future__ import annotations

import collections
import sys
import time
import warnings
import weakref

import torch

from .._faults import fault_point
from .buckets import GPU_UPDATED, Bucket, Slot
from .devices import check_param

_NESTED = (
    "ramstream: a backward pass started inside another one's backward reached the wrapped "
    "parameters: reentrant activation checkpointing (torch.utils.checkpoint with "
    "use_reentrant=True) does this, and ramstream cannot tell where the outer pass ends. Use "
    "use_reentrant=False: torch.utils.checkpoint(fn, *args, use_reentrant=False), or with "
    "Hugging Face model.gradient_checkpointing_enable(gradient_checkpointing_kwargs="
    "{'use_reentrant': False}) (transformers' default when given no kwargs; kwargs without "
    "'use_reentrant', as peft's prepare_model_for_kbit_training passes by default, get torch's "
    "default, use_reentrant=True)"
)


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
    """What every gradient hook does first (owner: the intake, or the resident optimizer): at the
    first gradient of a pass, refuse a nested (reentrant) backward, drop the last pass if it
    raised before its end, and start the new one (owner._begin_backward)."""
    task = torch._C._current_graph_task_id()
    if owner._in_backward and task == owner._task:
        return
    if _in_nested_backward():
        raise RuntimeError(_NESTED)
    if owner._in_backward:
        owner._abandon_backward()  # the last pass raised before its end
    owner._begin_backward()
    owner._task = task


def _grad_hook(p: torch.nn.Parameter, fn):
    """p's post-accumulate-grad hook, also on a frozen parameter (only Python's check refuses it),
    so that a gradient reaching a parameter unfrozen after wrap() is noticed."""
    if p.requires_grad:
        return p.register_post_accumulate_grad_hook(fn)
    p.requires_grad_(True)
    try:
        return p.register_post_accumulate_grad_hook(fn)
    finally:
        p.requires_grad_(False)


def _weak_method(obj, name: str):
    """A function calling obj.name(...) while obj lives (a no-op afterwards). Hooks hold their
    owner this way: a tensor's hooks are reachable from C++, where Python's garbage collector
    cannot see a cycle, so a strong reference would keep the owner alive forever."""
    ref = weakref.ref(obj)

    def call(*args):
        o = ref()
        if o is not None:
            return getattr(o, name)(*args)
        return None

    return call


class InFlight:
    """Device memory held by gradients on their way to the host (or waiting for their GPU
    update), as (event, bytes) in order: backward waits while more than max_bytes would be held
    (None: no limit)."""

    def __init__(self, max_bytes: int | None, stats: dict) -> None:
        self.max_bytes = max_bytes
        self.stats = stats
        self._events: collections.deque = collections.deque()
        self._bytes = 0

    def throttle(self, nbytes: int) -> None:
        """Before a copy of nbytes: waits for the oldest copies until it fits."""
        if self.max_bytes is None:
            return
        while self._events and self._bytes + nbytes > self.max_bytes:
            ev, n = self._events.popleft()
            t0 = time.perf_counter()
            ev.synchronize()
            self.stats["throttle_s"] += time.perf_counter() - t0
            self._bytes -= n

    def track(self, event, nbytes: int) -> None:
        """nbytes of device memory are held until `event` completes."""
        if self.max_bytes is None or event is None:
            return
        self._events.append((event, nbytes))
        self._bytes += nbytes
        while self._events and self._events[0][0].query():
            self._bytes -= self._events.popleft()[1]


class GradientIntake:
    def __init__(
        self,
        *,
        slots: list[Slot],
        frozen: list,
        buckets: list[Bucket],
        dev,
        device: torch.device,
        parallel,
        updater,
        weights,
        inflight: InFlight,
        stats: dict,
        accumulation_steps: int,
        max_grad_norm: float | None,
        log,
    ) -> None:
        self.slots, self.frozen, self.buckets = slots, frozen, buckets
        self.dev, self.parallel, self.updater, self.inflight = dev, parallel, updater, inflight
        self.weights = weights
        self.stats, self.log = stats, log
        self.accumulation_steps = accumulation_steps
        self.max_grad_norm = max_grad_norm
        self.device = device
        self.micro = 0  # backward passes finished since the last step
        self.driven = False  # a front end hands the gradients over itself (take(); the pipeline)
        self.declared_steps: int | None = None  # accumulation_steps while an extra pass is summed
        self._in_backward = False
        self._task = -1
        self.frozen_names: dict[int, str] = {}
        self.on_abandon: list = []  # called once a backward pass that raised is dropped
        self._on_grad_weak = _weak_method(self, "on_grad")
        self._hooks = [_grad_hook(s.param, self._on_grad_weak) for s in slots]
        self._frozen_hooks = [_grad_hook(p, _weak_method(self, "on_frozen_grad")) for p in frozen]

    @property
    def in_backward(self) -> bool:
        return self._in_backward

    @property
    def final_micro(self) -> bool:
        return self.micro == self.accumulation_steps - 1

    def rehook(self, s: Slot, p: torch.nn.Parameter) -> None:
        """p replaces s.param: the gradient hook moves to p."""
        i = self.slots.index(s)
        self._hooks[i].remove()
        self._hooks[i] = _grad_hook(p, self._on_grad_weak)

    def on_frozen_grad(self, p: torch.nn.Parameter) -> None:
        """A gradient reached a parameter that was frozen when the engine was built."""
        name = self.frozen_names.get(id(p), f"of shape {tuple(p.shape)}")
        raise RuntimeError(
            f"ramstream: parameter {name} got a gradient, but it had requires_grad=False when "
            "wrap() ran, so ramstream keeps no optimizer state for it (frozen parameters take no "
            "host RAM) and it would never be updated. Set requires_grad before wrap(), or call "
            "ramstream.unwrap(model), unfreeze it and wrap(model, optimizer) again (the "
            "optimizer's state carries over)"
        )

    # ---- one backward pass ----------------------------------------------------------------------
    def _begin_backward(self) -> None:
        if self.micro >= self.accumulation_steps and self._can_sum_extra_pass():
            self._sum_extra_pass()
        if self.micro >= self.accumulation_steps:
            k = self.accumulation_steps
            raise RuntimeError(
                f"ramstream: backward pass {self.micro + 1} before optimizer.step(), but "
                f"accumulation_steps={k}. Gradients leave the GPU as they are produced and are "
                f"summed on the host only for declared micro-batches: pass "
                f"accumulation_steps={self.micro + 1} (or more) to wrap()/OffloadAdamW, or call "
                "optimizer.step() after each backward."
            )
        self.updater.begin_pass()
        self.parallel.begin_backward(self.buckets)
        self._in_backward = True
        if not self.driven:
            torch.autograd.Variable._execution_engine.queue_callback(self._end_backward)

    def _can_sum_extra_pass(self) -> bool:
        """An undeclared backward pass can be summed when no update has run yet: with
        max_grad_norm every update waits for step() (a user's clip_grad_norm_ already took the
        norm, and data parallel reduced and may have updated: those raise)."""
        return self.max_grad_norm is not None and self.updater.clip_now is None and self.parallel.world == 1

    def _sum_extra_pass(self) -> None:
        """Backward pass micro + 1 before step() with max_grad_norm (TrainStream sums it): this
        step now accumulates micro + 1 passes. The passes so far are in the landing buffers
        (moved to host accumulators when none were planned: 4 bytes per parameter, allocated at
        the first such pass and kept) or, for GPU-updated buckets, in .grad, where autograd sums
        the next one; the norms they took are dropped and taken again at the end of the new last
        pass."""
        self.updater.drain()
        self.dev.synchronize()
        k = self.micro + 1
        landed_only = self.accumulation_steps == 1  # the passes so far are in the landing buffers
        if self.declared_steps is None:
            self.declared_steps = self.accumulation_steps
        for b in self.buckets:
            b.sq_norm = 0.0
            if b.landing is None or b.placement in GPU_UPDATED or not landed_only:
                continue
            if b.acc is None:
                b.acc = torch.empty(b.numel, dtype=torch.float32)
            for s in b.slots:
                if s.arrivals > 0:
                    b.acc[s.offset : s.offset + s.numel].copy_(b.landing[s.offset : s.offset + s.numel])
        self.updater.mapped.discard()
        self.accumulation_steps = self.updater.accumulation_steps = k
        self.log(
            f"backward pass {k} before optimizer.step() with max_grad_norm: summed with the "
            f"{k - 1} before it (accumulation_steps={self.declared_steps} declared; declare it to "
            "plan the host accumulators)"
        )

    def _restore_declared_steps(self) -> None:
        if self.declared_steps is not None:
            self.accumulation_steps = self.updater.accumulation_steps = self.declared_steps
            self.declared_steps = None

    # ---- driven: the front end runs its own backward calls and hands each gradient over --------
    def begin_driven(self) -> None:
        """A pass whose gradients the caller hands over (take()) and ends (end_driven()): the
        pipeline's step, which makes many autograd.backward calls (a chunk and a microbatch each)
        on several threads. The gradient hooks stand aside while driven."""
        if self._in_backward:
            self._abandon_backward()  # the last driven pass did not end (its step raised)
        self.driven = True
        try:
            self._begin_backward()
        except BaseException:
            self.driven = False
            raise
        self._task = -2  # no graph task's id: a hook outside the pass cannot join it

    def take(self, params) -> None:
        """Each parameter's `.grad` is its final gradient of this pass (on the device, made on the
        current stream): it goes to the landing buffer (and the update, eagerly, once its bucket
        is complete); `.grad` becomes None."""
        for p in params:
            s: Slot = p._ramstream_slot
            if p.grad is None:
                continue
            self.stats["grad_hook_calls"] += 1
            s.micro_arrived = True  # (its block may be evicted already: the gradient is what counts)
            self._on_grad_host(s, s.bucket, p)

    def end_driven(self) -> None:
        """The driven pass ended: what it gathered counts as one micro-batch."""
        self._end_backward()
        self.driven = False

    def abandon_driven(self) -> None:
        """The driven pass raised: what was gathered since the last step is dropped (updates that
        already ran stay, with a RuntimeWarning saying how many, as for a failed backward)."""
        if self._in_backward:
            self._abandon_backward()
        self.driven = False

    def on_grad(self, p: torch.nn.Parameter) -> None:
        if self.driven:
            return  # the front end hands the gradient over itself, once final (take())
        s: Slot = p._ramstream_slot
        self.stats["grad_hook_calls"] += 1
        check_param(p, self.device)
        track_pass(self)
        fault_point("backward.grad_hook")
        b = s.bucket
        if p.dtype != b.dtype or p.data_ptr() != b.device_flat.data_ptr() + s.offset * p.element_size():
            raise RuntimeError(
                "ramstream: parameters were replaced or converted after wrap() "
                "without the engine seeing it; call model.to(...) on the wrapped "
                "model itself (it rebinds the engine) or wrap() again"
            )
        if p.grad is None:
            return
        s.micro_arrived = True
        if b.placement in GPU_UPDATED:
            s.arrivals += 1  # the GPU updates it; its gradient stays on the device until then
            if self.final_micro:  # (earlier micro-batches: autograd sums the next into .grad)
                self.updater.mapped_gradient(b, s)
        else:
            self._on_grad_host(s, b, p)

    def _landing_reusable(self, b: Bucket) -> None:
        """Before the first copy into b's landing buffer in this backward pass."""
        if not b.pending_landing_checked:
            self.updater.wait_job(b.landing_seq)  # the engine has finished reading the landing
            self.dev.wait_landing_reusable(b.h2d_event)
            b.pending_landing_checked = True

    def _on_grad_host(self, s: Slot, b: Bucket, p) -> None:
        self._landing_reusable(b)
        fault_point("backward.landing")
        g = p.grad
        if self.parallel.lands_alone(s):
            self.inflight.throttle(g.nbytes)
            self.dev.grad_to_host(b.landing[s.offset : s.offset + s.numel], g)
            self.inflight.track(self.dev.record_d2h(), g.nbytes)
        else:
            if b.staging is None:
                b.staging, b.staging_lo = self.parallel.new_staging(b)
            lo = s.offset - b.staging_lo
            self.dev.gather_on_device(b.staging[lo : lo + s.numel], g)
        p.grad = None
        s.arrivals += 1
        b.micro_list.append(s)
        if self.parallel.complete(b):
            self.parallel.on_bucket_complete(b, self._flush)

    def _flush(self, b: Bucket) -> None:
        """Lands the gradients of b that arrived since the last flush (summed onto the owner
        first, under data parallel) and hands them to the updater."""
        arrived, b.micro_list = b.micro_list, []
        slots = self.parallel.reduce(b, arrived)
        if not self.parallel.owns(b):
            b.staging = None
            if self.final_micro and self.max_grad_norm is None:
                for s in slots:  # the owner takes the step
                    s.step += 1
                    s.updated = True
            return
        if not slots:
            b.staging = None
            return
        self._land_staged(b, slots)
        ev = self.dev.record_d2h()
        self.stats["bytes_d2h"] += sum(s.numel for s in slots) * b.landing.element_size()
        self.updater.landed(b, slots, ev, final=self.final_micro)

    def _land_staged(self, b: Bucket, slots: list[Slot]) -> None:
        """The staging buffer's gradients of `slots` to b's landing buffer (D2H)."""
        if b.staging is None:
            return
        self._landing_reusable(b)  # data parallel: no gradient of b may have arrived here
        self.inflight.throttle(b.staging.nbytes)
        lo = b.staging_lo
        staged = [s for s in slots if s.offset >= lo]
        if len(staged) == sum(1 for s in b.slots if s.offset >= lo):
            self.dev.flush_to_host(b.landing[lo:], b.staging)
        else:  # a partial flush must not overwrite ranges that landed earlier
            for s in staged:
                self.dev.flush_to_host(
                    b.landing[s.offset : s.offset + s.numel],
                    b.staging[s.offset - lo : s.offset - lo + s.numel],
                )
        nbytes = b.staging.nbytes
        b.staging = None
        self.inflight.track(self.dev.record_d2h(), nbytes)

    def _end_backward(self) -> None:
        self.parallel.end_backward(self.buckets, self._flush)
        for b in self.buckets:
            b.pending_landing_checked = False
            for s in b.slots:
                s.micro_arrived = False
        self.micro += 1
        self._in_backward = False

    # ---- the step and failed passes -------------------------------------------------------------
    def end_step(self) -> None:
        """After step() queued the updates: the next step expects what this one got."""
        for s in self.slots:
            if s.arrivals == 0 and s.expected and self.micro > 0:
                s.expected = False  # it got no gradient this step: don't wait for it
            elif s.arrivals > 0:
                s.expected = True
            s.arrivals = 0
            s.updated = False
        self.micro = 0
        self._restore_declared_steps()

    def recover_if_abandoned(self) -> None:
        """Outside a backward pass, a pass still marked as running raised before its end."""
        if self._in_backward and not self.driven and torch._C._current_graph_task_id() == -1:
            self._abandon_backward()

    def _abandon_backward(self) -> None:
        """The last backward pass raised before its end. Everything gathered since the last
        optimizer step is discarded: host sums of earlier micro-batches cannot be told apart from
        the failed pass's share, so the whole accumulation window goes (as zero_grad() would)."""
        self.parallel.on_abandoned_pass()
        self._discard_gathered("a backward pass raised before its end")
        for fn in self.on_abandon:
            fn()

    def discard_if_gathered(self) -> None:
        """zero_grad() between backward and step(): the gradients gathered since the last step
        are dropped, as torch drops them (the skip-this-batch pattern)."""
        if not self._in_backward and self.micro > 0:  # every finished pass counts in micro
            self._discard_gathered("zero_grad() after backward, before step()")

    def _discard_gathered(self, why: str) -> None:
        """Drops every gradient gathered since the last step. Updates that wait for step()
        (clipping, accumulation, eager_updates=False) have not run, so weights and optimizer
        state are as they were. Updates that already ran during backward (eager: a bucket's
        gradients complete, no clipping) cannot be undone: those parameters keep their step, and
        a RuntimeWarning says how many."""
        self.updater.drain()  # queued landings and norms have run
        self.dev.synchronize()  # and the copies and GPU norms
        stepped = [s for s in self.slots if s.updated]
        dropped = sum(1 for s in self.slots if s.arrivals > 0 and not s.updated)
        # owners updated these: every rank takes the new weights
        self.weights.broadcast([self.buckets[i] for i in sorted({s.bucket.index for s in stepped})])
        for b in self.buckets:
            b.micro_list, b.staging, b.sq_norm = [], None, 0.0
            b.pending_landing_checked = False
            for s in b.slots:
                if not s.updated:  # a mapped slot's gradient waits on the device; a host
                    s.param.grad = None  # slot's, when its landing raised
                s.arrivals, s.micro_arrived, s.updated = 0, False, False
        self.updater.discard()
        self.micro, self._in_backward, self._task = 0, False, -1
        self._restore_declared_steps()
        msg = f"{why}: the gradients of {dropped} parameters gathered since the last step were discarded"
        if stepped:
            msg += (
                f"; {len(stepped)} parameters had already taken their update during "
                "backward and keep it (pass eager_updates=False, or use max_grad_norm, for "
                "steps that can still be dropped)"
            )
            warnings.warn("ramstream: " + msg, RuntimeWarning, stacklevel=5)
        self.log(msg)

    def close(self) -> None:
        """Removes the gradient hooks."""
        for h in self._hooks + self._frozen_hooks:
            h.remove()
        self._hooks, self._frozen_hooks = [], []
