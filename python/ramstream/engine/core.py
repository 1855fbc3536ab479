"""The offload engine: gradient hooks, the per-step state machine, forward waits, .to() rebinds.

Training thread                                   engine thread (Worker)
  backward: post-accumulate-grad hook per param     wait D2H event -> accumulate / norm
    -> copy grad to the bucket's landing buffer      -> AdamW (eager: as soon as a bucket is
    -> drop the device grad                             complete, unless clipping needs the
    -> bucket complete: queue its job                   global norm) -> H2D of new weights
  step(): queue what is left (clip: norm first,     -> record the bucket's h2d event
          then updates in forward order)
  forward: pre-hook waits for the buckets it reads
"""
from __future__ import annotations

import math
import threading
import time

import torch

from . import guard as _guard
from .buckets import Bucket, Slot, build_buckets
from .devices import make_device
from .host_jobs import Hyper, Piece, land, update
from .worker import Worker


class Engine:
    def __init__(self, param_groups: list[dict], *, device: torch.device, moment_dtype: torch.dtype,
                 max_grad_norm: float | None, accumulation_steps: int, bucket_bytes: int,
                 guard_params: bool, order: list[torch.nn.Parameter] | None = None, seed: int = 0,
                 log=None) -> None:
        self.param_groups = param_groups
        self.device = device
        self.moment_dtype = moment_dtype
        self.max_grad_norm = max_grad_norm
        self.accumulation_steps = accumulation_steps
        self.guard_params = guard_params
        self.seed = seed
        self.log = log or (lambda msg: None)
        self.dev = make_device(device)
        self.slots = self._make_slots(param_groups, order)
        self.buckets = self._make_buckets(bucket_bytes)
        self._allocate()
        self.worker = Worker("ramstream-engine", on_start=self.dev.bind_thread)
        self._seq_lock = threading.Condition()
        self._submitted = 0
        self._done = 0
        self._in_backward = False
        self._task = -1
        self._micro = 0
        self._hooks = [s.param.register_post_accumulate_grad_hook(self._on_grad) for s in self.slots]
        self._module_hooks: list = []
        self.forward_waits = False
        self._names: dict = {}
        self.closed = False
        self.stats = {"steps": 0, "bytes_d2h": 0, "bytes_h2d": 0, "host_update_s": 0.0,
                      "host_land_s": 0.0, "wait_s": 0.0, "waits": 0}
        for s in self.slots:
            s.param._ramstream_slot = s
            s.engine_wait = self.wait_bucket
            if guard_params:
                _guard.guard(s.param)

    # ---- construction ---------------------------------------------------------------------
    @staticmethod
    def _make_slots(param_groups, order) -> list[Slot]:
        slots: list[Slot] = []
        seen: set[int] = set()
        index = 0
        for g, group in enumerate(param_groups):
            for p in group["params"]:
                if id(p) in seen:
                    raise ValueError("ramstream: a parameter appears twice in the optimizer's "
                                     "param_groups")
                seen.add(id(p))
                if p.numel() == 0:
                    index += 1
                    continue
                slots.append(Slot(param=p, index=index, group=g, numel=p.numel(),
                                  expected=p.requires_grad))
                index += 1
        if order:
            rank = {id(p): i for i, p in enumerate(order)}
            slots.sort(key=lambda s: rank.get(id(s.param), len(rank) + s.index))
        return slots

    def _make_buckets(self, bucket_bytes: int) -> list[Bucket]:
        # a bucket holds one working dtype: close it when the dtype changes
        out: list[Bucket] = []
        run: list[Slot] = []
        for s in self.slots:
            if run and s.param.dtype != run[-1].param.dtype:
                out += build_buckets(run, bucket_bytes, run[0].param.element_size())
                run = []
            run.append(s)
        if run:
            out += build_buckets(run, bucket_bytes, run[0].param.element_size())
        offset = 0
        for i, b in enumerate(out):
            b.index, b.state_offset = i, offset
            offset += b.numel
        return out

    def _check_device(self, p: torch.nn.Parameter) -> None:
        if p.device != self.device:
            raise RuntimeError(
                f"ramstream: parameter of shape {tuple(p.shape)} is on {p.device} but the engine "
                f"runs on {self.device}; move the model back with model.to('{self.device}') (or "
                "unwrap() and wrap() again for another device)")
        if p.dtype not in (torch.float32, torch.bfloat16, torch.float16):
            raise TypeError(f"ramstream: parameters must be float32, bfloat16 or float16, got "
                            f"{p.dtype} (shape {tuple(p.shape)})")

    def _allocate(self) -> None:
        for b in self.buckets:
            for s in b.slots:
                self._check_device(s.param)
            b.dtype, b.device = b.slots[0].param.dtype, self.device
            b.device_flat = torch.empty(b.numel, dtype=b.dtype, device=self.device)
            b.master = torch.empty(b.numel, dtype=torch.float32)
            for s in b.slots:
                view = b.device_flat[s.offset:s.offset + s.numel]
                view.copy_(s.param.detach().reshape(-1))
                b.master[s.offset:s.offset + s.numel].copy_(s.param.detach().reshape(-1))
                s.param.data = view.view(s.param.shape)
            b.exp_avg = torch.zeros(b.numel, dtype=self.moment_dtype)
            b.exp_avg_sq = torch.zeros(b.numel, dtype=self.moment_dtype)
            b.landing = self.dev.host_buffer(b.numel, b.dtype)
            b.acc = torch.empty(b.numel, dtype=torch.float32) if self.accumulation_steps > 1 else None
        self.dev.synchronize()

    # ---- job sequencing ---------------------------------------------------------------------
    def _submit(self, job) -> int:
        with self._seq_lock:
            self._submitted += 1
            seq = self._submitted

        def run() -> None:
            try:
                job()
            finally:
                with self._seq_lock:
                    self._done = seq
                    self._seq_lock.notify_all()

        self.worker.submit(run)
        return seq

    def _wait_seq(self, seq: int) -> None:
        with self._seq_lock:
            while self._done < seq:
                if self.worker.failed:
                    break
                self._seq_lock.wait(0.05)
        self.worker.raise_if_failed()

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
        self._in_backward = True
        torch.autograd.Variable._execution_engine.queue_callback(self._end_backward)

    def _on_grad(self, p: torch.nn.Parameter) -> None:
        s: Slot = p._ramstream_slot
        self._check_device(p)
        task = torch._C._current_graph_task_id()
        if self._in_backward and task != self._task:
            self._abandon_backward()
        if not self._in_backward:
            self._begin_backward()
            self._task = task
        b = s.bucket
        if p.dtype != b.dtype or p.data_ptr() != b.device_flat.data_ptr() + s.offset * p.element_size():
            raise RuntimeError("ramstream: parameters were replaced or converted after wrap() "
                               "without the engine seeing it; call model.to(...) on the wrapped "
                               "model itself (it rebinds the engine) or wrap() again")
        if b.micro_arrivals == 0 and not b.pending_landing_checked:
            self._wait_seq(b.landing_seq)           # the engine has finished reading the landing
            self.dev.wait_landing_reusable(b.h2d_event)
            b.pending_landing_checked = True
        g = p.grad
        if g is None:
            return
        if s.direct or self.dev.type == "cpu":
            self.dev.grad_to_host(b.landing[s.offset:s.offset + s.numel], g)
        else:
            if b.staging is None:
                b.staging = self.dev.staging(b.numel - b.small_lo, b.dtype)
            lo = s.offset - b.small_lo
            self.dev.gather_on_device(b.staging[lo:lo + s.numel], g)
        p.grad = None
        s.arrivals += 1
        s.micro_arrived = True
        b.micro_arrivals += 1
        b.micro_list.append(s)
        if all(x.micro_arrived for x in b.slots if x.expected):
            self._flush_bucket(b)

    def _flush_bucket(self, b: Bucket) -> None:
        """Queues the engine job for the slots of b that arrived since the last flush."""
        slots, b.micro_list = b.micro_list, []
        if not slots:
            return
        if b.staging is not None:
            small = [s for s in slots if not s.direct]
            if len(small) == sum(1 for s in b.slots if not s.direct):
                self.dev.flush_to_host(b.landing[b.small_lo:], b.staging)
            else:  # a partial flush must not overwrite ranges that landed earlier
                for s in small:
                    lo = s.offset - b.small_lo
                    self.dev.flush_to_host(b.landing[s.offset:s.offset + s.numel],
                                           b.staging[lo:lo + s.numel])
            b.staging = None
        ev = self.dev.record_d2h()
        nbytes = sum(s.numel for s in slots) * b.landing.element_size()
        self.stats["bytes_d2h"] += nbytes
        accumulate = self.accumulation_steps > 1
        pieces = [Piece(s.offset, s.numel, s.group, s.step + 1, s.arrivals == 1) for s in slots]
        final = self._micro == self.accumulation_steps - 1
        eager = final and self.max_grad_norm is None
        want_norm = final and self.max_grad_norm is not None
        hypers = self._hypers() if eager else None
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
                self._update_and_send(b, pieces, hypers, 1.0, accumulate)

        seq = self._submit(job)
        b.landing_seq = seq
        if eager:
            b.update_seq = seq

    def _abandon_backward(self) -> None:
        """The previous backward pass failed before its end: its unqueued gradients are dropped
        (buckets already queued were processed; nothing else is half-done)."""
        dropped = 0
        for b in self.buckets:
            for s in b.micro_list:
                s.arrivals -= 1
                dropped += 1
            b.micro_list = []
            b.staging = None
        self.log(f"a backward pass ended without finishing; {dropped} unqueued gradients dropped")
        self._end_backward()
        self._micro -= 1

    def _end_backward(self) -> None:
        for b in self.buckets:
            if b.micro_list:
                self._flush_bucket(b)
            b.micro_arrivals = 0
            b.pending_landing_checked = False
            for s in b.slots:
                s.micro_arrived = False
        self._micro += 1
        self._in_backward = False

    # ---- updates ------------------------------------------------------------------------------
    def _hypers(self) -> list[Hyper]:
        out = []
        for i, g in enumerate(self.param_groups):
            lr, (b1, b2), eps, wd = g["lr"], g["betas"], g["eps"], g["weight_decay"]
            lr = float(lr.item() if torch.is_tensor(lr) else lr)
            bad = [(n, v) for n, v, ok in (
                ("lr", lr, math.isfinite(lr) and lr >= 0),
                ("betas[0]", b1, math.isfinite(b1) and 0 <= b1 < 1),
                ("betas[1]", b2, math.isfinite(b2) and 0 <= b2 < 1),
                ("eps", eps, math.isfinite(eps) and eps > 0),
                ("weight_decay", wd, math.isfinite(wd) and wd >= 0)) if not ok]
            if bad:
                n, v = bad[0]
                raise ValueError(f"ramstream: param_groups[{i}]['{n}'] = {v!r} is invalid")
            out.append(Hyper(lr, float(b1), float(b2), float(eps), float(wd)))
        return out

    def _mark_pending(self, b: Bucket) -> None:
        if not b.pending:
            b.pending = True
            _guard._pending[0] += 1

    def _update_and_send(self, b: Bucket, pieces, hypers, grad_scale: float, accumulate: bool):
        t0 = time.perf_counter()
        out = b.device_flat if self.dev.type == "cpu" else b.landing
        ranges = update(b, pieces, hypers, grad_scale, accumulate, out, self.seed)
        self.stats["host_update_s"] += time.perf_counter() - t0
        if self.dev.type != "cpu":
            for start, n in ranges:
                self.dev.weights_to_device(b.device_flat[start:start + n], b.landing[start:start + n])
                self.stats["bytes_h2d"] += n * b.landing.element_size()
        b.h2d_event = self.dev.record_h2d()

    def step(self) -> None:
        """Queues every update not yet queued; returns without waiting for them."""
        if self._in_backward and torch._C._current_graph_task_id() == -1:
            self._abandon_backward()      # the last backward raised before its end
        if self._in_backward:
            raise RuntimeError("ramstream: optimizer.step() called during backward")
        self.worker.raise_if_failed()
        for s in self.slots:
            self._check_device(s.param)
        todo = [s for s in self.slots if s.arrivals > 0 and not s.updated]
        if todo:
            hypers = self._hypers()
            accumulate = self.accumulation_steps > 1
            clip = [1.0]
            if self.max_grad_norm is not None:
                max_norm = self.max_grad_norm

                def norm_job() -> None:
                    total = math.sqrt(sum(b.sq_norm for b in self.buckets))
                    for b in self.buckets:
                        b.sq_norm = 0.0
                    clip[0] = clip_coefficient(max_norm, total)
                    self.last_grad_norm = total

                self._submit(norm_job)
            by_bucket: dict[int, list] = {}
            for s in todo:
                by_bucket.setdefault(s.bucket.index, []).append(s)
            for bi in sorted(by_bucket):
                b = self.buckets[bi]
                pieces = [Piece(s.offset, s.numel, s.group, s.step + 1, False) for s in by_bucket[bi]]
                for s in by_bucket[bi]:
                    s.step += 1
                self._mark_pending(b)
                b.update_seq = self._submit(
                    lambda b=b, pieces=pieces: self._update_and_send(b, pieces, hypers, clip[0],
                                                                     accumulate))
                b.landing_seq = b.update_seq
        for s in self.slots:
            if s.arrivals == 0 and s.expected and self._micro > 0:
                s.expected = False      # it got no gradient this step: don't wait for it
            elif s.arrivals > 0:
                s.expected = True
            s.arrivals = 0
            s.updated = False
        self._micro = 0
        self.stats["steps"] += 1

    # ---- waits --------------------------------------------------------------------------------
    def wait_bucket(self, b: Bucket) -> None:
        """Blocks until b's new weights are usable by work queued after this call."""
        if not b.pending:
            return
        t0 = time.perf_counter()
        self._wait_seq(b.update_seq)
        self.dev.device_wait(b.h2d_event)
        b.pending = False
        _guard._pending[0] -= 1
        self.stats["wait_s"] += time.perf_counter() - t0
        self.stats["waits"] += 1

    def synchronize(self) -> None:
        """Waits for every queued job and copy; afterwards the model's weights are current."""
        self.worker.drain()
        for b in self.buckets:
            self.wait_bucket(b)
        self.dev.synchronize()

    def attach_forward_waits(self, model: torch.nn.Module) -> None:
        """Forward pre-hooks: a module waits only for the buckets of its own parameters."""
        self._names = {n: p._ramstream_slot for n, p in model.named_parameters()
                       if hasattr(p, "_ramstream_slot")}
        for m in model.modules():
            own = [p for p in m.parameters(recurse=False) if hasattr(p, "_ramstream_slot")]
            buckets = sorted({p._ramstream_slot.bucket.index for p in own
                              if p._ramstream_slot.bucket is not None})
            if not buckets:
                continue
            bl = [self.buckets[i] for i in buckets]

            def pre_hook(module, args, bl=bl):
                for b in bl:
                    if b.pending:
                        self.wait_bucket(b)

            self._module_hooks.append(m.register_forward_pre_hook(pre_hook))
        self.forward_waits = True

    def _adopt_replaced(self, model: torch.nn.Module) -> None:
        """Module._apply replaces a Parameter object (rather than its .data) when the new tensor
        is of another kind (e.g. meta): move the slot, its hook and its guard to the new one."""
        names = self._names
        for name, p in model.named_parameters():
            s = names.get(name)
            if s is None or p is s.param:
                continue
            old = s.param
            idx = self.slots.index(s)
            self._hooks[idx].remove()
            _guard.unguard(old)
            s.param = p
            p._ramstream_slot, s.engine_wait = s, self.wait_bucket
            self._hooks[idx] = p.register_post_accumulate_grad_hook(self._on_grad)
            if self.guard_params:
                _guard.guard(p)
            for g in self.param_groups:
                g["params"] = [p if q is old else q for q in g["params"]]

    def rebind(self, model: torch.nn.Module | None = None) -> None:
        """After model.to()/.half()/...: parameters on the engine's device are re-pointed at
        fresh flat buffers of their (possibly new) dtype, filled from the fp32 masters, so a
        conversion never rounds the masters. Parameters left on another device make the next
        backward or step() raise."""
        self.synchronize()
        if model is not None:
            self._adopt_replaced(model)
        for b in self.buckets:
            devices = {s.param.device for s in b.slots}
            if devices != {self.device}:
                continue
            dtypes = {s.param.dtype for s in b.slots}
            if len(dtypes) != 1:
                raise RuntimeError(f"ramstream: parameters of one bucket were converted to "
                                   f"different dtypes {sorted(map(str, dtypes))}")
            dtype = dtypes.pop()
            self._check_device(b.slots[0].param)
            if dtype != b.dtype:
                b.dtype = dtype
                b.landing = self.dev.host_buffer(b.numel, dtype)
                self.log(f"bucket {b.index}: working dtype now {dtype} (fp32 master kept)")
            b.device_flat = torch.empty(b.numel, dtype=dtype, device=self.device)
            b.device_flat.copy_(b.master)
            b.h2d_event = None
            for s in b.slots:
                s.param.data = b.device_flat[s.offset:s.offset + s.numel].view(s.param.shape)
        self.dev.synchronize()

    def resync_masters(self) -> None:
        """After weights were loaded into the model: masters take the loaded values wherever
        the working copy no longer equals master.to(working dtype)."""
        self.synchronize()
        for b in self.buckets:
            if not torch.equal(b.device_flat, b.master.to(b.device_flat.device, b.dtype)):
                b.master.copy_(b.device_flat)
                self.log(f"bucket {b.index}: fp32 master reloaded from the model's weights")

    def close(self) -> None:
        """Waits for everything, removes hooks and guards; parameters keep their current data."""
        if self.closed:
            return
        self.synchronize()
        for h in self._hooks + self._module_hooks:
            h.remove()
        for s in self.slots:
            _guard.unguard(s.param)
            for attr in ("_ramstream_slot",):
                if hasattr(s.param, attr):
                    delattr(s.param, attr)
        self.worker.close()
        self.closed = True


def clip_coefficient(max_norm: float, total_norm: float) -> float:
    """torch.nn.utils.clip_grad_norm_'s factor, in float32 as torch computes it."""
    t = torch.tensor(total_norm, dtype=torch.float32)
    coef = torch.tensor(max_norm, dtype=torch.float32) / (t + 1e-6)
    return float(torch.clamp(coef, max=1.0))
