"""save_checkpoint / load_checkpoint: model, optimizer and extras in one folder, atomically, no pickle.

A checkpoint folder holds
  model.safetensors      the model's state dict; tied tensors (one tensor under several names,
                         such as a tied embedding and LM head) are stored once, the other names
                         recorded in the file's metadata ("ramstream_ties")
  optimizer.safetensors  the optimizer's tensors, named "state.<param id>.<key>"
  optimizer.json         the rest of the optimizer's state dict (param groups, steps)
  extra.safetensors, extra.json   the **extra given to save_checkpoint
  meta.json              format, version, and "complete": true
It is written in a temporary folder beside `path` and renamed to `path` only when complete; an
existing checkpoint at `path` is exchanged with the new one in one rename (renameat2
RENAME_EXCHANGE where the kernel offers it, else two renames) and then removed. An interrupted
save leaves the previous checkpoint as it was and at most a hidden `.<name>.tmp-<pid>-*` folder
without meta.json, which the next save removes.

Under data parallel (an OffloadAdamW wrapped with distributed=True) save_checkpoint is a
collective: every rank calls it with the same path (one machine or a shared file system). Rank 0
makes the temporary folder and writes the model, extra and optimizer.json (param groups,
"shards": world size); each rank writes the state of the buckets it owns to
optimizer-<rank>-of-<world>.safetensors/.json, so no rank gathers the others' state; rank 0 writes
meta.json and publishes once every rank has succeeded. load_checkpoint merges the shards (memory-
mapped), so the checkpoint loads into any number of ranks, or one process.

ramstream.OffloadAdamW's state (torch's AdamW format plus the fp32 masters) is written from the
engine's host buffers one tensor at a time, without building its state dict first: saving holds
no second copy of the host state. Moments are stored in their own dtype (bf16 moments as bf16), so
loading restores them exactly.
"""

from __future__ import annotations

import ctypes
import json
import os
import shutil
import tempfile

import torch

from ._checkpoint_read import FORMAT, VERSION, read_extra, read_meta, read_model, read_optimizer, shard_name
from ._tensorfile import entry, fsync_dir, write_json, write_safetensors

__all__ = ["save_checkpoint", "load_checkpoint"]


def _check_args(where: str, path, model, optimizer) -> str:
    if not isinstance(path, (str, os.PathLike)):
        raise TypeError(f"{where}: path must be a str or os.PathLike, got {type(path).__name__}")
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"{where}: model must be a torch.nn.Module, got {type(model).__name__}")
    if optimizer is not None and not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(
            f"{where}: optimizer must be a torch.optim.Optimizer or None, got {type(optimizer).__name__}"
        )
    return os.path.abspath(os.fspath(path))


# ---- the model -----------------------------------------------------------------------------------
def _tensor_key(t: torch.Tensor) -> tuple:
    return (t.device, t.dtype, t.data_ptr(), tuple(t.shape), tuple(t.stride()))


def _save_model(folder: str, model: torch.nn.Module) -> None:
    sd = model.state_dict()  # a wrapped model waits for its pending updates first
    first: dict = {}
    ties: dict[str, str] = {}
    entries = []
    for name, t in sd.items():
        if not torch.is_tensor(t):
            raise TypeError(f"save_checkpoint: model state {name!r} is a {type(t).__name__}, not a tensor")
        key = _tensor_key(t)
        if t.numel() and key in first:
            ties[name] = first[key]
            continue
        first[key] = name
        entries.append(entry(name, t))
    meta = {"format": FORMAT, "ramstream_ties": json.dumps(ties, sort_keys=True)}
    write_safetensors(os.path.join(folder, "model.safetensors"), entries, meta)


# ---- the optimizer -------------------------------------------------------------------------------
def _groups_json(param_groups: list[dict], ids: list[list]) -> list[dict]:
    out = []
    for g, params in zip(param_groups, ids):
        entry_ = {}
        for k, v in g.items():
            if k == "params":
                continue
            if torch.is_tensor(v):
                v = v.item()
            if isinstance(v, tuple):
                v = list(v)
            entry_[k] = v
        entry_["params"] = list(params)
        out.append(entry_)
    return out


