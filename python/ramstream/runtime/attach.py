"""attach_model(): what wrap() (and OffloadAdamW.attach) leaves on a model once its optimizer
exists: forward waits, the plan's recompute, activation paging, the watchdog, state-dict hooks and
.to()/.half() handling; the _Wrapped record (model._ramstream) that unwrap() and memory_report read."""

from __future__ import annotations

import types
import weakref
from typing import TYPE_CHECKING

import torch

from ..trace import register as _trace_register

if TYPE_CHECKING:
    from ..options import WrapOptions
    from ..report import EventLog


class _Wrapped:
    """What wrap() leaves on the model (model._ramstream)."""

    def __init__(self, model, optimizer, options: WrapOptions, log: EventLog) -> None:
        self.model = model
        self.optimizer = optimizer
        self.options = options
        self.log = log
        self.handles: list = []
        self.orig_apply = None
        self.plan: dict = {}
        self.activations = None
        self.streamer = None
        self.recompute = None
        self.keep = None  # runtime/keep.py KeepPolicy
        self.watchdog = None
        self.applied_plan = None  # the planner.Plan wrap() applied (None: the CPU engine's defaults)


def _trace_modules(model: torch.nn.Module):
    """ramstream.trace's compute spans of a wrapped model: one per block (find_blocks), or the
    whole model when it has no block stack."""
    from ..blocks import find_blocks

    w = getattr(model, "_ramstream", None)
    if w is None:
        return [], None
    try:
        blocks = list(w.options.blocks) if w.options.blocks is not None else find_blocks(model)
    except ValueError:
        blocks = [model]
    return blocks, w.optimizer._engine.device


def _param_kinds(model: torch.nn.Module) -> set:
    return {(p.device, p.dtype) for p in model.parameters()}


def _log_rebuilt(before: set, after: set, log: EventLog) -> None:
    if before != after:
        kinds = lambda ks: ", ".join(sorted(f"{d} {str(t).replace('torch.', '')}" for d, t in ks))  # noqa: E731
        log(f"engine rebuilt: parameters moved or cast ({kinds(before)} -> {kinds(after)})")


def attach_paging(w, model: torch.nn.Module, opts: WrapOptions) -> None:
    """Activation paging (runtime/activation_policy.py) on a wrapped model, with opts'
    activation_offload: at wrap(), or between steps when a re-plan turns it on (runtime/apply.py
    PageLever). Its step callbacks run before the watchdog's, which then sees it."""
    from .activation_policy import ActivationPolicy

    opt = w.optimizer
    engine = opt._engine
    w.activations = ActivationPolicy(model, engine.device, opts, w.log)
    watchdog = getattr(w, "watchdog", None)
    at = len(opt._step_callbacks)
    if watchdog is not None and watchdog.after_step in opt._step_callbacks:
        at = opt._step_callbacks.index(watchdog.after_step)
        watchdog.activations = w.activations
    opt._step_callbacks[at:at] = [w.activations.on_step, w.activations.off._pool.commit]
    opt._zero_grad_callbacks.append(w.activations.off.after_failed_step)
    engine.on_abandon.append(w.activations.off.release_abandoned)


def attach_model(
    model: torch.nn.Module, opt: torch.optim.Optimizer, opts: WrapOptions, log: EventLog, recompute=None
) -> _Wrapped:
    """What wrap() does to a model once its optimizer (an OffloadAdamW) exists (also OffloadAdamW.attach):
    forward waits and parameter names, activation paging, state-dict hooks, .to()/.half().
    recompute: the plan's recomputed block indices, applied for activation_checkpointing="auto"."""
    w = _Wrapped(model, opt, opts, log)
    engine, device = opt._engine, opt._engine.device
    _trace_register(model, _trace_modules)
    engine.attach_forward_waits(model)
    ckpt = opts.activation_checkpointing
    if ckpt is not False:
        from ..activations.recompute import Recompute, checkpoint_indices
        from ..blocks import find_blocks
        from .inspect import auto_checkpointing

        try:
            blocks = list(opts.blocks) if opts.blocks is not None else find_blocks(model)
        except ValueError:
            if ckpt != "auto":
                raise
            blocks = []
        auto = ckpt == "auto"
        if auto and recompute is not None:
            ckpt = list(recompute) if recompute else False
        elif auto:
            ckpt = auto_checkpointing(model, blocks, device, log, opts.optimizer_mode)
    if ckpt is not False:
        from .inspect import is_lora_like
        from .keep import KeepPolicy, measured_memory_fn

        # "auto" in LoRA: after step 1 the blocks that fit keep their activations
        memory_fn = measured_memory_fn(device) if auto and is_lora_like(blocks) else None
        w.recompute = Recompute(blocks, checkpoint_indices(ckpt, len(blocks)), memory_fn=memory_fn)
        w.plan["recompute"] = list(w.recompute.indices)
        log(
            f"activation_checkpointing: {len(w.recompute.indices)} of {len(blocks)} blocks recompute in backward"
        )
        if memory_fn is not None:
            w.keep = KeepPolicy(w.recompute, device, opts.vram_headroom, log)
            opt._step_callbacks.append(w.keep.after_step)
    if opts.activation_offload is not False:
        attach_paging(w, model, opts)
    if opts.watchdog:  # after the activation policy's callback: it sees this step's phase
        from ..planner.rules import SWITCH_AFTER_STEPS
        from .watchdog import Watchdog

        w.watchdog = Watchdog(opt, w.activations, start_after=SWITCH_AFTER_STEPS, keep=w.keep)
        opt._step_callbacks.append(w.watchdog.after_step)
    w.handles.append(model.register_state_dict_pre_hook(lambda *a, **k: opt.synchronize()))
    w.handles.append(
        model.register_load_state_dict_pre_hook(
            lambda module, sd, prefix, *args: engine.note_loading(sd, prefix)
        )
    )
    w.handles.append(model.register_load_state_dict_post_hook(lambda module, keys: opt._model_loaded(module)))
    w.orig_apply = model.__dict__.get("_apply")

    def _apply(self, fn, *args, **kwargs):
        before = _param_kinds(self)
        opt._before_apply()
        if w.streamer is not None:
            return w.streamer.apply(self, fn, lambda: type(self)._apply(self, fn, *args, **kwargs))
        out = type(self)._apply(self, fn, *args, **kwargs)
        opt._after_apply(self)
        _log_rebuilt(before, _param_kinds(self), log)
        return out

    model._apply = types.MethodType(_apply, model)
    model._ramstream = w
    opt._attached_model = weakref.ref(model)  # OffloadAdamW.detach() (TrainStream's) finds it
    return w


def unwrap(model: torch.nn.Module) -> torch.nn.Module:
    """Waits for pending updates and returns the model as a plain module: current weights on
    its device, no hooks, plain nn.Parameters. The optimizer returned by wrap() is closed."""
    w = getattr(model, "_ramstream", None)
    if w is None:
        raise ValueError("unwrap(): this model is not wrapped by ramstream")
    w.optimizer.close()
    if w.streamer is not None:
        w.streamer.close()  # streamed weights stay in (pinned) host memory
    if w.activations is not None:
        w.activations.close()
    if w.recompute is not None:
        w.recompute.close()
    for h in w.handles:
        h.remove()
    if "_apply" in model.__dict__:
        del model._apply
    if w.orig_apply is not None:
        model._apply = w.orig_apply
    del model._ramstream
    from ..quant import dequantize_model
    from ..quant.lora_fused import unfuse_lora_

    unfuse_lora_(model)  # peft's own forward again
    dequantize_model(model)  # quantized weights become permanent (dequantized) parameters
    return model
