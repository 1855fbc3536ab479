"""Applying the planner's Plan to a live model, for every front end: the plan wrap() (and
OffloadAdamW.attach) applies on a GPU (made here on this machine, or pinned by the user), its record
in memory_report(model)["plan"]["planner"], and the check of each larger step against it."""

from __future__ import annotations

import torch

from ..options import WrapOptions


def find_blocks_of(model, opts: WrapOptions) -> list | None:
    """The block stack (the blocks= option, else find_blocks), None when the model has none."""
    from ..blocks import find_blocks

    try:
        return list(opts.blocks) if opts.blocks is not None else find_blocks(model)
    except ValueError:
        return None


def _ranges(idx) -> str:
    from ..planner.result import _ranges as ranges

    return ranges(list(idx))


def make_plan(model, optimizer, opts: WrapOptions, device: torch.device, log):
    """(Plan, its ModelShape, the profile) wrap() applies on a GPU: opts.plan when pinned, else
    runtime.inspect.plan_model on this machine (rates: the cached or measured profile); (None,
    None, None) on the CPU engine or for a model without a block stack. PlanError (a MemoryError
    with the arithmetic) when nothing fits."""
    from .inspect import PLAN_OPTIONS, _trained_only, live_profile, plan_model

    blocks = find_blocks_of(model, opts)
    if opts.plan is not None:
        n = len(opts.plan.activations)
        if blocks is None or len(blocks) != n:
            raise ValueError(
                f"wrap(): option plan was made for {n} blocks, but this model has "
                f"{0 if blocks is None else len(blocks)}; make it with ramstream.plan_for(model, ...)"
            )
        return opts.plan, None, None
    if device.type != "cuda" or not blocks:
        return None, None, None
    rates = None
    if opts.profile:
        from ..planner import profile_hardware

        try:
            rates = profile_hardware(device)
        except Exception as exc:  # noqa: BLE001 - the default rates take over
            log(f"profile: the hardware profile failed ({exc!r}); planning on the default rates")
    prof = with_disk(live_profile(model, device, rates), opts, log)
    kw = {k: getattr(opts, k) for k in PLAN_OPTIONS}
    if opts.activation_checkpointing == "auto" and hf_checkpointing(blocks):
        kw["activation_checkpointing"] = True  # the layers recompute already: the plan counts it
    from ..planner.result import PlanError

    try:
        with _trained_only(model, optimizer):
            plan, shape = plan_model(
                model, blocks, prof, batch=opts.batch, seq=opts.seq, loss=opts.loss, **kw
            )
    except PlanError as e:
        if not opts.check_memory:
            log(
                f"check_memory=False: no plan fits ({str(e).splitlines()[0]}); going on with the options as given"
            )
            return None, None, None
        usable = prof.vram_free * (1 - opts.vram_headroom) / 2**30
        raise PlanError(
            f"wrap(): the model does not fit in the {usable:.2f} GiB on {device} (usable under any "
            f"per-process cap, less vram_headroom), whatever the step's size; nothing was moved:\n{e}",
            arithmetic=e.arithmetic,
            options=e.options,
        ) from None
    log("plan:\n" + plan.explain())
    if opts.delayed_update is not False:
        _check_delayed(model, optimizer, blocks, prof, opts, kw, plan, log)
    return plan, shape, prof


def _check_delayed(model, optimizer, blocks, prof, opts: WrapOptions, kw: dict, plan, log) -> None:
    """delayed_update: a UserWarning (and the log) when its plan has nothing to delay or the plan
    without it predicts a shorter step (planner/policy.py delayed_verdict)."""
    import warnings

    from ..planner.policy import delayed_verdict
    from ..planner.result import PlanError
    from .inspect import _trained_only, plan_model

    try:
        with _trained_only(model, optimizer):
            plain, _ = plan_model(
                model, blocks, prof, batch=opts.batch, seq=opts.seq, loss=opts.loss,
                **{**kw, "delayed_update": False},
            )  # fmt: skip
    except PlanError:
        return  # without it nothing fits either: nothing to compare
    text = delayed_verdict(plan, plain)
    if text is not None:
        log(text)
        warnings.warn(f"ramstream.wrap(): {text}", UserWarning, stacklevel=4)


