"""wrap(model, optimizer) -> (model, optimizer): one line to offload; unwrap() (memory_report() is
report.py's)."""

from __future__ import annotations

import torch

from .frontends.offload_model.model import OffloadModel
from .frontends.offload_model.optim import wrap_offload_model
from .optim import OffloadAdamW
from .options import WrapOptions
from .planner.host_fit import pick_moment_dtype
from .report import EventLog, Laps, memory_report  # noqa: F401  (memory_report: ramstream.wrap's name too)
from .runtime import delayed_split as _delayed
from .runtime.allocator import use_expandable_segments
from .runtime.apply import _ranges, check_steps, hf_checkpointing, make_plan, plan_record, restreamable
from .runtime.attach import _Wrapped, attach_model, unwrap  # noqa: F401  (wrap's names too)
from .runtime.convert import _convert_optimizer, _hand_over
from .runtime.optimizer_split import state_starts_on_device
from .weights.setup import (
    agree_streamed,
    build_streamer,
    devices_of,
    move_back,
    move_resident,
    streamed_bytes,
    streamed_ids,
)


def _forward_order(model: torch.nn.Module) -> list[torch.nn.Parameter]:
    return list(model.parameters())


def _plan_streaming(model, opts: WrapOptions, device: torch.device, use_dp: bool, log, plan=None):
    """(blocks, streamed block indices, {id(param): block}) for param_offload: the plan's streamed
    blocks when there is a plan, else the option as given ("auto" streams nothing without a plan)."""
    if opts.param_offload is False and plan is None:
        return [], [], {}
    from .blocks import chosen_blocks, find_blocks

    try:
        blocks = list(opts.blocks) if opts.blocks is not None else find_blocks(model)
    except ValueError:
        if opts.param_offload == "auto":
            return [], [], {}
        raise
    if plan is not None:
        idx = list(plan.weights["streamed"])
        if idx:
            log(f"plan: {len(idx)} of {len(blocks)} blocks stream their weights ({_ranges(idx)})")
    elif opts.param_offload == "auto" or not blocks:
        idx = []
    else:
        idx = chosen_blocks("param_offload", opts.param_offload, len(blocks))
    if use_dp and opts.param_offload == "auto":  # the ranks' buckets must match
        idx = agree_streamed(idx, device, log)
    return blocks, idx, streamed_ids(model, blocks, idx, log) if idx else {}


def _use_profile(opts: WrapOptions, device: torch.device, log) -> dict | None:
    """profile=True on a GPU: the hardware profile (read from its cache, or measured once and
    cached: planner.profile_hardware) gives optimizer_mode="auto" its host AdamW and PCIe rates;
    its figures go to memory_report(model)["plan"]["profile"]."""
    if not opts.profile or device.type != "cuda":
        return None
    from .engine import rates
    from .planner import profile_hardware

    try:
        prof = profile_hardware(device)
        rates.seed(device, prof.adamw_gbps * 1e9 / 28, prof.h2d_gbps * 1e9)
        log(
            f"profile ({prof.source}): H2D {prof.h2d_gbps:.1f} GB/s, D2H {prof.d2h_gbps:.1f} GB/s, "
            f"host AdamW {prof.adamw_gbps:.0f} GB/s of fp32 state, VRAM free "
            f"{prof.vram_free / 2**30:.2f} GiB, RAM available {prof.ram_available / 2**30:.2f} GiB"
        )
        return prof.to_dict()
    except Exception as exc:  # noqa: BLE001 - the in-process measurement takes over
        log(f"profile: the hardware profile failed ({exc!r}); optimizer_mode=auto measures in-process")
        return None


