"""Optimizer state in torch's AdamW format: export from where it lives, import into it.

Exported: {"state": {i: {"step": float32 scalar, "exp_avg": fp32, "exp_avg_sq": fp32,
"master": fp32 copy of the master weight (a bf16/fp16 model resumes bit-exactly from it)}},
"param_groups": [{...hyper-parameters..., "params": [i, ...]}]}, keyed by the position of each
parameter in param_groups order, exactly as torch.optim.AdamW.state_dict() does, so either
loads into the other (torch's AdamW keeps "master" in its state and never reads it). The state lives in the engine's flat host buffers, or on the device after
the resident switch.
"""

from __future__ import annotations

import math

import torch

from .disk_tier import Paging
from .layout import weights_flat


def _slot_tensors(opt, s, gathered=None) -> tuple[int, torch.Tensor | None, torch.Tensor | None]:
    """(step, exp_avg view, exp_avg_sq view) of a slot, wherever they live (None: another
    data-parallel rank holds them and `gathered` has no copy)."""
    r = opt._resident
    if r is not None:
        st = r.state[s.index]
        return int(st["step"].item()), st["exp_avg"], st["exp_avg_sq"]
    b = s.bucket
    m, v = (b.exp_avg, b.exp_avg_sq) if gathered is None else gathered[b.index]
    if m is None:
        return s.step, None, None
    sl = slice(s.offset, s.offset + s.numel)
    return s.step, m[sl].view(s.param.shape), v[sl].view(s.param.shape)


def gather_bucket_state(engine, names=("exp_avg", "exp_avg_sq")) -> dict | None:
    """Data parallel: every rank receives each bucket's state from its owner, in bucket order
    (a collective: all ranks must call it together). None without data parallel."""
    if engine.dp is None:
        return None
    out = {}
    for b in engine.buckets:
        like = [
            torch.empty(b.numel, dtype=torch.float32 if n == "master" else engine.moment_dtype) for n in names
        ]
        out[b.index] = engine.dp.state_from_owner(b, [getattr(b, n) for n in names], like)
    return out


def _slot_master(opt, s, gathered=None) -> torch.Tensor:
    """A copy of the slot's fp32 master on the host, shaped like the parameter."""
    from .layout import master_flat

    if opt._resident is not None:
        m = opt._resident.masters[s.index].detach().reshape(-1)
    else:
        m = master_flat(s.bucket) if gathered is None else gathered[s.bucket.index][0]
        m = m[s.offset : s.offset + s.numel]
    return m.to("cpu", torch.float32, copy=True).view(s.param.shape)


def export_state(opt, param_groups: list[dict]) -> dict:
    opt.synchronize()
    e = opt._engine
    gathered = gather_bucket_state(e) if opt._resident is None else None
    masters = gather_bucket_state(e, ("master",)) if opt._resident is None else None
    state = {}
    with Paging() as page:  # a bucket whose state is on disk: paged in, its tensors copied
        for s in e.slots:
            if opt._resident is None and gathered is None:
                page(s.bucket)
            step, m, v = _slot_tensors(opt, s, gathered)
            if step == 0:
                continue
            copy = opt._resident is None and s.bucket.disk is not None  # not views of a staging buffer
            state[s.index] = {
                "step": torch.tensor(float(step), dtype=torch.float32),
                "exp_avg": m.float() if m.dtype != torch.float32 else m.clone() if copy else m,
                "exp_avg_sq": v.float() if v.dtype != torch.float32 else v.clone() if copy else v,
                "master": _slot_master(opt, s, masters),
            }
    groups = []
    index = 0
    for g in param_groups:
        entry = {k: v for k, v in g.items() if k != "params"}
        entry["params"] = list(range(index, index + len(g["params"])))
        index += len(g["params"])
        groups.append(entry)
    return {"state": state, "param_groups": groups}


def _set_step(opt, s, step: int) -> None:
    if opt._resident is not None:
        opt._resident.state[s.index]["step"].fill_(float(step))
    else:
        s.step = step


def _set_master(opt, s, master: torch.Tensor) -> bool:
    """The fp32 master becomes `master` exactly when the weight is its rounding (the model's
    weights loaded from the same checkpoint); otherwise it is stale (say, kept by a torch AdamW
    that trained on) and the master stays as it is: False."""
    src = master.detach().reshape(-1)
    if src.dtype != torch.float32:
        src = src.float()
    if opt._resident is not None:
        m = opt._resident.masters[s.index]
        weight = s.param.detach().reshape(-1)
    else:
        b, sl = s.bucket, slice(s.offset, s.offset + s.numel)
        m, weight = b.master, weights_flat(b)[sl]  # no b.master: the weights are the master
        m = m[sl] if m is not None else None
    if not torch.equal(weight, src.to(weight.device, weight.dtype)):
        return False
    if m is not None:
        m.copy_(src.view(m.shape))
    return True


def _saved_step(pid, step) -> int:
    v = step.item() if torch.is_tensor(step) and step.numel() == 1 else step
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0:
        raise ValueError(
            f"load_state_dict: 'step' of parameter {pid} must be a non-negative number, got {step!r}"
        )
    return int(v)


