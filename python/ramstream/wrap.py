"""wrap(model, optimizer) -> (model, optimizer): one line to offload; unwrap() (memory_report() is
report.py's)."""

from __future__ import annotations

import types
import weakref

import torch

from .host_fit import pick_moment_dtype
from .offload_model import OffloadModel
from .offload_optim import wrap_offload_model
from .optim import OffloadAdamW
from .options import WrapOptions
from .report import EventLog, memory_report  # noqa: F401  (memory_report: ramstream.wrap's name too)
from .trace import register as _trace_register
from .weights.setup import (
    agree_streamed,
    build_streamer,
    choose_streamed,
    move_resident,
    streamed_bytes,
    streamed_ids,
)


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
        self.keep = None  # activations/recompute_keep.KeepPolicy
        self.watchdog = None


def _trace_modules(model: torch.nn.Module):
    """ramstream.trace's compute spans of a wrapped model: one per block (find_blocks), or the
    whole model when it has no block stack."""
    from .activations.blocks import find_blocks

    w = getattr(model, "_ramstream", None)
    if w is None:
        return [], None
    try:
        blocks = list(w.options.blocks) if w.options.blocks is not None else find_blocks(model)
    except ValueError:
        blocks = [model]
    return blocks, w.optimizer._engine.device


def _forward_order(model: torch.nn.Module) -> list[torch.nn.Parameter]:
    return list(model.parameters())


def _convert_optimizer(optimizer, model: torch.nn.Module, opts: WrapOptions):
    """(param_groups, state_dict or None) from a torch AdamW/Adam/OffloadAdamW or None."""
    if optimizer is None:
        params = [p for p in model.parameters() if p.requires_grad]
        if not params:
            raise ValueError("wrap(): the model has no trainable parameters")
        return [{"params": params, "lr": opts.lr}], None, {}
    if isinstance(optimizer, OffloadAdamW):
        sd = optimizer.state_dict()
        optimizer.close()
        return list(optimizer.param_groups), sd, {}
    if type(optimizer) in (torch.optim.AdamW, torch.optim.Adam):
        name = type(optimizer).__name__
        for g in optimizer.param_groups:
            if g.get("amsgrad") or g.get("maximize"):
                raise ValueError(f"wrap(): {name} with amsgrad or maximize is not supported")
            if (
                name == "Adam"
                and g.get("weight_decay", 0) != 0
                and not g.get("decoupled_weight_decay", False)
            ):
                raise ValueError(
                    "wrap(): torch.optim.Adam with weight_decay != 0 adds L2 decay to "
                    "the gradient, which ramstream's AdamW does not do; use "
                    "torch.optim.AdamW, or Adam with weight_decay=0"
                )
        sd = optimizer.state_dict() if optimizer.state else None
        # the same group dicts: what an LR scheduler of the given optimizer writes, we read
        return list(optimizer.param_groups), sd, {}
    raise ValueError(
        f"wrap(): optimizer of type {type(optimizer).__name__} is not accepted; "
        "accepted: torch.optim.AdamW, torch.optim.Adam, ramstream.OffloadAdamW, None"
    )


def _plan_streaming(model, opts: WrapOptions, device: torch.device, use_dp: bool, log):
    """(blocks, streamed block indices, {id(param): block}) for param_offload."""
    if opts.param_offload is False:
        return [], [], {}
    from .activations.blocks import find_blocks

    try:
        blocks = list(opts.blocks) if opts.blocks is not None else find_blocks(model)
    except ValueError:
        if opts.param_offload == "auto":
            return [], [], {}
        raise
    from .activations.recompute import recomputes_every_block

    every = recomputes_every_block(model, blocks, device, opts.activation_checkpointing, opts.optimizer_mode)
    idx = choose_streamed(
        model, blocks, opts.param_offload, device, opts.vram_headroom, log, recompute_all=every
    )
    if use_dp and opts.param_offload == "auto":  # the ranks' buckets must match
        idx = agree_streamed(idx, device, log)
    return blocks, idx, streamed_ids(model, blocks, idx, log) if idx else {}


