"""The offload engine: a thin composition of parts that own their state.

One gradient's way, file by file (docs/architecture.md tells it in full):
  intake.py    the gradient hook: throttle, copy (or gather) into the bucket's pinned landing
               buffer; a complete bucket is flushed and handed to
  updater.py   which queues the engine-thread job (host_jobs.py: land, accumulate, norm, AdamW)
               or the GPU update of a mapped bucket (gpu_updates.py), and hands the new weights
  weights.py   back to the device (H2D), where the next forward's pre-hooks wait for them.
parallel.py / distributed.py: the strategy (single process, data parallel) every part calls;
layout.py places the buckets' tensors; devices.py copies; worker.py is the engine thread.
Engine builds the parts, runs step(), and keeps them right when the model changes.
"""

from __future__ import annotations

import weakref

import torch

from .._faults import fault_point
from . import guard as _guard
from . import layout
from .buckets import GPU_UPDATED, Bucket, Slot, build_buckets
from .devices import check_param, make_device
from .host_jobs import Hyper
from .intake import GradientIntake, InFlight, _weak_method
from .nonfinite import NonFiniteGradientError, describe, slot_name, warn_caller
from .parallel import make_strategy
from .updater import NonFinite, Updater
from .weights import WeightReturn
from .worker import Worker