def with_disk(prof, opts: WrapOptions, log):
    """nvme_offload="auto" or nvme_weights="auto" with a folder (nvme_dir, else RAMSTREAM_NVME_DIR): the profile with that
    disk's measured rates and free space (planner/measure.py disk_rates), so that the plan may put
    optimizer state there when host RAM is short; the profile as it is otherwise, or when the folder
    cannot be measured (logged; the folder's error is raised when the optimizer state is laid out)."""
    import dataclasses

    from .. import env

    folder = opts.nvme_dir or env.get("RAMSTREAM_NVME_DIR")
    if (opts.nvme_offload != "auto" and opts.nvme_weights != "auto") or not folder:
        return prof
    from ..planner.measure import disk_rates

    try:
        rates = disk_rates(folder)
    except OSError as e:
        log(f"nvme: the disk in {folder!r} could not be measured ({e}); planning without it")
        return prof
    log(
        f"nvme: {rates['disk_dir']}: read {rates['disk_read_gbps']:.2f} GB/s, write "
        f"{rates['disk_write_gbps']:.2f} GB/s, {rates['disk_free'] / 2**30:.1f} GiB free"
    )
    return dataclasses.replace(prof, **rates)


def hf_checkpointing(blocks) -> bool:
    """Whether Hugging Face's gradient checkpointing is on in the blocks (they recompute already)."""
    return any(getattr(b, "gradient_checkpointing", False) for b in blocks)


def plan_record(plan) -> dict:
    """What memory_report(model)["plan"]["planner"] shows of the applied plan."""
    return {
        "mode": plan.mode,
        "batch": plan.shape.get("batch"),
        "seq": plan.shape.get("seq"),
        "streamed": list(plan.weights["streamed"]),
        "recompute": [i for i, m in enumerate(plan.activations) if m == "recompute"],
        "moment_dtype": plan.optimizer["moment_dtype"],
        "loss": plan.shape.get("loss"),
        "predicted_step_s": plan.predicted.get("step_s"),
        "predicted_vram_bytes": plan.memory["vram"].get("total"),
        "vram_budget_bytes": plan.memory["vram"].get("budget"),
        "reasons": list(plan.reasons),
    }


class RecomputeLever:
    """What a re-plan between steps may change on a wrapped model (runtime/tokens.py StepCheck):
    which blocks recompute their activations in backward. recompute() makes more blocks' forwards
    checkpointed (activations/recompute.py; the same forward runs again, so no value changes) and
    keeps memory_report(model)["plan"]["recompute"] true (the session records the revised plan)."""

    def __init__(self, w, blocks: list) -> None:
        self.w, self.blocks = w, blocks

    def recomputed(self) -> list[int]:
        return self.w.recompute.recomputed() if self.w.recompute is not None else []

    def recompute(self, indices: list[int], plan) -> None:
        from ..activations.recompute import Recompute

        w = self.w
        if w.recompute is None:
            w.recompute = Recompute(self.blocks, indices)
        else:
            w.recompute.add(self.blocks, indices)
        if w.keep is not None:  # blocks the keep policy let keep their activations recompute again
            w.keep.kept = [i for i in w.keep.kept if i not in set(indices)]
        w.plan["recompute"] = list(w.recompute.indices)


def restreamable(model, blocks, opts: WrapOptions, plan, use_dp: bool) -> dict | None:
    """{id(parameter): block} of the blocks' own parameters when a re-plan between steps may make
    more blocks stream (a plan applied, param_offload="auto", no delayed_update, no data parallel):
    the engine then lays its buckets out by block (Engine's block_of); None otherwise."""
    if (
        plan is None
        or not blocks
        or opts.param_offload != "auto"
        or use_dp
        or opts.delayed_update is not False
    ):
        return None
    from ..weights.setup import streamed_ids

    return streamed_ids(model, blocks, list(range(len(blocks))), lambda msg: None)