def _ram_with_model(model, device: torch.device, streamed: dict) -> dict:
    """Available host RAM for the moment dtype, counting as free what the model holds in host memory:
    it moves to `device`, or (streamed blocks) its pinned home, which the arithmetic counts as
    "streamed weights", replaces it; on the CPU engine, as measured."""
    from .planner.profile import available_ram

    ram = dict(available_ram())
    if device.type == "cpu":
        return ram
    ram["available"] += _bytes_to_move(model, device)
    return ram


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
    from .hardware import allocatable

    free = allocatable(mem)
    if nbytes <= free:
        return
    gib = 2**30
    raise MemoryError(
        f"wrap(): the model's weights and buffers need {nbytes / gib:.2f} GiB on {device}, but the "
        f"process may allocate {free / gib:.2f} GiB more there (cap {mem['cap'] / gib:.2f} "
        f"of {mem['total'] / gib:.2f} GiB, {mem['reserved'] / gib:.2f} GiB already reserved). "
        "Optimizer state and gradients live in host RAM, but the weights must fit on the device "
        "unless they stream: pass param_offload=True (blocks' weights stream from pinned host memory), train in bf16 (model.bfloat16(); the fp32 masters "
        "stay in host RAM, half the device bytes), or use a smaller model or a larger GPU"
    )


def _check_model(model: torch.nn.Module, optimizer) -> None:
    """ValueError for a model wrap() cannot train: no parameters, parameters on the meta device (no
    data), or an optimizer none of whose trainable parameters is the model's (some extra ones, never
    used by the model, are allowed: they get no gradient and no update, as with torch)."""
    params = list(model.parameters())
    if not params:
        raise ValueError(f"wrap(): the model ({type(model).__name__}) has no parameters: nothing to train")
    meta = sum(1 for p in params if p.is_meta)
    if meta:
        raise ValueError(
            f"wrap(): {meta} of the model's {len(params)} parameters are on the meta device (they hold no "
            "data): load or materialise the weights first (from_pretrained, ramstream's load_model, or "
            "model.to_empty(device=...) and load_state_dict)"
        )
    if optimizer is None or not hasattr(optimizer, "param_groups"):
        return
    mine = {id(p) for p in params}
    given = [p for g in optimizer.param_groups for p in g["params"] if getattr(p, "requires_grad", False)]
    foreign = sum(1 for p in given if id(p) not in mine)
    if given and foreign == len(given):
        raise ValueError(
            f"wrap(): {foreign} of the optimizer's {len(given)} trainable parameters are not parameters of "
            "this model (an optimizer built over another model, or over a copy of it?): build the optimizer "
            "over model.parameters() and pass that model"
        )


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


def _make_optimizer(
    groups, g0, opts, moment_dtype, device, use_dp, model, log, streamed, block_of=None, nvme=(0.0, None),
    on_device=False, planned_mapped=None,
):  # fmt: skip
    """The OffloadAdamW wrap() trains with (its engine lays the weights out in flat device buffers).
    planned_mapped: the plan's mapped share with delayed_update (None: the optimizer's own split)."""
    return OffloadAdamW(
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
        skip_nonfinite=opts.skip_nonfinite,
        delayed_update=opts.delayed_update,
        nvme_dir=nvme[1],
        nvme_offload=nvme[0] or False,  # resolved by _resolve_nvme: a share or off
        _order=_forward_order(model),
        _log=log,
        _streamed=streamed,
        _block_of=block_of,
        _device_state=on_device,
        _planned_mapped=planned_mapped,
    )


def _resolve_nvme(opts, plan, use_dp: bool, log) -> tuple[float, str | None]:
    """(share of the host-updated state on disk, folder): nvme_offload="auto" takes the plan's
    share (plan.optimizer["nvme_share"]; none without a plan, a folder, or on the GPU optimizer);
    errors (ValueError naming the options, OSError naming the folder) come before anything moves."""
    from .optim_checks import check_nvme

    auto = 0.0
    if plan is not None and opts.optimizer_mode != "gpu" and not use_dp:
        auto = float(plan.optimizer.get("nvme_share", 0.0) or 0.0)
    share, folder, _, _ = check_nvme(
        opts.nvme_offload, opts.nvme_dir, opts.optimizer_mode, opts.offload, use_dp, auto, where="wrap():"
    )
    if share > 0:
        log(f"nvme_offload={opts.nvme_offload!r} -> {share:g} of the optimizer state on disk in {folder}")
    return share, folder


def _oom_or_none(fn, *args) -> str | None:
    """fn(*args); torch's out-of-memory message when it ran out of device memory, else None. The
    exception (and with it the frames holding half-made device buffers) is gone when this returns."""
    try:
        fn(*args)
    except torch.OutOfMemoryError as e:
        return str(e).splitlines()[0][:200]
    return None