class Engine:
    def __init__(
        self,
        param_groups: list[dict],
        *,
        device: torch.device,
        moment_dtype: torch.dtype,
        max_grad_norm: float | None,
        accumulation_steps: int,
        bucket_bytes: int,
        guard_params: bool,
        order: list | None = None,
        seed: int = 0,
        log=None,
        mapped_fraction: float = 0.0,
        max_inflight_bytes: int | None = None,
        distributed: bool = False,
        eager_updates: bool = True,
        streamed: dict | None = None,
        skip_nonfinite: bool = False,
        delayed_update: int | None = None,
        block_of: dict | None = None,
        nvme_dir: str | None = None,
        nvme_share: float = 0.0,
        device_state: bool = False,
    ) -> None:
        """streamed: {id(parameter): block index} of the parameters whose weights live in
        pinned host memory and visit the device only while their block runs (weights/).
        skip_nonfinite: a step whose global gradient norm is not finite is skipped with a
        warning (True) or raises NonFiniteGradientError (False); both apply no update.
        delayed_update: None (off) or the number of undelayed warm-up steps (delayed.py): the
        host-updated buckets' updates are delayed, GPU-updated ones ("mapped": mapped_fraction;
        "device" after a relocate) are not; data parallel is refused.
        block_of: {id(parameter): block index} of the blocks' own parameters: no bucket spans two
        blocks, so that a block can start streaming between steps (restream.py); None: buckets
        break only between streamed blocks and the rest.
        nvme_dir, nvme_share: that share (0..1] of the host-updated state's bytes, from the back of
        the stack, lives on disk in nvme_dir (disk_tier.py); host placement only, single process.
        device_state: every bucket's state starts in VRAM (placement "device": a resident plan,
        runtime/optimizer_split.py state_starts_on_device); CUDA, one process, nothing streamed,
        no disk tier, no delayed update."""
        self.param_groups = param_groups
        self.skip_nonfinite = skip_nonfinite
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
        if device_state and (
            self.dev.type != "cuda" or distributed or streamed or nvme_share > 0 or delayed_update is not None
        ):
            raise ValueError(
                "ramstream: device_state=True needs a CUDA device, one process, no streamed weights, "
                "no nvme_offload and no delayed_update"
            )
        self.slots, self.frozen = self._make_slots(param_groups, order)
        self.streamed = dict(streamed or {})
        self.block_of = dict(block_of or {})
        for s in self.slots:
            s.streamed = id(s.param) in self.streamed
            if not s.streamed:
                self.check_param(s.param)
        self.buckets = self._make_buckets(bucket_bytes)
        self.copier = None
        if any(s.streamed for s in self.slots):
            from ..weights.slab import make_copier

            self.copier = make_copier(device)
        self.worker = Worker("ramstream-engine", on_start=self.dev.bind_thread)
        # a dropped optimizer does not leak its thread; at interpreter exit the queued jobs finish
        # before finalization (a daemon thread inside a GIL-released kernel call when the
        # interpreter finalizes is killed as it retakes the GIL: std::terminate, an abort)
        weakref.finalize(self, self.worker.close)
        self.parallel = make_strategy(
            distributed,
            buckets=self.buckets,
            dev=self.dev,
            wait_job=self.worker.wait,
            mapped_fraction=mapped_fraction,
        )
        self.disk = None
        disk_buckets: set[int] = set()
        if nvme_share > 0:
            if distributed:
                raise ValueError("ramstream: nvme_offload is not supported under data parallel yet")
            if mapped_fraction > 0:
                raise ValueError("ramstream: nvme_offload needs the host AdamW (optimizer_mode='cpu')")
            from .disk_tier import DiskTier, choose_disk_buckets

            chosen = choose_disk_buckets(self.buckets, nvme_share, moment_dtype)
            disk_buckets = {b.index for b in chosen}
            if chosen:  # opened before anything is allocated: a full disk changes nothing
                self.disk = DiskTier(chosen, nvme_dir, moment_dtype=moment_dtype, log=self.log)
        total = sum(b.numel for b in self.buckets)
        mapped = 0
        for b in self.buckets:  # the first buckets in forward order go to the GPU kernel
            use_gpu = mapped_fraction > 0 and mapped + b.numel / 2 <= mapped_fraction * total
            use_gpu = use_gpu and not b.streamed  # streamed weights are updated on the host
            where = "device" if device_state else "mapped" if use_gpu else "host"
            layout.allocate(self, b, where, owned=self.parallel.owns(b))
            mapped += b.numel if use_gpu else 0
            if b.index in disk_buckets:
                self.disk.adopt(b)  # written to its record, freed from RAM
        if self.disk is not None:
            self.log(
                f"nvme: optimizer state of {len(disk_buckets)} buckets ({self.disk.state_bytes} bytes) "
                f"on disk in {nvme_dir} ({'direct' if self.disk.store.direct else 'buffered'} I/O)"
            )
        self.mapped_numel = mapped
        self.delayed = None
        if delayed_update is not None:
            if distributed:
                raise NotImplementedError("ramstream: delayed_update is not supported under data parallel")
            from .delayed import Delayed

            self.delayed = Delayed(delayed_update, dev=self.dev, worker=self.worker, weights=None, stats=None)
            for b in self.buckets:
                self.delayed.allocate(b)
        self.max_inflight_bytes = max_inflight_bytes
        self.stats = {
            "steps": 0,
            "bytes_d2h": 0,
            "bytes_h2d": 0,
            "host_update_s": 0.0,
            "host_updated_numel": 0,  # elements the host AdamW updated (with host_update_s: its rate)
            "host_land_s": 0.0,
            "wait_s": 0.0,
            "waits": 0,
            "gpu_updates": 0,
            "throttle_s": 0.0,
            "grad_hook_calls": 0,
            "eager_updates": 0,
            "skipped_steps": 0,  # steps whose gradients were not finite (no update applied)
            "delayed_steps": 0,  # steps whose update the next step's forward did not wait for
            "delayed_installs": 0,  # times delayed updates were installed (step(), synchronize())
        }
        # the parts, in the order a gradient meets them (each one's state is its own); none
        # holds the engine: hooks reach it weakly, so a dropped optimizer is freed
        inflight = InFlight(max_inflight_bytes, self.stats)
        self.weights = WeightReturn(
            buckets=self.buckets,
            dev=self.dev,
            parallel=self.parallel,
            wait_job=self.worker.wait,
            stats=self.stats,
        )
        self.updater = Updater(
            buckets=self.buckets,
            dev=self.dev,
            device=device,
            parallel=self.parallel,
            weights=self.weights,
            inflight=inflight,
            worker=self.worker,
            hypers=_weak_method(self, "_hypers"),
            stats=self.stats,
            seed=seed,
            accumulation_steps=accumulation_steps,
            max_grad_norm=max_grad_norm,
            eager_updates=eager_updates,
        )
        if self.delayed is not None:
            self.delayed.weights, self.delayed.stats = self.weights, self.stats
            self.updater.delay = self.delayed
        self.updater.disk = self.disk
        self.intake = GradientIntake(
            slots=self.slots,
            frozen=self.frozen,
            buckets=self.buckets,
            dev=self.dev,
            device=device,
            parallel=self.parallel,
            updater=self.updater,
            weights=self.weights,
            inflight=inflight,
            stats=self.stats,
            accumulation_steps=accumulation_steps,
            max_grad_norm=max_grad_norm,
            log=self.log,
        )
        self._weak_wait = _weak_method(self, "wait_bucket")
        self.forward_waits = False
        self.names: dict[str, Slot] = {}
        self.closed = False
        self._loading: dict = {}  # slot -> fp32 tensor model.load_state_dict() loads
        for s in self.slots:
            s.param._ramstream_slot = s
            s.engine_wait = self._weak_wait
            if guard_params:
                _guard.guard(s.param)

    @property
    def dp(self):
        """The data-parallel strategy (distributed.py), None in a single process."""
        return self.parallel if self.parallel.distributed else None

    @property
    def on_abandon(self) -> list:
        """Callables run once a backward pass that raised has been dropped (the activation
        offloader frees the failed graph's paged buffers there)."""
        return self.intake.on_abandon

    @property
    def last_grad_norm(self) -> float | None:
        """The global gradient norm of the last clipped step (max_grad_norm)."""
        return self.updater.last_grad_norm

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
                    raise ValueError("ramstream: a parameter appears twice in the optimizer's param_groups")
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
        block = lambda s: self.streamed.get(id(s.param))  # noqa: E731
        part = lambda s: (block(s), self.block_of.get(id(s.param)))  # noqa: E731
        for s in self.slots:  # a bucket holds one working dtype, and one streamed block or none
            if run and (s.param.dtype != run[-1].param.dtype or part(s) != part(run[-1])):
                out += build_buckets(run, bucket_bytes, run[0].param.element_size())
                run = []
            run.append(s)
        if run:
            out += build_buckets(run, bucket_bytes, run[0].param.element_size())
        offset = 0
        for i, b in enumerate(out):
            b.streamed = block(b.slots[0]) is not None
            b.index, b.state_offset = i, offset
            offset += b.numel
        return out

    def check_param(self, p: torch.nn.Parameter) -> None:
        check_param(p, self.device)

    def replace_param(self, s: Slot, p: torch.nn.Parameter) -> None:
        old = s.param
        self.intake.rehook(s, p)
        _guard.unguard(old)
        s.param = p
        p._ramstream_slot, s.engine_wait = s, self._weak_wait
        if self.guard_params:
            _guard.guard(p)
        for g in self.param_groups:
            g["params"] = [p if q is old else q for q in g["params"]]

    # ---- the step -------------------------------------------------------------------------------
    def _hypers(self) -> list[Hyper]:
        from ..ops._adamw_rules import check_group

        return [Hyper(*check_group("ramstream", g, i)) for i, g in enumerate(self.param_groups)]

    def step(self) -> bool:
        """Queues every update not yet queued; returns without waiting for host updates. False
        when the step was skipped (non-finite gradients, skip_nonfinite). With delayed_update the
        previous step's delayed update is installed first (delayed.py)."""
        self.recover_if_abandoned()
        if self.intake.in_backward:
            raise RuntimeError("ramstream: optimizer.step() called during backward")
        fault_point("step.begin")
        self.updater.raise_if_failed()
        if self.delayed is not None:
            self.delayed.install()  # update t-1's weights, before update t is queued
        for s in self.slots:
            if not s.streamed:
                self.check_param(s.param)
        todo = [s for s in self.slots if s.arrivals > 0 and not s.updated]
        delayed = self.updater.delaying()
        stepped = sorted({s.bucket.index for s in self.slots if s.arrivals > 0})
        if todo:
            try:
                self.updater.step(todo, self.intake.micro)
            except NonFinite as nf:
                return self._skip_nonfinite(nf, todo)
        self.weights.broadcast([self.buckets[bi] for bi in stepped])
        self.intake.end_step()
        self.updater.clip_now = None
        self.stats["steps"] += 1
        self.stats["delayed_steps"] += bool(delayed and todo)
        if self.disk is not None:
            self.disk.end_step()
            self.disk.raise_if_failed()  # a write-back failed: the step is taken, its state kept
        return True

    def _skip_nonfinite(self, nf: NonFinite, todo: list) -> bool:
        """The global norm of this step's gradients is NaN or Inf and nothing was queued: the
        gradients are dropped (a mapped slot's wait in .grad), every slot is ready for the next
        step, and the step is skipped with a warning (skip_nonfinite) or raises
        NonFiniteGradientError. Returns False (no update applied)."""
        clip = self.updater.clip_now
        for s in todo:
            if s.bucket.placement in GPU_UPDATED:
                s.param.grad = None
        self.updater.discard()
        self.intake.end_step()
        self.stats["skipped_steps"] += 1
        names = [slot_name(self.names, s) for s in nf.slots]
        step = self.stats["steps"] + 1
        limit = (
            f"clip_grad_norm_({clip[0]:g})" if clip is not None else f"max_grad_norm={self.max_grad_norm:g}"
        )
        msg = describe(nf.norm, names, step, limit, self.skip_nonfinite)
        self.log(msg)
        if not self.skip_nonfinite:
            raise NonFiniteGradientError(msg, norm=nf.norm, parameters=names, step=step)
        warn_caller(msg)
        return False

    def recover_if_abandoned(self) -> None:
        """Outside a backward pass, a pass still marked as running raised before its end."""
        self.intake.recover_if_abandoned()

    def discard_if_gathered(self) -> None:
        """zero_grad() between backward and step(): drops what was gathered since the step."""
        self.intake.discard_if_gathered()

    # ---- waits --------------------------------------------------------------------------------
    def wait_bucket(self, b: Bucket) -> None:
        """Blocks until b's new weights are usable by work queued after this call."""
        self.weights.wait(b)

    def synchronize(self) -> None:
        """Waits for every queued job and copy; afterwards the model's weights are current."""
        self.recover_if_abandoned()
        self.updater.drain()
        if self.delayed is not None:
            self.delayed.install()
        if self.disk is not None:
            self.disk.flush()  # every write-back ended: the state is on disk (or kept, dirty)
            self.disk.raise_if_failed()
        for b in self.buckets:
            self.weights.wait(b)
        self.dev.synchronize()

    def attach_forward_waits(self, model: torch.nn.Module) -> None:
        """Forward pre-hooks: a module waits only for the buckets of its own parameters."""
        self.names = {
            n: p._ramstream_slot
            for n, p in model.named_parameters(remove_duplicate=False)
            if hasattr(p, "_ramstream_slot")
        }
        frozen = {id(p) for p in self.frozen}
        self.intake.frozen_names = {id(p): n for n, p in model.named_parameters() if id(p) in frozen}
        self.weights.attach_forward_waits(model, self.wait_bucket)
        self.forward_waits = True

    # ---- model changes --------------------------------------------------------------------------
    def before_apply(self) -> None:
        self.synchronize()
        layout.snapshot_masters(self)

    def rebind(self, model: torch.nn.Module | None = None) -> None:
        self.synchronize()
        layout.rebind(self, model)
        # data parallel: only owners hold masters, the others take their weights
        if self.weights.broadcast(self.buckets):
            self.synchronize()

    def note_loading(self, state_dict: dict, prefix: str) -> None:
        """model.load_state_dict() is about to run: keep the fp32 tensors it loads into
        low-precision parameters, so that they become the masters exactly (not their rounding)."""
        self._loading = {}
        for name, s in self.names.items():
            v = state_dict.get(prefix + name)
            if (
                torch.is_tensor(v)
                and v.dtype == torch.float32
                and s.bucket.dtype != torch.float32
                and v.numel() == s.numel
            ):
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
        try:
            self.synchronize()
        except BaseException:
            if self.disk is not None:
                self.disk.close()
            raise
        self.intake.close()
        self.weights.close()
        for s in self.slots:
            _guard.unguard(s.param)
            if hasattr(s.param, "_ramstream_slot"):
                del s.param._ramstream_slot
        self.updater.close()
        self.parallel.close()
        if self.disk is not None:
            self.disk.close()  # its file is removed
        self.closed = True
