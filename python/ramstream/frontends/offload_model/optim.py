"""ramstream's host optimizer for an OffloadModel (`model.optimizer(...)`): the offload engine's
AdamW (engine/: buckets, gradient intake, updater, worker) over the model's chunks, overlapping
each streamed chunk's host update with the rest of the backward pass.

One mechanism, three front ends: wrap(param_offload=...) and this one build the same Engine with
`streamed` = {id(parameter): chunk}; the engine's streamed buckets are the chunks' slabs of trained
parameters (their weights at home in pinned host memory), so the host AdamW writes each chunk's
new weights into the home copy its next load reads, and that load waits for the update (the
chunk's Block.ready). Pinned (resident) chunks' parameters are ordinary host buckets: gradients
land in pinned memory, the host AdamW updates the fp32 master, the new weights go back by H2D
copy, and the chunk's forward waits for them. Frozen parameters stay slabs of the model's own.
"""

from __future__ import annotations

import warnings
import weakref

import torch

from ...optim import OffloadAdamW

_OPTIONS = (
    "moment_dtype",
    "accumulation_steps",
    "max_grad_norm",
    "skip_nonfinite",
    "eager_updates",
    "delayed_update",
    "threads",
    "bucket_bytes",
)


class OffloadModelAdamW(OffloadAdamW):
    """The host optimizer of one OffloadModel (built by `OffloadModel.optimizer()`): an
    OffloadAdamW (torch.optim.Optimizer: param groups, LR schedulers, torch-format state dicts)
    whose engine takes the gradients of its parameters during `model.step()` (they never become
    `.grad`) and whose updates the model's loads wait for. close() gives the model back its own
    gradient write-back (a torch optimizer over model.parameters() works again)."""

    _model_ref = None  # weakref to the OffloadModel while attached

    def close(self) -> None:
        if self._closed:
            return
        model = self._model_ref() if self._model_ref is not None else None
        if model is not None and model._hooks.host_opt is self:
            model._release_host_optimizer()  # closes the engine first, then rebuilds the model
            return
        super().close()


def param_groups(model, params, where: str = "OffloadModel.optimizer") -> list[dict]:
    """The param groups of model.optimizer(params): None means every parameter of the model
    (one group; frozen ones get no state); otherwise parameters or param-group dicts, as
    torch.optim.AdamW takes them, all of the model. where: the caller's name in the errors."""
    if params is None:
        groups = [{"params": list(model.parameters())}]
    else:
        if torch.is_tensor(params) or isinstance(params, dict):
            raise TypeError(
                f"{where}: params must be an iterable of parameters or of param-group "
                f"dicts (as torch.optim.AdamW takes), got {type(params).__name__}"
            )
        try:
            items = list(params)
        except TypeError:
            raise TypeError(
                f"{where}: params must be None or an iterable of parameters or of "
                f"param-group dicts (as torch.optim.AdamW takes), got {type(params).__name__}"
            ) from None
        if not items:
            raise ValueError(f"{where}: params is empty")
        if all(isinstance(g, dict) for g in items):
            groups = items  # the same dicts (as torch): an LR scheduler made on them keeps working
            for i, g in enumerate(groups):
                if "params" not in g:
                    raise ValueError(f"{where}: param group {i} has no 'params'")
                ps = g["params"]
                g["params"] = [ps] if torch.is_tensor(ps) else list(ps)
        elif any(isinstance(g, dict) for g in items):
            raise TypeError(f"{where}: params mixes parameters and param-group dicts")
        else:
            groups = [{"params": items}]
    mine = {id(p) for p in model.parameters()}
    for i, g in enumerate(groups):
        for p in g["params"]:
            if not isinstance(p, torch.nn.Parameter):
                raise TypeError(f"{where}: param group {i} holds a {type(p).__name__}, not an nn.Parameter")
            if id(p) not in mine:
                raise ValueError(
                    f"{where}: param group {i} holds a parameter of shape "
                    f"{tuple(p.shape)} that is not one of this model's"
                )
    if not any(p.requires_grad for g in groups for p in g["params"]):
        raise ValueError(f"{where}: none of the given parameters requires grad")
    return groups


def streamed_optimizer(cls, groups, hyper: dict, device, order: list, streamed: dict, options: dict):
    """The host optimizer (cls: an OffloadAdamW subclass) whose engine's buckets of the `streamed`
    parameters ({id(parameter): block number}) are slabs at home in pinned memory, updated on the
    host; no gradient gathered yet (each parameter's `.grad` None). Shared by OffloadModel's and
    the Pipeline's optimizer()."""
    opt = cls(
        groups,
        **hyper,
        device=device,
        mode="cpu",
        offload=True,
        guard_params=True,
        _order=order,
        _streamed=streamed,
        **options,
    )
    for s in opt._engine.slots:
        s.param.grad = None  # the optimizer starts with no gradient gathered
    return opt