class PageLever:
    """What a re-plan between steps may turn on when every block recomputes and streaming every
    block it may still does not fit: activation paging (wrap()'s activation_offload=True, the
    recomputed blocks' checkpointed inputs paged to host RAM, bit for bit), attached as wrap()
    attaches it (runtime/attach.py attach_paging) and recorded in memory_report(model)."""

    def __init__(self, model, w) -> None:
        self.model, self.w = model, w

    def paging(self) -> bool:
        return self.w.activations is not None

    def page(self) -> None:
        import dataclasses

        from .attach import attach_paging

        w = self.w
        w.options = dataclasses.replace(w.options, activation_offload=True)
        attach_paging(w, self.model, w.options)
        w.plan["activation_offload"] = True


class StreamLever:
    """What a re-plan between steps may change besides the recomputed blocks: which blocks stream
    their weights (engine/restream.py makes their buckets streamed, values unchanged;
    weights/setup.py extend_streamer takes them into the streamer, which loads each only while it
    runs). Keeps memory_report(model)["plan"]["weights"] true, as RecomputeLever the recomputed blocks."""

    def __init__(self, model, w, blocks: list) -> None:
        self.model, self.w, self.blocks = model, w, blocks

    def streamed(self) -> list[int]:
        return sorted(b.index for b in self.w.streamer.blocks) if self.w.streamer is not None else []

    def usable(self) -> bool:
        """False once the optimizer went resident (its state on the device, torch's fused AdamW), or
        with optimizer state on disk (nvme_offload)."""
        opt = self.w.optimizer  # (and not with optimizer state on disk: nvme_offload)
        return opt._resident is None and opt._engine.block_of != {} and opt._engine.disk is None

    def stream(self, indices: list[int], plan) -> dict | None:
        from ..weights.setup import extend_streamer, streamed_ids

        w, engine = self.w, self.w.optimizer._engine
        new = sorted(set(indices) - set(self.streamed()))
        if not new:
            return
        ids = streamed_ids(self.model, self.blocks, new, w.log)
        to_disk = [i for i in plan.weights.get("disk", []) if i in set(new)]
        frozen, on_disk, d = self._frozen_then_trained(engine, new, ids, to_disk)
        if w.streamer is not None and w.streamer.evict_all in engine.on_abandon:
            engine.on_abandon.remove(w.streamer.evict_all)
        w.streamer = extend_streamer(
            w.streamer, self.blocks, new, ids, engine, w.options.weight_window, w.log, frozen, on_disk
        )
        engine.on_abandon.append(w.streamer.evict_all)
        if d is not None and getattr(w, "disk_weights", None) is None:  # opened now: the streamer owns it
            w.handles += d.attach(self.model, w.streamer, w.optimizer)
            w.disk_weights = d
        elif d is not None:
            d.streamer = w.streamer
            w.handles += d.hook(self.blocks, on_disk)
        self._log_disk(new, ids, on_disk, d)
        idx = self.streamed()
        w.plan["weights"] = {
            "streamed": idx,
            "resident": [i for i in range(len(self.blocks)) if i not in set(idx)],
            **w.streamer.home_bytes(),
        }
        return (
            {"blocks": sorted(on_disk), "store": "opened" if d.opened_mid_run else "grown"}
            if on_disk
            else None
        )

    def _log_disk(self, new: list[int], ids: dict, on_disk: dict, d) -> None:
        """The log's line for the new blocks' frozen weights: on disk, or kept in RAM and why."""
        from ..planner.disk_weights import reason_in_ram
        from .disk_weights import folder_of, frozen_tensors

        if on_disk:
            nbytes = sum(s.nbytes for ss in on_disk.values() for s in ss)
            how = (
                "the disk store opened now (wrap() put no block on disk), its file created 0600 and removed "
                "at unwrap()"
                if d.opened_mid_run and set(on_disk) == set(d.indices)
                else "more, a second file"
            )
            self.w.log(
                f"nvme_weights: blocks {_ranges(sorted(on_disk))} start streaming with their frozen weights on "
                f"disk in {d.folder} ({nbytes / 2**30:.3f} GiB, {how}; staging ring "
                f"{d.store.staging_bytes() / 2**30:.3f} GiB)"
            )
        ram = [k for k in new if k not in on_disk and frozen_tensors(self.blocks[k], k, ids)]
        if ram and (d is not None or self.w.options.nvme_weights is not False):
            why = reason_in_ram(self.w.options.nvme_weights, d is not None, bool(folder_of(self.w.options)))
            self.w.log(
                f"nvme_weights: blocks {_ranges(ram)} start streaming with their frozen weights in RAM: {why}"
            )

    def _frozen_then_trained(self, engine, new: list[int], ids: dict, to_disk: list[int]) -> tuple:
        """The new blocks' frozen weights (on disk for those in `to_disk`, with the run's disk store:
        runtime/disk_weights.py extend; pinned slabs for the others), then their trained buckets
        (engine/restream.py). A run without a disk store opens one for `to_disk` (runtime/disk_weights.py
        open_mid_run). Returns ({index: pinned slabs}, {index: [DiskSlab]}, the run's DiskBlocks or
        None). When host memory or the disk refuses any of it, the frozen weights already moved go
        back where they were (a store opened here is closed) and the error (MemoryError, or the
        disk's OSError naming the folder) says what was asked; nothing else changed."""
        from ..engine.restream import stream_buckets
        from ..weights.setup import block_frozen_slabs, make_copier
        from .disk_weights import open_mid_run

        if engine.copier is None:
            engine.copier = make_copier(engine.device)
        d = getattr(self.w, "disk_weights", None)
        if not to_disk:
            on_disk, undo = {}, None
        elif d is None:
            d, on_disk, undo = open_mid_run(self.w.options, self.blocks, to_disk, ids, engine)
        else:
            on_disk, undo = d.extend(self.blocks, to_disk, ids)
        made: dict = {}
        try:
            for k in new:
                if k not in on_disk:
                    made[k] = block_frozen_slabs(self.blocks, k, ids, engine)
            stream_buckets(engine, ids)
        except (RuntimeError, MemoryError) as e:
            for slabs in made.values():
                for s in slabs:
                    s.load()
                    s.wait()
            if undo is not None:
                d.undo(undo)
            if isinstance(e, MemoryError):
                raise
            raise MemoryError(
                f"ramstream: streaming blocks {_ranges(new)}: host memory refused ({e})"
            ) from None
        return made, on_disk, d