def _use_profile(opts: WrapOptions, device: torch.device, log) -> dict | None:
    """profile=True on a GPU: the hardware profile (read from its cache, or measured once and
    cached: planner.profile_hardware) gives optimizer_mode="auto" its host AdamW and PCIe rates;
    its figures go to memory_report(model)["plan"]["profile"]."""
    if not opts.profile or device.type != "cuda":
        return None
    from .engine import split
    from .planner import profile_hardware

    try:
        prof = profile_hardware(device)
        split.seed(device, prof.adamw_gbps * 1e9 / 28, prof.h2d_gbps * 1e9)
        log(
            f"profile ({prof.source}): H2D {prof.h2d_gbps:.1f} GB/s, D2H {prof.d2h_gbps:.1f} GB/s, "
            f"host AdamW {prof.adamw_gbps:.0f} GB/s of fp32 state, VRAM free "
            f"{prof.vram_free / 2**30:.2f} GiB, RAM available {prof.ram_available / 2**30:.2f} GiB"
        )
        return prof.to_dict()
    except Exception as exc:  # noqa: BLE001 - the in-process measurement takes over
        log(f"profile: the hardware profile failed ({exc!r}); optimizer_mode=auto measures in-process")
        return None


def _bytes_to_move(model: torch.nn.Module, device: torch.device, skip=()) -> int:
    tensors = {id(t): t for t in list(model.parameters()) + list(model.buffers()) if id(t) not in skip}
    return sum(t.numel() * t.element_size() for t in tensors.values() if t.device != device)


def _check_cuda_device(device: torch.device, mode: str) -> None:
    """RuntimeError saying what to do when wrap() cannot use the CUDA device it was asked for
    (CPU-only torch, no driver or GPU, no such index, mode 'gpu' on a build without kernels)."""
    from .hardware import kernels_problem, torch_cuda_problem

    problem = torch_cuda_problem(device)
    if problem is None and mode == "gpu":
        problem = kernels_problem()
        if problem:
            problem = f"optimizer_mode='gpu' needs ramstream's CUDA kernels, but {problem}"
    if problem:
        raise RuntimeError(f"wrap(): device {device}: {problem}")


def check_weights_fit(nbytes: int, mem: dict, device: torch.device) -> None:
    """MemoryError with the arithmetic when the weights wrap() would move to the device exceed
    what the process may still allocate there (mem: hardware.gpu_memory)."""
    if nbytes <= mem["free"]:
        return
    gib = 2**30
    raise MemoryError(
        f"wrap(): the model's weights and buffers need {nbytes / gib:.2f} GiB on {device}, but the "
        f"process may allocate {mem['free'] / gib:.2f} GiB more there (cap {mem['cap'] / gib:.2f} "
        f"of {mem['total'] / gib:.2f} GiB, {mem['reserved'] / gib:.2f} GiB already reserved). "
        "Optimizer state and gradients live in host RAM, but the weights must fit on the device "
        "unless they stream: pass param_offload=True (blocks' weights stream from pinned host memory), train in bf16 (model.bfloat16(); the fp32 masters "
        "stay in host RAM, half the device bytes), or use a smaller model or a larger GPU"
    )


def _hand_over(old: torch.optim.Optimizer, new: OffloadAdamW) -> None:
    """The given optimizer shares its param group dicts with the new one (set up by
    _convert_optimizer), so LR schedulers created on it before wrap() keep working; its state,
    now in host RAM, is dropped (device memory it held is freed); torch's schedulers check
    `_opt_called` to warn about a scheduler stepped before its optimizer: the new optimizer's
    steps count."""
    if not isinstance(old, OffloadAdamW):
        old.state.clear()
    ref = weakref.ref(old)

    def mark_called() -> None:
        o = ref()
        if o is not None:
            o._opt_called = True

    new._step_callbacks.append(mark_called)


def _use_data_parallel(option) -> bool:
    """distributed=None: data parallel when a process group with more than one rank exists."""
    import torch.distributed as dist

    ready = dist.is_available() and dist.is_initialized()
    if option is True and not ready:
        raise ValueError(
            "wrap(): option distributed=True needs torch.distributed initialised "
            "(torch.distributed.init_process_group) before wrap()"
        )
    if option is None:
        return ready and dist.get_world_size() > 1
    return bool(option)


def _param_kinds(model: torch.nn.Module) -> set:
    return {(p.device, p.dtype) for p in model.parameters()}


def _log_rebuilt(before: set, after: set, log: EventLog) -> None:
    if before != after:
        kinds = lambda ks: ", ".join(sorted(f"{d} {str(t).replace('torch.', '')}" for d, t in ks))  # noqa: E731
        log(f"engine rebuilt: parameters moved or cast ({kinds(before)} -> {kinds(after)})")