def _offload_entries(opt, owned_only: bool = False, page=None) -> tuple[list, dict]:
    """OffloadAdamW: (entries, json state) read from where the state lives, tensor by tensor;
    owned_only: under data parallel, the slots of the buckets this rank owns. page: a
    disk_tier.Paging, open while the entries are written: a bucket whose state is on disk is
    paged in when its first tensor is written (one bucket at a time), its tensors copied."""
    from .engine.layout import master_flat
    from .engine.state import _slot_tensors

    opt.synchronize()
    e = opt._engine
    entries, steps = [], {}
    for s in e.slots:
        if opt._resident is None and s.bucket.disk is not None:
            if s.step > 0:
                steps[str(s.index)] = {"step": float(s.step)}
                entries += _disk_entries(s, page, e.moment_dtype)
            continue
        step, m, v = _slot_tensors(opt, s)
        if step == 0 or (owned_only and m is None):  # m None: another rank owns the bucket
            continue
        steps[str(s.index)] = {"step": float(step)}
        i, shape = s.index, tuple(s.param.shape)
        if opt._resident is not None:
            master = opt._resident.masters[i]
        else:
            master = master_flat(s.bucket)[s.offset : s.offset + s.numel]
        entries += [
            (f"state.{i}.exp_avg", m.dtype, shape, lambda m=m: m),
            (f"state.{i}.exp_avg_sq", v.dtype, shape, lambda v=v: v),
            (f"state.{i}.master", torch.float32, shape, lambda t=master, sh=shape: t.float().view(sh)),
        ]
    n, ids = 0, []
    for g in opt.param_groups:
        ids.append(list(range(n, n + len(g["params"]))))
        n += len(g["params"])
    return entries, {"state": steps, "param_groups": _groups_json(opt.param_groups, ids)}


def _disk_entries(s, page, moment_dtype) -> list:
    """The entries of slot s of a bucket whose state is on disk (nvme_offload): copies made as the
    writer reaches them, with the bucket paged in by `page`."""
    from .engine.layout import master_flat

    b, sl, shape = s.bucket, slice(s.offset, s.offset + s.numel), tuple(s.param.shape)

    def read(name):
        def fn():
            page(b)
            t = master_flat(b) if name == "master" else getattr(b, name)
            return t[sl].view(shape).clone()

        return fn

    return [
        (f"state.{s.index}.exp_avg", moment_dtype, shape, read("exp_avg")),
        (f"state.{s.index}.exp_avg_sq", moment_dtype, shape, read("exp_avg_sq")),
        (f"state.{s.index}.master", torch.float32, shape, read("master")),
    ]


def _generic_entries(optimizer) -> tuple[list, dict]:
    """Any torch optimizer: its state dict's tensors to safetensors, everything else to JSON."""
    sd = optimizer.state_dict()
    entries, state = [], {}
    for pid, st in sd["state"].items():
        rest = {}
        for k, v in st.items():
            if torch.is_tensor(v):
                entries.append(entry(f"state.{pid}.{k}", v))
            else:
                rest[k] = v
        state[str(pid)] = rest
    groups = sd["param_groups"]
    return entries, {"state": state, "param_groups": _groups_json(groups, [g["params"] for g in groups])}


def _save_optimizer(folder: str, optimizer) -> None:
    from .engine.disk_tier import Paging
    from .optim import OffloadAdamW

    page = Paging()  # nvme_offload: one bucket's state paged in at a time while it is written
    if isinstance(optimizer, OffloadAdamW) and optimizer._engine.dp is None:
        entries, js = _offload_entries(optimizer, page=page)
    else:  # a torch optimizer, or data parallel (state_dict() gathers from the owners)
        entries, js = _generic_entries(optimizer)
    js["type"] = type(optimizer).__name__
    try:
        text = json.dumps(js)
    except TypeError as exc:
        raise TypeError(
            f"save_checkpoint: the optimizer's state has a value JSON cannot store ({exc})"
        ) from None
    with page:
        write_safetensors(os.path.join(folder, "optimizer.safetensors"), entries, {"format": FORMAT})
    write_json(os.path.join(folder, "optimizer.json"), json.loads(text))