def disk_applied(w, n: int) -> tuple:
    """The run's frozen-weight placement for a re-plan between steps (plan_training's _disk_applied):
    (blocks whose frozen weights are on disk, blocks whose place is fixed: the streamed ones; every
    block when the run has no disk store and none may be opened: no folder, or an nvme_weights that
    named wrap()'s blocks; runtime/disk_weights.py open_mid_run opens one otherwise)."""
    from .disk_weights import folder_of

    d = getattr(w, "disk_weights", None)
    streamed = tuple(sorted(b.index for b in w.streamer.blocks)) if w.streamer is not None else ()
    if d is not None:
        return tuple(sorted(d.indices)), streamed
    if folder_of(w.options) and (w.options.nvme_weights is True or w.options.nvme_weights == "auto"):
        return (), streamed
    return (), tuple(range(n))


def blocks_owner(model, first):
    """The module whose forward runs the block stack (a Hugging Face model's decoder, LlamaModel:
    what the chunked loss and peft call; the model itself for a GPT whose blocks are its own
    ModuleList); None when `first` is not inside `model` or is the model."""
    names = {id(m): n for n, m in model.named_modules()}
    name = names.get(id(first))
    if not name:
        return None
    parts = name.split(".")
    parent = model.get_submodule(".".join(parts[:-1]))
    if isinstance(parent, torch.nn.ModuleList | torch.nn.Sequential) and len(parts) > 1:
        parent = model.get_submodule(".".join(parts[:-2]))
    return parent


def _record_plan(w, plan) -> None:
    """The session's record of a revised plan: memory_report(model)["plan"]["planner"]."""
    w.applied_plan = plan
    w.plan["planner"] = plan_record(plan)


def _record_loss(w, loss: str) -> None:
    """The loss the session's plan counts now: memory_report(model)["plan"]["planner"]["loss"]."""
    if isinstance(w.plan.get("planner"), dict):
        w.plan["planner"]["loss"] = loss