def attach_model(model: torch.nn.Module, opt: OffloadAdamW, opts: WrapOptions, log: EventLog) -> _Wrapped:
    """What wrap() does to a model once its optimizer exists (also OffloadAdamW.attach):
    forward waits and parameter names, activation paging, state-dict hooks, .to()/.half()."""
    w = _Wrapped(model, opt, opts, log)
    engine, device = opt._engine, opt._engine.device
    _trace_register(model, _trace_modules)
    engine.attach_forward_waits(model)
    ckpt = opts.activation_checkpointing
    if ckpt is not False:
        from .activations.blocks import find_blocks
        from .activations.recompute import Recompute, auto_checkpointing, checkpoint_indices

        try:
            blocks = list(opts.blocks) if opts.blocks is not None else find_blocks(model)
        except ValueError:
            if ckpt != "auto":
                raise
            blocks = []
        auto = ckpt == "auto"
        if auto:
            ckpt = auto_checkpointing(model, blocks, device, log, opts.optimizer_mode)
    if ckpt is not False:
        from .activations.recompute import is_lora_like
        from .activations.recompute_keep import KeepPolicy, measured_memory_fn

        # "auto" in LoRA: after step 1 the blocks that fit keep their activations
        memory_fn = measured_memory_fn(device) if auto and is_lora_like(blocks) else None
        w.recompute = Recompute(blocks, checkpoint_indices(ckpt, len(blocks)), memory_fn=memory_fn)
        w.plan["recompute"] = list(w.recompute.indices)
        log(
            f"activation_checkpointing: {len(w.recompute.indices)} of {len(blocks)} blocks recompute in backward"
        )
        if memory_fn is not None:
            w.keep = KeepPolicy(w.recompute, device, opts.vram_headroom, log, opt.plan_history)
            opt._step_callbacks.append(w.keep.after_step)
    if opts.activation_offload is not False:
        from .activations import ActivationPolicy

        w.activations = ActivationPolicy(model, device, opts, log)
        opt._step_callbacks.append(w.activations.on_step)
        opt._zero_grad_callbacks.append(w.activations.off.after_failed_step)
        opt._step_callbacks.append(w.activations.off._pool.commit)
        engine.on_abandon.append(w.activations.off.release_abandoned)
    if opts.watchdog:  # after the activation policy's callback: it sees this step's phase
        from .engine.watchdog import Watchdog
        from .optim import SWITCH_AFTER_STEPS

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
    return w