def check_state(opt, param_groups: list[dict], sd: dict) -> list:
    """import_state's checks, changing nothing: [(slot, its saved state)] for the slots to load.
    ValueError when `sd` does not match the optimizer (load_checkpoint calls it before it installs
    anything, so that a load is all-or-nothing)."""
    if not isinstance(sd, dict) or "state" not in sd or "param_groups" not in sd:
        raise ValueError("load_state_dict: expected a dict with 'state' and 'param_groups'")
    saved_groups = sd["param_groups"]
    if not isinstance(saved_groups, (list, tuple)) or not isinstance(sd["state"], dict):
        raise ValueError("load_state_dict: 'param_groups' must be a list and 'state' a dict")
    if len(saved_groups) != len(param_groups):
        raise ValueError(
            f"load_state_dict: the state dict has {len(saved_groups)} param groups, "
            f"the optimizer {len(param_groups)}"
        )
    for i, (sg, g) in enumerate(zip(saved_groups, param_groups)):
        if not isinstance(sg, dict) or not isinstance(sg.get("params"), (list, tuple)):
            raise ValueError(f"load_state_dict: param group {i} must be a dict with a 'params' list")
        if (
            sg.get("amsgrad")
            or sg.get("maximize")
            or (sg.get("decoupled_weight_decay", True) is False and sg.get("weight_decay", 0))
        ):
            raise ValueError(
                f"load_state_dict: param group {i} is saved with amsgrad, maximize or "
                "Adam's L2 weight decay, which ramstream's AdamW does not do"
            )
        if len(sg["params"]) != len(g["params"]):
            raise ValueError(
                f"load_state_dict: param group {i} has {len(sg['params'])} parameters "
                f"in the state dict, {len(g['params'])} in the optimizer"
            )
    id_map = {}  # saved ids -> positional indices (torch keys state by the ids in param_groups)
    for sg in saved_groups:
        for pid in sg["params"]:
            id_map[pid] = len(id_map)
    by_index = {s.index: s for s in opt._engine.slots}
    staged = []
    for pid, st in sd["state"].items():
        if pid not in id_map:
            raise ValueError(f"load_state_dict: state for unknown parameter id {pid!r}")
        s = by_index.get(id_map[pid])
        if s is None:
            continue  # an empty parameter: nothing to load
        if not isinstance(st, dict):
            raise ValueError(f"load_state_dict: the state of parameter {pid} must be a dict")
        for key in ("exp_avg", "exp_avg_sq", "step"):
            if key not in st:
                raise ValueError(
                    f"load_state_dict: parameter {pid} has no '{key}' (only AdamW state can be loaded)"
                )
        for key in ("exp_avg", "exp_avg_sq", "master"):
            if key == "master" and key not in st:
                continue  # torch's AdamW state: the masters stay as they are
            if not torch.is_tensor(st[key]) or not st[key].is_floating_point():
                raise ValueError(
                    f"load_state_dict: '{key}' of parameter {pid} must be a floating-point tensor"
                )
            if st[key].numel() != s.numel:
                raise ValueError(
                    f"load_state_dict: '{key}' of parameter {pid} has "
                    f"{st[key].numel()} elements, the parameter {s.numel}"
                )
        _saved_step(pid, st["step"])
        staged.append((s, st))
    return staged


def import_state(opt, param_groups: list[dict], sd: dict) -> None:
    """Loads a torch-format AdamW state dict (ours or torch's); ValueError when it does not match
    (check_state), and then nothing has changed."""
    staged = check_state(opt, param_groups, sd)
    slots = opt._engine.slots
    saved_groups = sd["param_groups"]
    opt.synchronize()  # nothing is changed before every entry was checked
    stale = []
    page = Paging(write=True)  # a bucket whose state is on disk: paged in, written back
    with torch.no_grad(), page:
        for s, st in sorted(staged, key=lambda x: (x[0].bucket.index, x[0].offset)):
            if opt._resident is None:
                page(s.bucket)
            _, m, v = _slot_tensors(opt, s)
            if m is None:  # another data-parallel rank owns this state
                _set_step(opt, s, _saved_step(None, st["step"]))
                if "master" in st and not _set_master(opt, s, st["master"]):
                    stale.append(s)
                continue
            for src, dst in ((st["exp_avg"], m), (st["exp_avg_sq"], v)):
                src = src.detach().reshape(dst.shape)
                if src.data_ptr() != dst.data_ptr():
                    dst.copy_(src)
            _set_step(opt, s, _saved_step(None, st["step"]))
            if "master" in st and not _set_master(opt, s, st["master"]):
                stale.append(s)
        loaded = {s.index for s, _ in staged}
        for s in slots:
            if s.index not in loaded:
                if opt._resident is None:
                    page(s.bucket)
                _, m, v = _slot_tensors(opt, s)
                if m is not None:
                    m.zero_()
                    v.zero_()
                _set_step(opt, s, 0)
    if stale:  # logged, not warned: loading the optimizer before the model is common and fine
        opt._log(
            f"load_state_dict: the 'master' of {len(stale)} parameters is ignored: the model's "
            "weights are not its rounding (a stale master, or the model's state dict not loaded "
            "yet: its load then sets the masters); those masters stay"
        )
    for sg, g in zip(saved_groups, param_groups):
        for k, v in sg.items():
            if k != "params":
                g[k] = v
        g["decoupled_weight_decay"] = True