# ---- extras --------------------------------------------------------------------------------------
def _check_extra(extra: dict) -> None:
    for k, v in extra.items():
        if torch.is_tensor(v):
            continue
        try:
            json.dumps(v)
        except (TypeError, ValueError):
            raise TypeError(
                f"save_checkpoint: extra {k}= is a {type(v).__name__}; accepted: a tensor or a value "
                "JSON can store (numbers, strings, bools, None, lists and dicts of them)"
            ) from None


def _save_extra(folder: str, extra: dict) -> None:
    _check_extra(extra)
    tensors = [entry(k, v) for k, v in extra.items() if torch.is_tensor(v)]
    rest = {k: v for k, v in extra.items() if not torch.is_tensor(v)}
    write_json(os.path.join(folder, "extra.json"), rest)
    write_safetensors(os.path.join(folder, "extra.safetensors"), tensors, {"format": FORMAT})


# ---- the folder ----------------------------------------------------------------------------------
def _exchange(a: str, b: str) -> bool:
    """Swaps two paths in one step (Linux renameat2 RENAME_EXCHANGE); False where unavailable."""
    try:
        fn = ctypes.CDLL(None, use_errno=True).renameat2
    except (AttributeError, OSError):
        return False
    at_fdcwd, rename_exchange = -100, 2
    return fn(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), rename_exchange) == 0


def _discard(folder: str) -> None:
    """Removes a folder, its meta.json first, so that no part of it looks complete."""
    try:
        os.remove(os.path.join(folder, "meta.json"))
    except FileNotFoundError:
        pass
    shutil.rmtree(folder, ignore_errors=True)


def _remove_stale(parent: str, name: str) -> None:
    """Temporary folders of saves to the same path whose process is gone."""
    prefix = f".{name}.tmp-"
    for entry_ in os.listdir(parent):
        if not entry_.startswith(prefix):
            continue
        pid = entry_[len(prefix) :].split("-", 1)[0]
        if not pid.isdigit() or int(pid) == os.getpid():
            continue
        try:
            os.kill(int(pid), 0)
        except ProcessLookupError:
            _discard(os.path.join(parent, entry_))
        except PermissionError:
            pass


def _publish(tmp: str, path: str) -> None:
    parent = os.path.dirname(path)
    if not os.path.lexists(path):
        os.rename(tmp, path)
    elif not os.path.isdir(path) or os.path.islink(path):
        raise ValueError(f"save_checkpoint: path {path} exists and is not a folder")
    elif _exchange(tmp, path):
        _discard(tmp)  # now the previous checkpoint
    else:
        old = tmp + "-old"
        os.rename(path, old)
        os.rename(tmp, path)
        _discard(old)
    fsync_dir(parent)


def _data_parallel(optimizer):
    from .optim import OffloadAdamW

    return optimizer._engine.dp if isinstance(optimizer, OffloadAdamW) else None


def _save_distributed(path: str, model, optimizer, extra: dict, dp) -> str:
    """save_checkpoint under data parallel: every rank calls it (see the module's docstring)."""
    import torch.distributed as dist

    parent, name = os.path.split(path)
    box: list = [None]
    if dp.rank == 0:
        try:
            os.makedirs(parent, exist_ok=True)
            _remove_stale(parent, name)
            box[0] = tempfile.mkdtemp(prefix=f".{name}.tmp-{os.getpid()}-", dir=parent)
        except OSError as e:
            box[0] = e
    dist.broadcast_object_list(box, src=0)
    if isinstance(box[0], BaseException):
        raise box[0] if dp.rank == 0 else RuntimeError(f"save_checkpoint: rank 0 failed: {box[0]}")
    tmp, err = box[0], None
    try:
        entries, js = _offload_entries(optimizer, owned_only=True)
        shard = os.path.join(tmp, shard_name(dp.rank, dp.world))
        write_safetensors(shard + ".safetensors", entries, {"format": FORMAT})
        write_json(shard + ".json", js["state"])
        if dp.rank == 0:
            _save_model(tmp, model)
            _save_extra(tmp, extra)
            head = {"state": {}, "param_groups": js["param_groups"], "type": type(optimizer).__name__}
            write_json(os.path.join(tmp, "optimizer.json"), dict(head, shards=dp.world))
    except BaseException as e:  # every rank learns of it below, then it is raised here
        err = e
    oks: list = [None] * dp.world
    dist.all_gather_object(oks, err is None)
    if all(oks) and dp.rank == 0:
        try:
            meta = {
                "format": FORMAT,
                "version": VERSION,
                "optimizer": True,
                "shards": dp.world,
                "complete": True,
            }
            write_json(os.path.join(tmp, "meta.json"), meta)
            fsync_dir(tmp)
            _publish(tmp, path)
        except BaseException as e:
            err = e
    published = [None]
    if dp.rank == 0:
        published[0] = all(oks) and err is None
        if not published[0]:
            _discard(tmp)
    dist.broadcast_object_list(published, src=0)
    if err is not None:
        raise err
    if not published[0]:
        failed = [r for r, ok in enumerate(oks) if not ok]
        raise RuntimeError(f"save_checkpoint: not saved: rank(s) {failed or [0]} failed; {path} is as before")
    return path


