"""OffloadAdamW: AdamW whose state lives in host RAM and whose update runs off the GPU.

A torch.optim.Optimizer, so LR schedulers, param groups and state dicts work as with
torch.optim.AdamW. Numerics: each parameter's host update is bit-identical to
torch.optim.AdamW(fused=True) on the CPU (fp32 master weights on the host).
"""

from __future__ import annotations

import warnings
from typing import Any

import torch

from . import optim_checks as _checks
from . import trainstream_args as _ts_args
from .engine.nonfinite import NonFiniteGradientError
from .ops import _adamw_rules as _rules
from .options import (
    parse_accumulation_steps,
    parse_device,
    parse_max_grad_norm,
    parse_moment_dtype,
    parse_threads,
)
from .planner.rules import SWITCH_AFTER_STEPS  # noqa: F401  (optim.SWITCH_AFTER_STEPS: tests read it)
from .runtime.session import TrainingSession

_GROUP_EXTRAS = dict(
    amsgrad=False,
    maximize=False,
    foreach=None,
    capturable=False,
    differentiable=False,
    fused=None,
    decoupled_weight_decay=True,
)


class OffloadAdamW(_ts_args.TrainStreamMethods, torch.optim.Optimizer):
    """AdamW with fp32 master weights and moments off the GPU.

    Args:
        params: parameters or param groups (as torch.optim.AdamW), all on one device.
        lr, betas, eps, weight_decay: as torch.optim.AdamW (decoupled weight decay).
        mode: "cpu" (host threads update, state in host RAM), "gpu" (the CUDA kernel updates
            state kept in pinned host memory over PCIe; the host CPU does nothing) or "auto"
            (a share of each, from measured host and PCIe rates, solved again from the rates
            measured in training after step 4, runtime/refiner.py). On a CPU device "auto" updates
            on the host and "gpu" raises ValueError; with `distributed` every mode updates on
            the host.
        max_grad_norm: clip by the global norm like torch.nn.utils.clip_grad_norm_ (None: off).
        accumulation_steps: backward passes summed on the host per step().
        moment_dtype: "float32" or "bfloat16" (stochastic rounding).
        threads: host threads for the update (None: RAMSTREAM_NUM_THREADS or all cores).
        device: the compute device (default: the parameters' device).
        offload: True (always offload) or "auto" (after two steps, move the update to a CUDA
            device when its state fits there with `vram_headroom` to spare, otherwise keep in
            VRAM the share of it that fits and update it there; never on a CPU device or with
            `distributed`).
        vram_headroom: share of usable device memory the "auto" switch leaves free.
        guard_params: reads of a weight whose update is in flight wait for it.
        bucket_bytes: gradients and weights cross PCIe in buckets of about this size.
        max_inflight_bytes: device memory that gradients waiting for their copy to the host may
            hold before backward waits (None: min(1 GiB, 10% of the device)).
        distributed: data parallel over the initialised torch.distributed process group: each
            rank keeps and updates the host state of its share of the buckets.
        seed: the stochastic-rounding stream of bf16 moments.
        eager_updates: True (default) updates a bucket as soon as its gradients are complete in
            the last micro-batch's backward (no clipping), overlapping host AdamW with backward.
            False defers every update to step(), so a backward pass that raises leaves weights
            and optimizer state untouched, at the cost of that overlap. With max_grad_norm the
            updates wait for step() either way.
        skip_nonfinite: what step() does when the global gradient norm it computes (max_grad_norm,
            clip_grad_norm_) is NaN or Inf: either way no update is applied (weights, masters,
            moments and step counts stay as they were, the gradients are dropped, the next step
            trains); False (default) raises NonFiniteGradientError naming the norm and the
            parameters, True skips with a RuntimeWarning. Counted in stats()["skipped_steps"].
            Without a norm (no max_grad_norm, no clip_grad_norm_) gradients are not checked and,
            as with torch.optim.AdamW, a NaN gradient makes NaN weights; max_grad_norm=
            float("inf") checks every step without clipping.
        delayed_update: False (default) or ZeRO-Offload's one-step delayed parameter update: True
            (the first 40 steps undelayed) or an integer >= 0 (that many undelayed warm-up steps).
            A delayed step() queues the host AdamW and returns; the next forward and backward run
            on the weights before it, and the next step() installs it first: w[t+1] =
            AdamW(w[t], g(w[t-1])). It changes the numbers (docs/guide/delayed_update.md). Only
            host-updated buckets are delayed (mode "auto"'s mapped and VRAM shares are updated by
            the GPU at once, no resident switch; "cpu" delays all; "gpu" is a ValueError); not
            with `distributed` (NotImplementedError).
        nvme_dir: the folder of the scratch file holding the optimizer state on disk (None: the
            RAMSTREAM_NVME_DIR variable). Missing, not a folder or not writable: OSError naming it.
        nvme_offload: "auto" (default: the plan's share when wrap() has a plan; none here), True
            (every host bucket's fp32 master and moments on disk), False, or a share in (0, 1]
            of that state's bytes, from the last buckets in forward order. Each step reads and
            writes the disk buckets' state once (docs/guide/disk.md: SSD wear). The state stays
            host-updated (mode "auto" acts as "cpu", offload as True; mode "gpu" and
            `distributed` are ValueErrors); a full disk is an OSError here (the file is reserved).
    """

    def __init__(
        self,
        params,
        lr: float = 1e-3,
        betas=(0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
        *,
        mode: str = "cpu",
        max_grad_norm=None,
        accumulation_steps: int = 1,
        moment_dtype: Any = "float32",
        threads=None,
        device=None,
        offload: Any = True,
        vram_headroom: float = 0.10,
        guard_params: bool = True,
        bucket_bytes: int = 32 << 20,
        max_inflight_bytes: int | None = None,
        distributed: bool = False,
        seed: int = 0,
        eager_updates: bool = True,
        skip_nonfinite: bool = False,
        delayed_update=False,
        nvme_dir=None,
        nvme_offload: Any = "auto",
        eager=None,  # TrainStream's names (trainstream_args.py)
        compute_grad_norm: bool = False,
        chunk_elems=None,
        pin_moments=None,
        _order=None,
        _log=None,
        _streamed=None,
        _block_of=None,
        _nvme_share: float = 0.0,
        _device_state: bool = False,
        _planned_mapped: float | None = None,
    ) -> None:
        _checks.check_hyper(lr, betas, eps, weight_decay)
        eager_updates, max_grad_norm = _ts_args.translate(
            eager=eager,
            compute_grad_norm=compute_grad_norm,
            chunk_elems=chunk_elems,
            pin_moments=pin_moments,
            eager_updates=eager_updates,
            max_grad_norm=max_grad_norm,
        )
        _checks.check_args(
            mode=mode,
            offload=offload,
            flags=dict(
                guard_params=guard_params,
                eager_updates=eager_updates,
                distributed=distributed,
                skip_nonfinite=skip_nonfinite,
            ),
            bucket_bytes=bucket_bytes,
            seed=seed,
            max_inflight_bytes=max_inflight_bytes,
            vram_headroom=vram_headroom,
        )
        self._max_grad_norm = parse_max_grad_norm(max_grad_norm, "OffloadAdamW:")
        self._accumulation_steps = parse_accumulation_steps(accumulation_steps, "OffloadAdamW:")
        md = parse_moment_dtype(moment_dtype, allow_auto=False, where="OffloadAdamW:")
        self._moment_dtype = torch.float32 if md == "float32" else torch.bfloat16
        self._threads = parse_threads(threads, "OffloadAdamW:")
        self._delayed_update, mode, offload = _checks.check_delayed(
            delayed_update, mode, offload, distributed
        )
        nvme_share, nvme_dir, mode, offload = _checks.check_nvme(
            nvme_offload, nvme_dir, mode, offload, distributed, _nvme_share
        )
        device = parse_device(device, "OffloadAdamW:")
        self._engine = None
        self._resident = None
        self._closed = False
        self._step_callbacks: list = []
        self._zero_grad_callbacks: list = []
        # the plan history's only writer: records what the in-training deciders return
        self._session = TrainingSession()
        defaults = dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay, **_GROUP_EXTRAS)
        if (
            not torch.is_tensor(params)
            and not isinstance(params, (list, tuple, dict))
            and hasattr(params, "__iter__")
        ):
            params = list(params)  # a generator (model.parameters()): torch lists it too
        if isinstance(params, (list, tuple)) and not params:
            raise ValueError(
                "OffloadAdamW: params is empty; accepted: the model's parameters (model.parameters()) or "
                "param-group dicts"
            )
        super().__init__(params, defaults)
        for i, g in enumerate(self.param_groups):  # a group may set its own hyper-parameters
            _rules.check_group("OffloadAdamW", g, i)
        if self._threads is not None:
            from ._native import lib

            lib().set_num_threads(self._threads)
        devices = {p.device for g in self.param_groups for p in g["params"]}
        if device is None:
            if len(devices) != 1:
                raise ValueError(f"OffloadAdamW: parameters are on several devices {devices}; pass device=")
            device = devices.pop()
        self.mode, self.offload, self.vram_headroom = mode, offload, float(vram_headroom)
        self._distributed = bool(distributed)
        self._log = _log or (lambda msg: None)
        self.split_info: dict = {}
        self._planned_mapped = _planned_mapped  # wrap()'s plan's mapped share (delayed_update only)
        if max_inflight_bytes is None and device.type == "cuda" and torch.cuda.is_available():
            from .hardware import gpu_memory
            from .planner.wrap_rules import grad_inflight_bytes

            max_inflight_bytes = grad_inflight_bytes(gpu_memory(device)["cap"])
        from .engine.core import Engine

        self._engine = Engine(
            self.param_groups,
            order=_order,
            device=device,
            moment_dtype=self._moment_dtype,
            mapped_fraction=0.0 if _device_state else self._mapped_fraction(mode, device),
            max_grad_norm=self._max_grad_norm,
            accumulation_steps=self._accumulation_steps,
            bucket_bytes=bucket_bytes,
            guard_params=guard_params,
            max_inflight_bytes=max_inflight_bytes,
            distributed=distributed,
            seed=seed,
            log=_log,
            eager_updates=eager_updates,
            streamed=_streamed,
            block_of=_block_of,
            skip_nonfinite=skip_nonfinite,
            delayed_update=self._delayed_update,
            nvme_dir=nvme_dir,
            nvme_share=nvme_share,
            device_state=_device_state,
        )
        if _device_state:  # wrap()'s resident plan (runtime/optimizer_split.py state_starts_on_device)
            self.split_info = {
                "fraction": 0.0,
                "device": 1.0,
                "reason": "resident plan: the state starts in VRAM",
            }
        from .runtime.refiner import make_refiner

        # "auto": the host / mapped split solved again from the rates of steps 3-4 (runtime/refiner.py)
        self._refiner = make_refiner(self, SWITCH_AFTER_STEPS)
        self._had_grads = False
        from .clipping import register

        register(self)  # torch.nn.utils.clip_grad_norm_ on these parameters comes here

    def _mapped_fraction(self, mode: str, device: torch.device) -> float:
        from .runtime.optimizer_split import mapped_fraction_for

        return mapped_fraction_for(self, mode, device)

    # ---- torch.optim.Optimizer API --------------------------------------------------------
    def add_param_group(self, param_group: dict) -> None:
        if self._engine is not None:
            raise RuntimeError(
                "OffloadAdamW.add_param_group: param groups are fixed once the "
                "engine is built; create the optimizer with every group"
            )
        super().add_param_group(param_group)

    @torch.no_grad()
    def step(self, closure=None):
        """Applies the gradients gathered since the last step (queued; returns without waiting
        for host updates). With none gathered it updates nothing, as torch.optim.AdamW skips
        parameters without .grad (the step still counts for stats() and LR schedulers); the
        first such call before any backward pass warns once (RuntimeWarning)."""
        if self._closed:
            raise RuntimeError(
                "OffloadAdamW.step: this optimizer is closed (unwrap() or a later "
                "wrap() took its model): gradients no longer reach it; step the "
                "optimizer returned by the latest wrap()"
            )
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if not self._had_grads:
            self._check_first_gradients()
        try:
            if self._resident is not None:
                stepped = self._resident.step()
            else:
                stepped = self._engine.step()
        except NonFiniteGradientError:
            self._after_step()  # the step's passes completed: their bookkeeping as after any step
            raise
        except BaseException:
            for fn in self._zero_grad_callbacks:  # the failed step's pooled buffers go back
                fn(failed=True)
            raise
        if not stepped:  # skipped (non-finite gradients, skip_nonfinite): no update, no count
            self._after_step()
            return loss
        if self._resident is not None:
            self._engine.stats["steps"] += 1
            self._after_step()
            return loss
        e = self._engine
        if not e.forward_waits and not e.guard_params:
            e.synchronize()
        if self.offload == "auto" and e.stats["steps"] == SWITCH_AFTER_STEPS:
            self._maybe_go_resident()
        if self._refiner is not None:
            self._session.take(self._refiner.after_step(e.stats["steps"]))
        self._after_step()
        return loss

    def _check_first_gradients(self) -> None:
        """step() before any backward pass: nothing to apply (as torch.optim.AdamW, which skips
        parameters without .grad); the step still counts for stats() and LR schedulers. Warned
        once per optimizer, since it usually means a training loop in the wrong order."""
        e = self._engine
        e.recover_if_abandoned()
        if e.intake.micro > 0 or self._resident is not None:
            self._had_grads = True
            return
        self._had_grads = True
        warnings.warn(
            "ramstream: optimizer.step() before any backward pass: there are no "
            "gradients, so nothing is updated (weights, moments and step counts stay "
            "as they are, as with torch.optim.AdamW); call loss.backward() before "
            "optimizer.step()",
            RuntimeWarning,
            stacklevel=5,
        )

    def clip_grad_norm_(self, max_norm, norm_type: float = 2.0) -> torch.Tensor:
        """Clips this step's gradients by their global L2 norm, as
        torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm) does for a torch optimizer
        (and Accelerate's / FSDP's clip_grad_norm_), and returns that norm (before clipping) as
        a float32 tensor on the device. Call it after the last backward pass of the step and
        before step(); step() then scales the update by min(1, max_norm / (norm + 1e-6)).
        max_norm=float('inf') only measures. The norm is summed in double on the host.

        Needs updates that wait for step(): max_grad_norm= given at wrap() (max_norm replaces it
        for this step) or eager_updates=False; otherwise RuntimeError, since the updates ran
        during backward. Only norm_type=2.0 (ValueError otherwise). With no gradient gathered
        since the last step the norm is 0."""
        from .clipping import check_max_norm, engine_norm, resident_norm

        if self._closed:
            raise RuntimeError("OffloadAdamW.clip_grad_norm_: this optimizer is closed")
        max_norm = check_max_norm(max_norm, norm_type)
        if self._resident is not None:
            norm = resident_norm(self._resident, max_norm)
        else:
            norm = engine_norm(self._engine, max_norm)
        return torch.tensor(norm, dtype=torch.float32, device=self._engine.device)

    def _after_step(self) -> None:
        for fn in self._step_callbacks:  # what a decider returns (its history entries) is recorded
            self._session.take(fn())

    @property
    def plan_history(self):
        """The plan's changes while training (memory_report(model)["plan"]["history"]): a read-only
        sequence of entries, recorded by the session (runtime/session.py TrainingSession)."""
        return self._session.history

    def zero_grad(self, set_to_none: bool = True) -> None:
        if not self._closed:
            target = self._resident or self._engine
            target.recover_if_abandoned()  # after a failed backward: start clean
            target.discard_if_gathered()  # between backward and step: drop, as torch
            for fn in self._zero_grad_callbacks:  # a failed step's pooled buffers go back
                fn()
        super().zero_grad(set_to_none=set_to_none)

    def state_dict(self) -> dict:
        from .engine.state import export_state

        return export_state(self, self.param_groups)

    def load_state_dict(self, state_dict: dict) -> None:
        from .engine.state import import_state
        from .optim_checks import check_state_dict

        check_state_dict(state_dict, self.param_groups)  # nothing changes when a value is refused
        import_state(self, self.param_groups, state_dict)

    # ---- ramstream extras ---------------------------------------------------------------------
    def synchronize(self) -> None:
        """Waits until every queued update has reached the model's weights."""
        if self._resident is None:
            self._engine.synchronize()
            return
        self._resident.recover_if_abandoned()
        if self._engine.device.type == "cuda":
            torch.cuda.synchronize(self._engine.device)

    def master_weights(self) -> list[torch.Tensor]:
        """Copies of the fp32 master weights, one per parameter in param_groups order (shaped
        like the parameter). For a bf16/fp16 model these hold the precision the model lacks."""
        from .optim_extras import master_weights

        return master_weights(self)

    def stats(self) -> dict:
        """steps, bytes_d2h, bytes_h2d, host_update_s, host_updated_numel (elements the host AdamW
        updated in that time), host_land_s, wait_s, waits, throttle_s
        (backward waiting on max_inflight_bytes), gpu_updates, grad_hook_calls, eager_updates
        (bucket updates run during backward); TrainStream's names: grad_bytes_offloaded
        (= bytes_d2h), param_bytes_uploaded (= bytes_h2d), guard_waits (= waits: reads that
        waited for an update), mode ("resident" after the switch), numel (trained elements),
        params, host_state_bytes, moment_dtype, update_ms_total (trainstream_args.stats_names);
        with nvme_offload the disk tier's nvme_* figures (optim_extras.stats)."""
        from .optim_extras import stats

        return stats(self)

    def attach(self, model: torch.nn.Module, guard: bool = True) -> "OffloadAdamW":
        """Hooks `model` (whose parameters this optimizer holds) in place as wrap() does, so a
        plain loop trains exactly as after wrap(): forward waits, names, state-dict and .to()
        hooks; ramstream.unwrap(model) undoes it. Returns this optimizer, so that
        ``opt = OffloadAdamW(model.parameters()).attach(model)`` chains (TrainStream's idiom).
        guard=False (TrainStream's argument) drops the read guard on the parameters, as
        guard_params=False does (forward waits still order every module's reads)."""
        from .optim_extras import attach

        return attach(self, model, guard)

    @property
    def attached(self) -> bool:
        """True after attach(model) or wrap(), until the optimizer is closed."""
        return self._engine.forward_waits and not self._closed

    @property
    def eager_active(self) -> bool:
        """Whether updates run during the last micro-batch's backward (eager_updates without
        max_grad_norm, not resident)."""
        return self._engine.eager_updates and self._max_grad_norm is None and self._resident is None

    @property
    def accumulation_steps(self) -> int:
        return self._accumulation_steps

    @property
    def max_grad_norm(self) -> float | None:
        return self._max_grad_norm

    @property
    def last_grad_norm(self) -> float | None:
        """The global gradient norm max_grad_norm took at the last step (TrainStream's name);
        None before one, without max_grad_norm, or once resident."""
        return None if self._resident is not None else self._engine.last_grad_norm

    @property
    def resident(self) -> bool:
        """True once offload="auto" found that the state fits on the device and moved it there."""
        return self._resident is not None

    def _maybe_go_resident(self) -> None:
        from .runtime.optimizer_split import maybe_share, maybe_switch

        resident, entry = maybe_switch(self, SWITCH_AFTER_STEPS)
        self._session.take(entry)
        if resident is None:  # what VRAM is left holds a share of the state (optimizer_split.py)
            self._session.take(maybe_share(self, SWITCH_AFTER_STEPS))
        else:
            self._resident = resident
            self._engine.close()
            for b in self._engine.buckets:  # the state lives on the device now
                b.master = b.exp_avg = b.exp_avg_sq = b.landing = b.acc = None

    def _before_apply(self) -> None:
        (self._resident or self._engine).before_apply()

    def _after_apply(self, model) -> None:
        if self._resident is not None:
            self._resident.after_apply()
        else:
            self._engine.rebind(model)

    def _model_loaded(self, model=None) -> None:
        if self._resident is not None:
            self._resident.resync_masters(model)
        else:
            self._engine.resync_masters(model)

    def __enter__(self) -> "OffloadAdamW":
        return self

    def __exit__(self, *exc) -> None:
        """``with OffloadAdamW(...) as opt:`` closes it at the end (an exception included): its
        hooks and threads end, and with nvme_offload its scratch file is removed."""
        self.close()

    def close(self) -> None:
        self._closed = True
        if self._resident is not None:
            self._resident.close()
        if self._engine is not None:
            self._engine.close()