def build(model, params, *, lr, betas, eps, weight_decay, **options) -> OffloadModelAdamW:
    """model.optimizer(...): the engine over the model's chunks, wired into its streamer."""
    unknown = sorted(set(options) - set(_OPTIONS))
    if unknown:
        raise ValueError(
            f"OffloadModel.optimizer: unknown option(s) {', '.join(unknown)}; accepted: {', '.join(_OPTIONS)}"
        )
    groups = param_groups(model, params)
    chunk_of = {id(p): i for i, c in enumerate(model.chunks) for p in c.parameters()}
    pinned = set(model.pinned)
    streamed = {
        id(p): chunk_of[id(p)]
        for g in groups
        for p in g["params"]
        if p.requires_grad and p.numel() > 0 and chunk_of[id(p)] not in pinned
    }
    model._teardown()  # the trained parameters' slabs become the engine's buckets
    hyper = dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay)
    try:
        opt = streamed_optimizer(
            OffloadModelAdamW, groups, hyper, model.device, list(model.parameters()), streamed, options
        )
    except BaseException:
        model._build(pinned)  # as it was: its own slabs and gradient write-back
        raise
    engine = opt._engine
    opt._model_ref = weakref.ref(model)
    model._build(pinned, engine=engine)
    engine.attach_forward_waits(model)
    model._hooks.host_opt = opt
    # model.state_dict() reads the current weights; model.load_state_dict() resets the masters
    model._hooks.opt_handles = [
        model.register_state_dict_pre_hook(lambda *a, **k: opt.synchronize()),
        model.register_load_state_dict_pre_hook(
            lambda module, sd, prefix, *a: engine.note_loading(sd, prefix)
        ),
        model.register_load_state_dict_post_hook(lambda module, keys: opt._model_loaded(module)),
    ]
    return opt


def streamed_blocks(engine) -> dict[int, list]:
    """{chunk index: the engine's streamed buckets of that chunk} (empty without an engine)."""
    out: dict[int, list] = {}
    if engine is None:
        return out
    for b in engine.buckets:
        if b.streamed:
            out.setdefault(engine.streamed[id(b.slots[0].param)], []).append(b)
    return out


def step_failed(opt) -> None:
    """model.step() raised. Before its backward nothing was gathered or updated (a backward the
    engine refused at its first gradient, one micro-batch too many, keeps the earlier ones).
    Inside its backward the engine drops what was gathered since the last opt.step() (it cannot
    tell the failed pass's share of a host sum from the earlier micro-batches'); updates that
    already ran during the failed backward (eager updates) stay, and the engine warns."""
    e = opt._engine
    for s in e.slots:  # a gradient the engine did not take (its hook raised) is the failed pass's
        s.param.grad = None
    if not e.intake.in_backward:
        return
    earlier = e.intake.micro
    stepped = any(s.updated for s in e.slots)
    e.recover_if_abandoned()
    if earlier and not stepped:  # (with updates that ran, the engine warned)
        warnings.warn(
            f"ramstream: OffloadModel.step raised in its backward: the gradients of the {earlier} "
            "earlier micro-batch(es) since the last opt.step() were dropped with it (weights and "
            "optimizer state are unchanged)",
            RuntimeWarning,
            stacklevel=4,
        )


_WRAP_OPTIONS = ("lr", *_OPTIONS)


def wrap_offload_model(model, optimizer, options: dict) -> OffloadModelAdamW:
    """ramstream.wrap(offload_model, optimizer, **options): the host optimizer over the given
    optimizer's param groups (the same dicts: its LR schedulers keep working) and state, as
    wrap() converts one; options: lr (when optimizer is None) and model.optimizer()'s."""
    bad = sorted(set(options) - set(_WRAP_OPTIONS))
    if bad:
        raise ValueError(
            f"wrap(): option(s) {', '.join(bad)} do not apply to an OffloadModel (it streams its own "
            f"chunks); accepted with an OffloadModel: {', '.join(_WRAP_OPTIONS)}"
        )
    if isinstance(optimizer, OffloadModelAdamW):
        raise ValueError("wrap(): the optimizer is already an OffloadModel's host optimizer")
    from ...options import WrapOptions
    from ...runtime.convert import _convert_optimizer, _hand_over

    opts = WrapOptions.parse(**{k: v for k, v in options.items() if k == "lr"})
    groups, state, _ = _convert_optimizer(optimizer, model, opts)
    g0 = groups[0]
    opt = model.optimizer(
        groups,
        lr=g0.get("lr", opts.lr),
        betas=g0.get("betas", (0.9, 0.999)),
        eps=g0.get("eps", 1e-8),
        weight_decay=g0.get("weight_decay", 1e-2),
        **{k: v for k, v in options.items() if k != "lr"},
    )
    if state is not None:
        opt.load_state_dict(state)
    if isinstance(optimizer, torch.optim.Optimizer):
        _hand_over(optimizer, opt)
    return opt