def _oom_at_wrap(model, homes: dict, device: torch.device, doing: str, said: str) -> MemoryError:
    """The model back where it came from, the device's cache released, and a MemoryError with the
    arithmetic (the allocator's fragments can refuse what the byte count allowed)."""
    import gc

    from .hardware import allocatable, gpu_memory

    move_back(model, homes)
    gc.collect()  # a half-made engine's buffers
    nbytes = sum(t.numel() * t.element_size() for t in [*model.parameters(), *model.buffers()])
    gib = 2**30
    room = ""
    if device.type == "cuda":
        torch.cuda.empty_cache()
        mem = gpu_memory(device)
        room = (
            f", the process may allocate {allocatable(mem) / gib:.2f} GiB more there now (cap "
            f"{mem['cap'] / gib:.2f} of {mem['total'] / gib:.2f} GiB, {mem['reserved'] / gib:.2f} GiB reserved)"
        )
    return MemoryError(
        f"wrap(): out of memory on {device} while {doing}: the model's weights and buffers take "
        f"{nbytes / gib:.2f} GiB on {device}{room}; the weights are back where they were and nothing was kept "
        "on the device. Pass param_offload=True (blocks' weights stream from host memory), free "
        f"device memory, or raise the cap (torch said: {said})"
    )


def wrap(model: torch.nn.Module, optimizer=None, **options):
    """Offloads optimizer state and gradients of `model` to host RAM.

    Returns (model, optimizer): the same model object (hooks installed, parameters now views
    of flat buffers) and a ramstream.OffloadAdamW holding the converted optimizer's groups and
    state. Every option is in the table of docs/guide/wrap.md; an unknown name or a
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
    lap = Laps()  # where wrap()'s time goes: memory_report(model)["plan"]["setup_s"]
    _check_model(model, optimizer)
    if opts.blocks is not None:
        from .blocks import check_blocks

        check_blocks("wrap()", model, opts.blocks)
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
    if use_dp and opts.delayed_update is not False:
        raise NotImplementedError(
            "wrap(): option delayed_update is not supported under data parallel (the owners' broadcast "
            "of the new weights is not delayed); pass delayed_update=False"
        )
    # --- quantize (issue 11): pack frozen block weights before any streaming decision ---
    from .runtime.quantize import apply_quantize

    quant_report, quant_removed = apply_quantize(model, opts, device, log)
    lap("quantize")
    # --- end quantize ---
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
    plan, plan_shape, plan_prof = make_plan(model, optimizer, opts, device, log)
    lap("plan")
    nvme = _resolve_nvme(opts, plan, use_dp, log)  # before anything moves
    blocks, stream_idx, streamed = _plan_streaming(model, opts, device, use_dp, log, plan)
    block_of = restreamable(model, blocks, opts, plan, use_dp)
    from .runtime.disk_weights import prepare as prepare_disk_weights

    disk_w = prepare_disk_weights(
        opts, plan, blocks, stream_idx, streamed, log
    )  # its store open: nothing moved
    moment_option = opts.moment_dtype
    # the plan's moment dtype is the host state's; a resident plan's is the settled run's (the host
    # state of the first steps follows host RAM, and the switch gives fp32 back: resident.py)
    if plan is not None and moment_option == "auto" and plan.mode != "resident":
        moment_option = plan.optimizer["moment_dtype"]
        log(f"moment_dtype=auto -> {moment_option} (the plan)")
    on_device, why_not = state_starts_on_device(plan, opts, device, use_dp, trained[0].dtype != torch.float32)
    if plan is not None and plan.mode == "resident":
        log(
            "the plan is resident: the optimizer state starts in VRAM (no host state)"
            if on_device
            else f"the plan is resident; the state starts on the host until the switch ({why_not})"
        )
    if on_device:  # nothing of the state lives in host RAM: the plan's moment dtype, no host check
        moment_dtype = torch.bfloat16 if moment_option == "bfloat16" else torch.float32
        log(f"moment_dtype={moment_option} -> {str(moment_dtype).replace('torch.', '')} (in VRAM)")
    else:
        moment_dtype = pick_moment_dtype(
            moment_option,
            numel=sum(p.numel() for p in dict.fromkeys(trained)),
            working_bytes=trained[0].element_size(),
            accumulate=opts.accumulation_steps > 1,
            # packed quantized codes included; frozen weights on disk replaced by their staging ring
            streamed=streamed_bytes(model, streamed)
            - (disk_w.nbytes - disk_w.store.staging_bytes() if disk_w is not None else 0),
            check=opts.check_memory,
            log=log,
            ram=_ram_with_model(model, device, streamed),
            delayed=_delayed.host_share(plan, opts),
            nvme_share=nvme[0],
            bucket_bytes=opts.bucket_bytes,
        )
    homes = devices_of(model)  # where a wrap() that runs out of device memory puts them back
    use_expandable_segments(device, log)  # before the weights arrive: their segments expandable too
    if any(p.device != device for p in model.parameters() if id(p) not in streamed):
        if device.type == "cuda" and opts.check_memory:
            from .hardware import gpu_memory

            check_weights_fit(_bytes_to_move(model, device, streamed), gpu_memory(device), device)
        log(f"moving the model to {device}" + (" (streamed blocks stay in host memory)" if streamed else ""))
        failed = _oom_or_none(move_resident, model, device, streamed)
        if failed is not None:
            raise _oom_at_wrap(model, homes, device, "moving the weights", failed)
    lap("moving the weights")
    if use_dp:
        from .engine.distributed import broadcast_model

        broadcast_model(model, src=0, device=device)
        import torch.distributed as dist

        log(
            f"data parallel: rank {dist.get_rank()} of {dist.get_world_size()} "
            f"({dist.get_backend()}); rank 0's weights broadcast"
        )
    profile = _use_profile(opts, device, log)
    lap("profile")
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
    made: list = []
    failed = _oom_or_none(
        lambda: made.append(
            _make_optimizer(
                groups,
                g0,
                opts,
                moment_dtype,
                device,
                use_dp,
                model,
                log,
                streamed,
                block_of,
                nvme,
                on_device,
                _delayed.planned_mapped(plan, opts),
            )
        )
    )
    if failed is not None:
        raise _oom_at_wrap(model, homes, device, "laying out the weights and optimizer buffers", failed)
    opt = made[0]
    lap("optimizer state")
    # bf16 moments chosen only for host RAM (moment_dtype="auto"): a resident switch makes them fp32
    opt._moments_for_ram = opts.moment_dtype == "auto" and moment_dtype == torch.bfloat16
    if old_state is not None:
        opt.load_state_dict(old_state)
        log("optimizer state migrated from the given optimizer")
    recompute = None
    if plan is not None:
        recompute = [i for i, m in enumerate(plan.activations) if m == "recompute"]
        if hf_checkpointing(blocks or []):
            recompute = []  # Hugging Face's gradient checkpointing recomputes these blocks already
    w = attach_model(model, opt, opts, log, recompute=recompute)
    w.plan["quantize"] = quant_report
    if plan is not None:
        w.plan["planner"] = plan_record(plan)
        w.applied_plan = plan
        if plan_shape is not None:
            check_steps(model, w, plan, plan_shape, plan_prof, opts, log)
    engine = opt._engine
    if profile is not None:
        w.plan["profile"] = profile
    if stream_idx:
        try:  # nvme_weights: the frozen weights written to disk (a failure loses nothing)
            on_disk = disk_w.build(engine) if disk_w is not None else None
            w.streamer = build_streamer(
                blocks, stream_idx, streamed, engine, opts.weight_window, log, on_disk
            )
            if disk_w is not None:
                w.handles += disk_w.attach(model, w.streamer, opt)
                w.disk_weights = disk_w
        except BaseException as exc:
            if disk_w is not None:
                disk_w.release()
            try:  # the model as it came (an error here must not hide the first one)
                unwrap(model)
            except Exception as again:  # noqa: BLE001
                exc.add_note(f"ramstream: unwrap() after the failure raised too: {again!r}")
            raise
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
    w.plan["setup_s"] = lap.done()
    log(f"wrap() took {lap.text()}")
    log(
        f"wrapped: {len(engine.slots)} parameters ({numel:,} elements) in {len(engine.buckets)} "
        f"buckets on {device} ({len(engine.frozen)} frozen ones left as they are); moments "
        f"{str(moment_dtype).replace('torch.', '')}; "
        f"max_grad_norm={opts.max_grad_norm}; accumulation_steps={opts.accumulation_steps}"
    )
    return model, opt