def wrap(model: torch.nn.Module, optimizer=None, **options):
    """Offloads optimizer state and gradients of `model` to host RAM.

    Returns (model, optimizer): the same model object (hooks installed, parameters now views
    of flat buffers) and a ramstream.OffloadAdamW holding the converted optimizer's groups and
    state. Every option is in the README table under "ramstream.wrap"; an unknown name or a
    value not accepted raises ValueError listing what is accepted.
    An OffloadModel gets its host optimizer (OffloadModel.optimizer) over the optimizer's groups.
    """
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"wrap(): model must be a torch.nn.Module, got {type(model).__name__}")
    if isinstance(model, OffloadModel):  # its chunks stream already: its host optimizer
        return model, wrap_offload_model(model, optimizer, options)
    if getattr(model, "_ramstream", None) is not None:
        raise ValueError("wrap(): this model is already wrapped; call ramstream.unwrap(model) first")
    opts = WrapOptions.parse(**options)
    log = EventLog(opts.verbose)
    devices = {p.device for p in model.parameters()}
    device = opts.device
    if device is None:
        if len(devices) != 1:
            raise ValueError(
                f"wrap(): the model's parameters are on {sorted(map(str, devices))}; pass device="
            )
        device = devices.pop()
    if device.type == "cuda":
        _check_cuda_device(device, opts.optimizer_mode)
    use_dp = _use_data_parallel(opts.distributed)
    # --- quantize (issue 11): pack frozen block weights before any streaming decision ---
    from .quant.plan import apply_quantize

    quant_report, quant_removed = apply_quantize(model, opts, device, log)
    # --- end quantize ---
    blocks, stream_idx, streamed = _plan_streaming(model, opts, device, use_dp, log)
    # the host memory check comes before anything moves: a refusal leaves the model as it was
    if optimizer is not None and not isinstance(
        optimizer, (torch.optim.AdamW, torch.optim.Adam, OffloadAdamW)
    ):
        _convert_optimizer(optimizer, model, opts)  # raises, naming the accepted types
    trained = [
        p
        for p in (
            [q for g in optimizer.param_groups for q in g["params"]]
            if optimizer is not None
            else model.parameters()
        )
        if p.requires_grad
    ]
    if not trained:
        raise ValueError(
            "wrap(): none of the optimizer's parameters requires grad; set "
            "requires_grad on the parameters to train before wrap()"
        )
    moment_dtype = pick_moment_dtype(
        opts.moment_dtype,
        numel=sum(p.numel() for p in dict.fromkeys(trained)),
        working_bytes=trained[0].element_size(),
        accumulate=opts.accumulation_steps > 1,
        streamed=streamed_bytes(model, streamed),  # packed quantized codes included
        check=opts.check_memory,
        log=log,
    )
    if any(p.device != device for p in model.parameters() if id(p) not in streamed):
        if device.type == "cuda" and opts.check_memory:
            from .hardware import gpu_memory

            check_weights_fit(_bytes_to_move(model, device, streamed), gpu_memory(device), device)
        log(f"moving the model to {device}" + (" (streamed blocks stay in host memory)" if streamed else ""))
        move_resident(model, device, streamed)
    if use_dp:
        from .engine.distributed import broadcast_model

        broadcast_model(model, src=0, device=device)
        import torch.distributed as dist

        log(
            f"data parallel: rank {dist.get_rank()} of {dist.get_world_size()} "
            f"({dist.get_backend()}); rank 0's weights broadcast"
        )
    profile = _use_profile(opts, device, log)
    groups, old_state, _ = _convert_optimizer(optimizer, model, opts)
    if quant_removed:  # quantized weights left the model: drop them from the optimizer's groups
        for g in groups:
            g["params"] = [p for p in g["params"] if id(p) not in quant_removed]
    # frozen parameters (a LoRA model's base) get no host state: see Engine._make_slots
    numel = sum(p.numel() for g in groups for p in g["params"] if p.requires_grad)
    if not any(p.requires_grad for g in groups for p in g["params"]):
        raise ValueError(
            "wrap(): none of the optimizer's parameters requires grad; set "
            "requires_grad on the parameters to train before wrap()"
        )
    g0 = groups[0]
    opt = OffloadAdamW(
        groups,
        lr=g0.get("lr", opts.lr),
        betas=g0.get("betas", (0.9, 0.999)),
        eps=g0.get("eps", 1e-8),
        weight_decay=g0.get("weight_decay", 1e-2),
        max_grad_norm=opts.max_grad_norm,
        accumulation_steps=opts.accumulation_steps,
        moment_dtype=moment_dtype,
        threads=opts.threads,
        device=device,
        guard_params=opts.guard_params,
        bucket_bytes=opts.bucket_bytes,
        mode=opts.optimizer_mode,
        offload=opts.offload,
        vram_headroom=opts.vram_headroom,
        max_inflight_bytes=opts.max_inflight_bytes,
        distributed=use_dp,
        eager_updates=opts.eager_updates,
        _order=_forward_order(model),
        _log=log,
        _streamed=streamed,
    )
    if old_state is not None:
        opt.load_state_dict(old_state)
        log("optimizer state migrated from the given optimizer")
    w = attach_model(model, opt, opts, log)
    w.plan["quantize"] = quant_report
    engine = opt._engine
    if profile is not None:
        w.plan["profile"] = profile
    if stream_idx:
        w.streamer = build_streamer(blocks, stream_idx, streamed, engine, opts.weight_window, log)
        engine.on_abandon.append(w.streamer.evict_all)
        w.plan["weights"] = {
            "streamed": stream_idx,
            "resident": [i for i in range(len(blocks)) if i not in set(stream_idx)],
            **w.streamer.home_bytes(),
        }
        if quant_report is not None and quant_report.get("format"):
            quant_report["packed_streamed_bytes"] = w.plan["weights"]["packed_bytes"]
    if isinstance(optimizer, torch.optim.Optimizer) and optimizer is not opt:
        _hand_over(optimizer, opt)
    if opts.prefer == "speed" and quant_report is not None and quant_report.get("format"):
        from .quant.lora_fused import fuse_lora_

        quant_report["lora_fused"] = n = fuse_lora_(model)
        if n:
            log(f"prefer='speed': {n} LoRA layers over quantized bases run as one fused node each")
    log(
        f"wrapped: {len(engine.slots)} parameters ({numel:,} elements) in {len(engine.buckets)} "
        f"buckets on {device} ({len(engine.frozen)} frozen ones left as they are); moments "
        f"{str(moment_dtype).replace('torch.', '')}; "
        f"max_grad_norm={opts.max_grad_norm}; accumulation_steps={opts.accumulation_steps}"
    )
    return model, opt


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
    from .quant import dequantize_model
    from .quant.lora_fused import unfuse_lora_

    unfuse_lora_(model)  # peft's own forward again
    dequantize_model(model)  # quantized weights become permanent (dequantized) parameters
    return model
