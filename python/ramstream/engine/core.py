"""The offload engine: gradient hooks, the per-step state machine, forward waits.

Training thread                                   engine thread (Worker)
  backward: post-accumulate-grad hook per param     wait D2H event -> accumulate / norm
    host bucket: copy grad to its landing buffer     -> AdamW (as soon as a bucket is complete,
    mapped bucket: launch the CUDA update            unless clipping needs the global norm)
    -> drop the device grad                          -> H2D of the new weights, in forward order
  step(): queue what is left (clipping: the global norm first, then the updates)
  forward: pre-hooks wait only for the buckets the module reads
backward.py holds the gradient hooks; layout.py the placements; host_jobs.py the host work;
devices.py the copies; distributed.py data parallel; resident.py the offload="auto" switch.
"""
from __future__ import annotations

import collections
import math
import time
import weakref

import torch

from .._faults import fault_point
from . import guard as _guard
from . import layout
from .buckets import Bucket, Slot, build_buckets
from .devices import make_device
from .backward import BackwardHooks
from .gpu_updates import dev_norm_add, launch_mapped
from .host_jobs import Hyper, Piece, add_sq_norm, update
from .worker import Worker


class Engine(BackwardHooks):
    def __init__(self, param_groups: list[dict], *, device: torch.device, moment_dtype: torch.dtype,
                 max_grad_norm: float | None, accumulation_steps: int, bucket_bytes: int,
                 guard_params: bool, order: list | None = None, seed: int = 0, log=None,
                 mapped_fraction: float = 0.0, max_inflight_bytes: int | None = None,
                 distributed: bool = False, eager_updates: bool = True) -> None:
        self.param_groups = param_groups
        self.eager_updates = eager_updates
        self.device = device
        self.moment_dtype = moment_dtype
        self.max_grad_norm = max_grad_norm
        self.accumulation_steps = accumulation_steps
        self.guard_params = guard_params
        self.seed = seed
        self.log = log or (lambda msg: None)
        self.dev = make_device(device)
        if mapped_fraction > 0 and self.dev.type != "cuda":
            raise ValueError("ramstream: optimizer_mode='gpu' needs a CUDA device")
        self.slots, self.frozen = self._make_slots(param_groups, order)
        for s in self.slots:
            self.check_param(s.param)
        self.buckets = self._make_buckets(bucket_bytes)
        self.dp = None
        if distributed:
            from .distributed import DataParallel

            if mapped_fraction > 0:
                raise ValueError("ramstream: data parallel runs the update on the host "
                                 "(optimizer_mode='cpu'); 'gpu' is not supported with it yet")
            self.dp = DataParallel(self)
            for s in self.slots:
                s.expected = s.param.requires_grad
        total = sum(b.numel for b in self.buckets)
        mapped = 0
        for b in self.buckets:      # the first buckets in forward order go to the GPU kernel
            use_gpu = mapped_fraction > 0 and mapped + b.numel / 2 <= mapped_fraction * total
            layout.allocate(self, b, "mapped" if use_gpu else "host",
                            owned=self.dp is None or self.dp.owns(b))
            mapped += b.numel if use_gpu else 0
        self.mapped_numel = mapped
        self.worker = Worker("ramstream-engine", on_start=self.dev.bind_thread)
        weakref.finalize(self, self.worker.stop)   # a dropped optimizer does not leak its thread
        if max_inflight_bytes is None and self.dev.type == "cuda":
            total = torch.cuda.get_device_properties(device).total_memory
            max_inflight_bytes = min(1 << 30, total // 10)
        self.max_inflight_bytes = max_inflight_bytes
        self._inflight: collections.deque = collections.deque()   # (event, bytes) in order
        self._inflight_bytes = 0
        self._in_backward = False
        self._task = -1
        self._micro = 0
        self._dp_next = -1                 # data parallel: the next bucket to reduce
        self._dev_norm = None
        self._bw_hypers = None
        # hooks hold the engine weakly: a tensor's hooks are reachable from C++, where Python's
        # garbage collector cannot see a cycle, so a strong reference would keep it alive forever
        self._weak_on_grad = _weak_method(self, "_on_grad")
        self._weak_wait = _weak_method(self, "wait_bucket")
        self._hooks = [_grad_hook(s.param, self._weak_on_grad) for s in self.slots]
        self._frozen_hooks = [_grad_hook(p, _weak_method(self, "_on_frozen_grad"))
                              for p in self.frozen]
        self._module_hooks: list = []
        self.forward_waits = False
        self.names: dict[str, Slot] = {}
        self.frozen_names: dict[int, str] = {}
        self.closed = False
        self.last_grad_norm: float | None = None
        self._clip_now = None              # (max_norm, norm, _micro): clip_grad_norm_ this step
        self._loading: dict = {}           # slot -> fp32 tensor model.load_state_dict() loads
        self.on_abandon: list = []         # called once a backward pass that raised is dropped
        self.stats = {"steps": 0, "bytes_d2h": 0, "bytes_h2d": 0, "host_update_s": 0.0,
                      "host_land_s": 0.0, "wait_s": 0.0, "waits": 0, "gpu_updates": 0,
                      "throttle_s": 0.0}
        for s in self.slots:
            s.param._ramstream_slot = s
            s.engine_wait = self._weak_wait
            if guard_params:
                _guard.guard(s.param)

    # ---- construction ---------------------------------------------------------------------
    @staticmethod
    def _make_slots(param_groups, order) -> tuple[list[Slot], list[torch.nn.Parameter]]:
        """(slots, frozen): a slot for every non-empty parameter that requires grad; those
        that do not (a LoRA model's frozen base, say) get no slot and no host state, keep their
        place in the state dict's numbering, and make a backward that reaches them raise."""
        slots: list[Slot] = []
        frozen: list[torch.nn.Parameter] = []
        seen: set[int] = set()
        index = 0
        for g, group in enumerate(param_groups):
            for p in group["params"]:
                if id(p) in seen:
                    raise ValueError("ramstream: a parameter appears twice in the optimizer's "
                                     "param_groups")
                seen.add(id(p))
                if not p.requires_grad:
                    frozen.append(p)
                elif p.numel() > 0:
                    slots.append(Slot(param=p, index=index, group=g, numel=p.numel()))
                index += 1
        if order:
            rank = {id(p): i for i, p in enumerate(order)}
            slots.sort(key=lambda s: rank.get(id(s.param), len(rank) + s.index))
        return slots, frozen

    def _make_buckets(self, bucket_bytes: int) -> list[Bucket]:
        out: list[Bucket] = []
        run: list[Slot] = []
        for s in self.slots:        # a bucket holds one working dtype
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

    def check_param(self, p: torch.nn.Parameter) -> None:
        if p.device != self.device:
            raise RuntimeError(
                f"ramstream: parameter of shape {tuple(p.shape)} is on {p.device} but the engine "
                f"runs on {self.device}; move the model back with model.to('{self.device}') (or "
                "unwrap() and wrap() again for another device)")
        if p.dtype not in (torch.float32, torch.bfloat16, torch.float16):
            raise TypeError(f"ramstream: parameters must be float32, bfloat16 or float16, got "
                            f"{p.dtype} (shape {tuple(p.shape)})")

    def _on_frozen_grad(self, p: torch.nn.Parameter) -> None:
        """A gradient reached a parameter that was frozen when the engine was built."""
        name = self.frozen_names.get(id(p), f"of shape {tuple(p.shape)}")
        raise RuntimeError(
            f"ramstream: parameter {name} got a gradient, but it had requires_grad=False when "
            "wrap() ran, so ramstream keeps no optimizer state for it (frozen parameters take no "
            "host RAM) and it would never be updated. Set requires_grad before wrap(), or call "
            "ramstream.unwrap(model), unfreeze it and wrap(model, optimizer) again (the "
            "optimizer's state carries over)")

    def replace_param(self, s: Slot, p: torch.nn.Parameter) -> None:
        old = s.param
        i = self.slots.index(s)
        self._hooks[i].remove()
        _guard.unguard(old)
        s.param = p
        p._ramstream_slot, s.engine_wait = s, self._weak_wait
        self._hooks[i] = _grad_hook(p, self._weak_on_grad)
        if self.guard_params:
            _guard.guard(p)
        for g in self.param_groups:
            g["params"] = [p if q is old else q for q in g["params"]]

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
        """Engine thread: AdamW on a host bucket's pieces, then the new weights to the device."""
        t0 = time.perf_counter()
        out = b.device_flat if self.dev.type == "cpu" else b.landing
        ranges = update(b, pieces, hypers, grad_scale, accumulate, out, self.seed)
        self.stats["host_update_s"] += time.perf_counter() - t0
        if self.dev.type != "cpu":
            for start, n in ranges:
                self.dev.weights_to_device(b.device_flat[start:start + n], b.landing[start:start + n])
                self.stats["bytes_h2d"] += n * b.landing.element_size()
        b.h2d_event = self.dev.record_h2d()

    def _throttle(self, nbytes: int) -> None:
        """Backward waits while gradients still crossing to the host (or waiting for their GPU
        update) would hold more than max_inflight_bytes of device memory."""
        if self.max_inflight_bytes is None:
            return
        while self._inflight and self._inflight_bytes + nbytes > self.max_inflight_bytes:
            ev, n = self._inflight.popleft()
            t0 = time.perf_counter()
            ev.synchronize()
            self.stats["throttle_s"] += time.perf_counter() - t0
            self._inflight_bytes -= n

    def _track(self, event, nbytes: int) -> None:
        if self.max_inflight_bytes is None or event is None:
            return
        self._inflight.append((event, nbytes))
        self._inflight_bytes += nbytes
        while self._inflight and self._inflight[0][0].query():
            self._inflight_bytes -= self._inflight.popleft()[1]

    def step(self) -> None:
        """Queues every update not yet queued; returns without waiting for host updates."""
        self.recover_if_abandoned()
        if self._in_backward:
            raise RuntimeError("ramstream: optimizer.step() called during backward")
        fault_point("step.begin")
        self.worker.raise_if_failed()
        for s in self.slots:
            self.check_param(s.param)
        todo = [s for s in self.slots if s.arrivals > 0 and not s.updated]
        stepped = sorted({s.bucket.index for s in self.slots if s.arrivals > 0})
        if todo:
            hypers = self._hypers()       # validated before anything is changed
            clip = self._clip_now
            if clip is not None and clip[2] != self._micro:
                raise RuntimeError("ramstream: a backward pass ran after clip_grad_norm_ and "
                                   "before step(); call clip_grad_norm_ after the last one")
            if clip is None and self.max_grad_norm is not None \
                    and self._micro < self.accumulation_steps:
                self._norms_now(todo)
            world = self.dp.world if self.dp is not None else 1
            grad_scale = (clip_coefficient(clip[0], clip[1]) if clip is not None
                          else self._clip_coefficient() if self.max_grad_norm is not None
                          else 1.0) / world
            accumulate = self.accumulation_steps > 1
            fault_point("step.updates")   # the last point before the first update is queued
            by_bucket: dict[int, list[Slot]] = {}
            for s in todo:
                by_bucket.setdefault(s.bucket.index, []).append(s)
            for bi in sorted(by_bucket):
                b, slots = self.buckets[bi], by_bucket[bi]
                for s in slots:
                    s.step += 1
                if self.dp is not None and not self.dp.owns(b):
                    continue
                if b.placement == "mapped":
                    launch_mapped(self, b, slots, hyper_of=lambda g: hypers[g],
                                  grad_scale=grad_scale)
                    continue
                pieces = [Piece(s.offset, s.numel, s.group, s.step, False) for s in slots]
                self._mark_pending(b)
                seq = self.worker.submit(
                    lambda b=b, pieces=pieces: self._update_and_send(b, pieces, hypers, grad_scale,
                                                                     accumulate),
                    priority=b.index, deps=(b.last_seq,))
                b.last_seq = b.update_seq = b.landing_seq = seq
        if self.dp is not None:
            for bi in stepped:            # the same buckets, in the same order, on every rank
                self._mark_pending(self.buckets[bi])
                self.dp.broadcast_after_update(self.buckets[bi])
        for s in self.slots:
            if s.arrivals == 0 and s.expected and self._micro > 0:
                s.expected = False      # it got no gradient this step: don't wait for it
            elif s.arrivals > 0:
                s.expected = True
            s.arrivals = 0
            s.updated = False
        self._micro = 0
        self._clip_now = None
        self.stats["steps"] += 1

    def _norms_now(self, todo: list[Slot]) -> None:
        """step() after fewer backward passes than accumulation_steps (the end of an epoch,
        say): the squared norms, otherwise taken in the last micro-batch, of what was summed."""
        by_bucket: dict[int, list[Piece]] = {}
        for s in todo:
            if s.bucket.placement == "mapped":
                dev_norm_add(self, s.param.grad)    # its gradients wait in .grad
            elif self.dp is None or self.dp.owns(s.bucket):
                by_bucket.setdefault(s.bucket.index, []).append(
                    Piece(s.offset, s.numel, s.group, s.step, False))
        for bi, pieces in by_bucket.items():
            b = self.buckets[bi]
            seq = self.worker.submit(lambda b=b, pieces=pieces: add_sq_norm(b, pieces, b.acc),
                                     priority=b.index, deps=(b.last_seq,))
            b.last_seq = b.landing_seq = seq

    def _clip_coefficient(self) -> float:
        """clip_grad_norm_'s factor for max_grad_norm and the global norm (_total_norm)."""
        return clip_coefficient(self.max_grad_norm, self._total_norm())

    def _total_norm(self) -> float:
        """Waits for every gradient's squared norm (host buckets: computed as they landed;
        mapped ones: on the GPU) and returns the global L2 norm (consumed: set to zero)."""
        total = 0.0
        for b in self.buckets:
            if b.placement == "host" and (self.dp is None or self.dp.owns(b)):
                self.worker.wait(b.landing_seq)
                total += b.sq_norm
                b.sq_norm = 0.0
        if self._dev_norm is not None:
            self.dev.upd.synchronize()
            total += float(self._dev_norm.item())
            self._dev_norm.zero_()
        if self.dp is not None:           # the norm of the averaged gradient
            total = self.dp.all_reduce_scalar(total) / self.dp.world ** 2
        self.last_grad_norm = math.sqrt(total)
        return self.last_grad_norm

    # ---- waits --------------------------------------------------------------------------------
    def wait_bucket(self, b: Bucket) -> None:
        """Blocks until b's new weights are usable by work queued after this call."""
        if not b.pending:
            return
        t0 = time.perf_counter()
        if self.dp is not None:
            self.dp.wait(b)
        elif b.placement == "host":
            self.worker.wait(b.update_seq)
            self.dev.device_wait(b.h2d_event)
        else:
            self.dev.device_wait(b.h2d_event)
        b.pending = False
        _guard._pending[0] -= 1
        self.stats["wait_s"] += time.perf_counter() - t0
        self.stats["waits"] += 1

    def synchronize(self) -> None:
        """Waits for every queued job and copy; afterwards the model's weights are current."""
        self.recover_if_abandoned()
        self.worker.drain()
        for b in self.buckets:
            self.wait_bucket(b)
        self.dev.synchronize()

    def attach_forward_waits(self, model: torch.nn.Module) -> None:
        """Forward pre-hooks: a module waits only for the buckets of its own parameters."""
        self.names = {n: p._ramstream_slot for n, p in model.named_parameters(
                      remove_duplicate=False) if hasattr(p, "_ramstream_slot")}
        frozen = {id(p) for p in self.frozen}
        self.frozen_names = {id(p): n for n, p in model.named_parameters() if id(p) in frozen}
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
                        self.wait_bucket(b)

            self._module_hooks.append(m.register_forward_pre_hook(pre_hook))
        self.forward_waits = True

    # ---- model changes --------------------------------------------------------------------------
    def before_apply(self) -> None:
        self.synchronize()
        layout.snapshot_masters(self)

    def rebind(self, model: torch.nn.Module | None = None) -> None:
        self.synchronize()
        layout.rebind(self, model)
        if self.dp is not None:   # only owners hold masters: the others take their weights
            for b in self.buckets:
                self._mark_pending(b)
                self.dp.broadcast_after_update(b)
            self.synchronize()

    def note_loading(self, state_dict: dict, prefix: str) -> None:
        """model.load_state_dict() is about to run: keep the fp32 tensors it loads into
        low-precision parameters, so that they become the masters exactly (not their rounding)."""
        self._loading = {}
        for name, s in self.names.items():
            v = state_dict.get(prefix + name)
            if torch.is_tensor(v) and v.dtype == torch.float32 and s.bucket.dtype != torch.float32 \
                    and v.numel() == s.numel:
                self._loading[s] = v

    def resync_masters(self, model: torch.nn.Module | None = None) -> None:
        self.synchronize()
        if model is not None:
            layout.adopt_loaded(self, model)
        loaded, self._loading = self._loading, {}
        layout.resync_masters(self, loaded)

    def close(self) -> None:
        """Waits for everything, removes hooks and guards; parameters keep their current data."""
        if self.closed:
            return
        self.synchronize()
        for h in self._hooks + self._frozen_hooks + self._module_hooks:
            h.remove()
        for s in self.slots:
            _guard.unguard(s.param)
            if hasattr(s.param, "_ramstream_slot"):
                del s.param._ramstream_slot
        self.worker.close()
        if self.dp is not None:
            self.dp.close()
        self.closed = True


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
    """A function calling obj.name(...) while obj lives (a no-op afterwards)."""
    ref = weakref.ref(obj)

    def call(*args):
        o = ref()
        if o is not None:
            return getattr(o, name)(*args)
        return None

    return call


def clip_coefficient(max_norm: float, total_norm: float) -> float:
    """torch.nn.utils.clip_grad_norm_'s factor, in float32 as torch computes it."""
    t = torch.tensor(total_norm, dtype=torch.float32)
    coef = torch.tensor(max_norm, dtype=torch.float32) / (t + 1e-6)
    return float(torch.clamp(coef, max=1.0))