def head_weights(model, shape) -> list:
    """The model's parameters shaped as its head ([vocab, hidden]: the head, an embedding tied to
    it), what a chunked loss is given."""
    if shape is None or not shape.vocab or not shape.hidden:
        return []
    want = (shape.vocab, shape.hidden)
    seen, out = set(), []
    for p in model.parameters():
        if p.dim() == 2 and tuple(p.shape) == want and id(p) not in seen:
            seen.add(id(p))
            out.append(p)
    return out


def _state_mover(opt):
    """The StepCheck's state callback when the optimizer state started in VRAM (a resident plan),
    else None."""
    if not any(b.placement == "device" for b in opt._engine.buckets):
        return None
    from .optimizer_split import fit_state_to

    return lambda plan: fit_state_to(opt, plan)


def check_steps(model, w, plan, shape, prof, opts: WrapOptions, log) -> None:
    """A step larger than the plan's is checked at its first forward (runtime/tokens.py); with
    activation_checkpointing="auto" one that does not fit makes more blocks recompute."""
    from . import measure
    from .tokens import StepCheck

    n = len(plan.activations)
    if n == 0:
        return
    blocks = find_blocks_of(model, opts)  # the first block sees every step, whatever runs the model
    hf = hf_checkpointing(blocks)
    fixed = {
        "param_offload": list(plan.weights["streamed"]),
        # Hugging Face's gradient checkpointing recomputes every block (the plan counted it)
        "activation_checkpointing": True
        if hf
        else (list(w.recompute.indices) if w.recompute is not None else False),
        "activation_offload": opts.activation_offload,
        "optimizer_mode": opts.optimizer_mode,
        "moment_dtype": plan.optimizer["moment_dtype"],
        "vram_headroom": opts.vram_headroom,
        "max_activation_slowdown": opts.max_activation_slowdown,
        # the disk tier as applied: the optimizer state's share; the frozen weights by the option,
        # the run's placement read at each re-plan (disk_applied)
        "nvme_offload": plan.optimizer.get("nvme_share", 0.0),
        "nvme_weights": opts.nvme_weights,
        "accumulation_steps": opts.accumulation_steps,
        "delayed_update": opts.delayed_update,
    }
    lever, why = None, ""
    if hf:
        why = "; every block recomputes already (Hugging Face's gradient checkpointing)"
    elif opts.activation_checkpointing != "auto":
        why = (
            f"; activation_checkpointing={opts.activation_checkpointing!r} was given, so the recomputed "
            'blocks do not change ("auto" lets a larger step make more blocks recompute)'
        )
    else:
        lever = RecomputeLever(w, blocks)
    paging = opts.activation_offload is True or isinstance(opts.activation_offload, float)
    streams = None
    if lever is not None and w.optimizer._engine.block_of:  # laid out by block: restreamable()
        streams = StreamLever(model, w, blocks)
    # activation_offload=False (the default) may become paging when nothing else fits a step
    pages = PageLever(model, w) if lever is not None and opts.activation_offload is False else None
    check = StepCheck(
        shape, prof, fixed, log, w.optimizer._session, strict=not paging, lever=lever, fixed_why=why,
        streams=streams, pages=pages, on_plan=lambda p: _record_plan(w, p), disk=lambda: disk_applied(w, n),
        loss_given=opts.loss is not None, on_loss=lambda loss: _record_loss(w, loss),
        ooms=lambda dev=w.optimizer._engine.device: measure.oom_count(dev),
        state=_state_mover(w.optimizer),
    )  # fmt: skip
    if opts.loss is None:  # a chunked loss given the head tells the check (runtime/heads.py)
        from . import heads
        from .loss_oom import guard_forward

        for p in head_weights(model, shape):
            heads.register(p, check)
        # a dense loss's out-of-memory error in a step planned with a chunked loss is explained
        w.handles.append(guard_forward(model, check))
    # first of the block's pre-hooks: a refused step loads, waits for and touches nothing; the
    # model's own pre-hook sees the step before any block ran (when the model itself is called)
    w.handles.append(blocks[0].register_forward_pre_hook(check, with_kwargs=True, prepend=True))
    owner = blocks_owner(model, blocks[0])
    if owner is not None:
        w.handles.append(owner.register_forward_pre_hook(check.before_blocks, with_kwargs=True, prepend=True))