def save_checkpoint(path, model: torch.nn.Module, optimizer=None, **extra) -> str:
    """Saves `model` (its state dict, safetensors), `optimizer` (any torch optimizer whose state
    is tensors and JSON values; a ramstream.OffloadAdamW's with its fp32 masters, streamed from
    host RAM) and `extra` (tensors, or values JSON can store: the step, an LR scheduler's
    state_dict(), the data position) into the folder `path`, which appears only when complete
    and replaces an existing checkpoint there only then. Returns the absolute path. Under data
    parallel (an OffloadAdamW with distributed=True) a collective: every rank calls it with the
    same path, and each writes the state of the buckets it owns."""
    path = _check_args("save_checkpoint", path, model, optimizer)
    parent, name = os.path.split(path)
    if not name:
        raise ValueError(f"save_checkpoint: path {path!r} names no folder")
    dp = _data_parallel(optimizer) if optimizer is not None else None
    if dp is not None:
        if os.path.lexists(path) and (not os.path.isdir(path) or os.path.islink(path)):
            raise ValueError(f"save_checkpoint: path {path} exists and is not a folder")
        _check_extra(extra)  # on every rank, before any collective
        return _save_distributed(path, model, optimizer, extra, dp)
    os.makedirs(parent, exist_ok=True)
    _remove_stale(parent, name)
    tmp = tempfile.mkdtemp(prefix=f".{name}.tmp-{os.getpid()}-", dir=parent)
    try:
        _save_model(tmp, model)
        if optimizer is not None:
            _save_optimizer(tmp, optimizer)
        _save_extra(tmp, extra)
        meta = {
            "format": FORMAT,
            "version": VERSION,
            "optimizer": optimizer is not None,
            "complete": True,
        }
        write_json(os.path.join(tmp, "meta.json"), meta)  # last: only a complete folder has it
        fsync_dir(tmp)
        _publish(tmp, path)
    except BaseException:
        _discard(tmp)
        raise
    return path


def load_checkpoint(path, model: torch.nn.Module, optimizer=None) -> dict:
    """Loads a folder written by save_checkpoint into `model` (strict: every key must match) and
    `optimizer` (if given; the model first, so that a bf16 model's fp32 masters are restored),
    and returns the `extra` it was saved with. Nothing is unpickled. All or nothing: every file is
    read and checked first (JSON type-checked, safetensors headers validated, keys, shapes and
    dtypes against the model and the optimizer; _checkpoint_read.py), and only then installed, so
    that a damaged or mismatched checkpoint raises with the model and the optimizer as they were.
    ValueError naming the file and the key when `path` is not a complete checkpoint or does not
    fit; FileNotFoundError naming the path of a missing folder or file."""
    path = _check_args("load_checkpoint", path, model, optimizer)
    meta = read_meta(path)
    tensors = read_model(path, model)
    state = read_optimizer(path, optimizer, meta) if optimizer is not None else None
    extra = read_extra(path)
    if state is not None and hasattr(optimizer, "synchronize"):
        optimizer.synchronize()  # a pending update's failure surfaces before anything changes
    model.load_state_dict(tensors)
    if state is not None:
        optimizer.load_state_dict(state)
    return extra
