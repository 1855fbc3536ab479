"""OffloadAdamW's extras, out of optim.py: master_weights(), stats() and attach()."""

from __future__ import annotations

import torch

from . import trainstream_args as _ts_args


def master_weights(opt) -> list[torch.Tensor]:
    """Copies of the fp32 master weights, one per parameter in param_groups order (shaped like the
    parameter); a bucket whose state is on disk is paged in to copy them."""
    from .engine.disk_tier import Paging
    from .engine.layout import master_flat
    from .engine.state import gather_bucket_state

    opt.synchronize()
    e = opt._engine
    gathered = gather_bucket_state(e, ("master",)) if opt._resident is None else None
    by_index = {s.index: s for s in e.slots}
    out, i = [], 0
    with Paging() as page:
        for g in opt.param_groups:
            for p in g["params"]:
                s = by_index.get(i)
                if s is None:
                    out.append(p.detach().float().cpu().clone())
                elif opt._resident is not None:
                    out.append(opt._resident.masters[i].detach().float().cpu().clone())
                else:
                    if gathered is None:
                        page(s.bucket)
                    master = master_flat(s.bucket) if gathered is None else gathered[s.bucket.index][0]
                    out.append(master[s.offset : s.offset + s.numel].view(p.shape).to("cpu", copy=True))
                i += 1
    return out


def stats(opt) -> dict:
    """The engine's counters, TrainStream's names, and with nvme_offload the disk tier's:
    nvme_state_bytes, nvme_buckets, nvme_bytes_read / nvme_bytes_written (since wrap(), the first
    write of the state included), nvme_step_bytes_read / nvme_step_bytes_written (the last step:
    the SSD wear figure), nvme_staging_bytes, nvme_direct, nvme_dir."""
    e = opt._engine
    s = dict(e.stats)
    s.update(_ts_args.stats_names(opt, s))
    if getattr(e, "disk", None) is not None:
        s.update(e.disk.stats())
    return s


def attach(opt, model: torch.nn.Module, guard: bool = True):
    """OffloadAdamW.attach's body: hooks `model` in place as wrap() does; returns `opt`."""
    if not isinstance(guard, bool):
        raise ValueError(f"OffloadAdamW.attach: guard={guard!r}; accepted: True, False")
    from .options import WrapOptions
    from .report import EventLog
    from .runtime.attach import attach_model

    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"OffloadAdamW.attach: model must be a torch.nn.Module, got {type(model).__name__}")
    if opt._closed or opt._resident is not None or opt._engine.forward_waits:
        raise RuntimeError("OffloadAdamW.attach: the optimizer is closed, resident or already attached")
    if getattr(model, "_ramstream", None) is not None:
        raise ValueError(
            "OffloadAdamW.attach: this model is already wrapped; call ramstream.unwrap(model) first"
        )
    mine = {id(s.param) for s in opt._engine.slots}
    if not mine <= {id(p) for p in model.parameters()}:
        raise ValueError("OffloadAdamW.attach: the model does not hold this optimizer's parameters")
    opts = WrapOptions.parse(max_grad_norm=opt._max_grad_norm, accumulation_steps=opt._accumulation_steps)
    log = EventLog(False)
    opt._log = log
    recompute = None
    if opt._engine.device.type == "cuda":  # the plan's recompute (the weights are placed already)
        from .runtime.apply import make_plan

        plan, _, _ = make_plan(model, opt, WrapOptions.parse(param_offload=False), opt._engine.device, log)
        if plan is not None:
            recompute = [i for i, m in enumerate(plan.activations) if m == "recompute"]
    attach_model(model, opt, opts, log, recompute=recompute)
    if not guard and opt._engine.guard_params:
        from .engine import guard as _guard

        for sl in opt._engine.slots:
            _guard.unguard(sl.param)
        opt._engine.guard_params = False
    log(f"attached: {len(opt._engine.slots)} parameters in {len(opt._engine.buckets)} buckets")
    return opt
