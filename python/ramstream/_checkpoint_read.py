"""load_checkpoint's first phase: every file of a checkpoint folder read and checked before anything
is installed, so that a load is all-or-nothing.

JSON files are parsed and type-checked, safetensors files validated as the format requires
(_tensorfile.read_header), the model's tensors checked against the model's keys, shapes and dtypes,
the optimizer's state against its param groups (and, for ramstream.OffloadAdamW, against the
engine: engine.state.check_state). Errors name the file and the key: ValueError, or
FileNotFoundError naming the path of a missing file.
"""

from __future__ import annotations

import errno
import json
import math
import os

import torch

from ._tensorfile import read_safetensors

FORMAT = "ramstream-checkpoint"
VERSION = 1

# optimizer state tensors with one element per parameter element (torch's AdamW, Adam, SGD, ...)
_PER_ELEMENT = ("exp_avg", "exp_avg_sq", "max_exp_avg_sq", "master", "momentum_buffer", "square_avg")


def shard_name(rank: int, world: int) -> str:
    return f"optimizer-{rank:05d}-of-{world:05d}"


def _show(v) -> str:
    r = repr(v)
    return r if len(r) <= 80 else r[:77] + "..."


def _expect(ok: bool, path: str, key: str, what: str, value) -> None:
    if not ok:
        raise ValueError(f"load_checkpoint: {path}: {key} must be {what}, got {_show(value)}")


def _is_int(v) -> bool:
    return type(v) is int


def _is_number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def missing(path: str, why: str) -> FileNotFoundError:
    return FileNotFoundError(errno.ENOENT, f"load_checkpoint: no such file ({why})", path)


def read_json(path: str):
    """The value of a JSON file; FileNotFoundError or ValueError naming the file."""
    try:
        with open(path, "rb") as f:
            raw = f.read()
    except FileNotFoundError:
        raise missing(path, "the checkpoint is incomplete") from None
    try:
        return json.loads(raw.decode("utf-8"))
    except (ValueError, RecursionError) as e:
        raise ValueError(f"load_checkpoint: {path} is not valid JSON ({e}): the file is damaged") from None


# ---- meta.json -----------------------------------------------------------------------------------
def read_meta(folder: str) -> dict:
    if not os.path.isdir(folder):
        raise FileNotFoundError(errno.ENOENT, "load_checkpoint: no such checkpoint folder", folder)
    path = os.path.join(folder, "meta.json")
    if not os.path.isfile(path):
        raise ValueError(f"load_checkpoint: {folder} is not a complete ramstream checkpoint (no meta.json)")
    meta = read_json(path)
    _expect(isinstance(meta, dict), path, "the file", "a JSON object", meta)
    if meta.get("format") != FORMAT or meta.get("complete") is not True:
        raise ValueError(
            f"load_checkpoint: {folder} is not a complete ramstream checkpoint ({path}: 'format' "
            f"{_show(meta.get('format'))}, 'complete' {_show(meta.get('complete'))}; a checkpoint has "
            f"'format' {FORMAT!r} and 'complete' true)"
        )
    version = meta.get("version", 0)
    _expect(_is_int(version) and version >= 0, path, "'version'", "a non-negative integer", version)
    if version > VERSION:
        raise ValueError(
            f"load_checkpoint: {folder} has format version {version}; this ramstream reads <= {VERSION}"
        )
    if "optimizer" in meta:
        _expect(isinstance(meta["optimizer"], bool), path, "'optimizer'", "true or false", meta["optimizer"])
    if "shards" in meta:
        _expect(
            _is_int(meta["shards"]) and meta["shards"] >= 1,
            path,
            "'shards'",
            "a positive integer",
            meta["shards"],
        )
    return meta


# ---- the model -----------------------------------------------------------------------------------
def model_signature(model: torch.nn.Module) -> dict[str, tuple[tuple, torch.dtype]]:
    """{key: (shape, dtype)} of what model.state_dict() holds, read from the modules' parameters and
    persistent buffers without building the state dict (a quantized layer's packed weight counts
    as the weight its state-dict hook serves); from model.state_dict() itself where a module has
    state-dict hooks of its own or extra state."""
    from .quant.packed import _ABSMAX, _CODES, is_quantized

    out: dict = {}
    for prefix, m in model.named_modules(remove_duplicate=False):
        quant = is_quantized(m)
        extra_state = type(m).get_extra_state is not torch.nn.Module.get_extra_state
        if (m._state_dict_hooks and not quant) or extra_state:
            sd = model.state_dict()
            return {
                k: (tuple(v.shape), v.dtype) if torch.is_tensor(v) else (None, None) for k, v in sd.items()
            }
        p = f"{prefix}." if prefix else ""
        for name, t in m._parameters.items():
            if t is not None:
                out[p + name] = (tuple(t.shape), t.dtype)
        for name, t in m._buffers.items():
            if t is not None and name not in m._non_persistent_buffers_set:
                out[p + name] = (tuple(t.shape), t.dtype)
        if quant:
            out.pop(p + _CODES, None)
            out.pop(p + _ABSMAX, None)
            out[p + "weight"] = (tuple(m.quant_shape), m.quant_dtype)
    return out


def _names(keys: list[str]) -> str:
    return ", ".join(repr(k) for k in keys[:8]) + (f" and {len(keys) - 8} more" if len(keys) > 8 else "")


def read_model(folder: str, model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The model file's tensors (tied names resolved), checked against the model: the same keys,
    shapes, and dtypes (a float may load into another float dtype, as load_state_dict casts)."""
    path = os.path.join(folder, "model.safetensors")
    tensors, meta = read_safetensors(path)
    raw = meta.get("ramstream_ties", "{}")
    try:
        ties = json.loads(raw)
    except (ValueError, RecursionError) as e:
        raise ValueError(
            f"load_checkpoint: {path}: __metadata__ 'ramstream_ties' is not valid JSON ({e})"
        ) from None
    _expect(
        isinstance(ties, dict) and all(isinstance(v, str) for v in ties.values()),
        path,
        "__metadata__ 'ramstream_ties'",
        "a JSON object {tied name: stored name}",
        ties,
    )
    for alias, target in ties.items():
        if target not in tensors or alias in tensors:
            raise ValueError(
                f"load_checkpoint: {path}: __metadata__ 'ramstream_ties' ties {alias!r} to {target!r}, but "
                + (
                    f"the file holds no tensor {target!r}"
                    if target not in tensors
                    else f"{alias!r} is stored too"
                )
            )
    tensors.update({alias: tensors[target] for alias, target in ties.items()})
    want = model_signature(model)
    lacking = [k for k in want if k not in tensors]
    extra = [k for k in tensors if k not in want]
    if lacking or extra:
        raise ValueError(
            f"load_checkpoint: {path} does not match the model: "
            + "; ".join(
                s
                for s in (
                    lacking and f"it lacks {len(lacking)} of the model's tensors ({_names(lacking)})",
                    extra and f"it holds {len(extra)} tensors the model has not ({_names(extra)})",
                )
                if s
            )
        )
    for k, (shape, dtype) in want.items():
        t = tensors[k]
        if shape is None:
            raise ValueError(f"load_checkpoint: the model's state {k!r} is not a tensor; it cannot be loaded")
        if tuple(t.shape) != shape:
            raise ValueError(
                f"load_checkpoint: {path}, tensor {k!r}: shape {tuple(t.shape)}, the model's is {shape}"
            )
        if t.dtype != dtype and not (t.dtype.is_floating_point and dtype.is_floating_point):
            raise ValueError(
                f"load_checkpoint: {path}, tensor {k!r}: dtype {t.dtype}, the model's is {dtype}"
            )
    return tensors


# ---- the optimizer -------------------------------------------------------------------------------
def _check_like(path: str, key: str, v, cur) -> None:
    """A saved hyper-parameter has the JSON type of the optimizer's current value (or is null,
    torch's "default" for flags such as foreach and fused)."""
    if v is None:
        return
    if isinstance(cur, bool):
        _expect(isinstance(v, bool), path, key, "true or false", v)
    elif _is_number(cur) or (torch.is_tensor(cur) and cur.numel() == 1):
        _expect(_is_number(v), path, key, "a number", v)
    elif isinstance(cur, str):
        _expect(isinstance(v, str), path, key, "a string", v)
    elif isinstance(cur, (tuple, list)):
        _expect(isinstance(v, list) and len(v) == len(cur), path, key, f"a list of {len(cur)} values", v)
        for i, (a, b) in enumerate(zip(v, cur)):
            _check_like(path, f"{key}[{i}]", a, b)


def _groups(path: str, saved, optimizer) -> tuple[list[dict], dict]:
    """(the param groups to load, {saved parameter id: the optimizer's parameter})."""
    _expect(isinstance(saved, list), path, "'param_groups'", "a list", saved)
    if len(saved) != len(optimizer.param_groups):
        raise ValueError(
            f"load_checkpoint: {path}: 'param_groups' holds {len(saved)} groups, the optimizer "
            f"{len(optimizer.param_groups)}"
        )
    groups, params = [], {}
    for i, (sg, g) in enumerate(zip(saved, optimizer.param_groups)):
        at = f"'param_groups'[{i}]"
        _expect(isinstance(sg, dict), path, at, "an object", sg)
        ids = sg.get("params")
        _expect(
            isinstance(ids, list) and all(_is_int(p) for p in ids),
            path,
            f"{at}['params']",
            "a list of integer parameter ids",
            ids,
        )
        if len(ids) != len(g["params"]):
            raise ValueError(
                f"load_checkpoint: {path}: {at}['params'] has {len(ids)} parameters, the optimizer's group "
                f"{len(g['params'])}"
            )
        for pid, p in zip(ids, g["params"]):
            if pid in params:
                raise ValueError(
                    f"load_checkpoint: {path}: parameter id {pid} appears twice in 'param_groups'"
                )
            params[pid] = p
        out = {}
        for k, v in sg.items():
            if k != "params":
                _check_like(path, f"{at}[{k!r}]", v, g.get(k))
                out[k] = tuple(v) if isinstance(v, list) and isinstance(g.get(k), tuple) else v
        out["params"] = list(ids)
        groups.append(out)
    return groups, params


def _pid(key: str, params: dict):
    """The parameter id a state key names (a decimal string), or None."""
    s = key[1:] if key.startswith("-") else key
    return int(key) if s.isascii() and s.isdigit() and len(s) < 20 and int(key) in params else None


def _state_json(path: str, where: str, saved, params: dict) -> dict:
    _expect(isinstance(saved, dict), path, where, "an object {parameter id: state}", saved)
    out = {}
    for key, st in saved.items():
        pid = _pid(key, params)
        if pid is None:
            raise ValueError(
                f"load_checkpoint: {path}: {where} has state for {key!r}, which is not a parameter id of "
                f"the optimizer's param groups ({len(params)} parameters)"
            )
        _expect(isinstance(st, dict), path, f"{where}[{key!r}]", "an object", st)
        if "step" in st:
            v = st["step"]
            _expect(
                _is_number(v) and math.isfinite(v) and v >= 0,
                path,
                f"{where}[{key!r}]['step']",
                "a non-negative number",
                v,
            )
        out[pid] = dict(st)
    return out


def _state_tensors(path: str, state: dict, params: dict) -> None:
    """The tensors of an optimizer file into `state`, each checked against its parameter."""
    tensors, _ = read_safetensors(path)
    for name, t in tensors.items():
        parts = name.split(".", 2)
        pid = _pid(parts[1], params) if len(parts) == 3 and parts[0] == "state" else None
        if pid is None:
            raise ValueError(
                f"load_checkpoint: {path}, tensor {name!r}: not 'state.<parameter id>.<key>' for a "
                f"parameter of the optimizer's param groups ({len(params)} parameters)"
            )
        k, p = parts[2], params[pid]
        if k in _PER_ELEMENT and (not t.is_floating_point() or t.numel() != p.numel()):
            raise ValueError(
                f"load_checkpoint: {path}, tensor {name!r}: {t.dtype} with {t.numel()} elements; its "
                f"parameter has {p.numel()} (shape {tuple(p.shape)}), and {k!r} is a float tensor of that size"
            )
        if k == "step" and t.numel() != 1:
            raise ValueError(
                f"load_checkpoint: {path}, tensor {name!r}: a step has 1 element, not {t.numel()}"
            )
        state.setdefault(pid, {})[k] = t


def read_optimizer(folder: str, optimizer, meta: dict) -> dict:
    """The optimizer's state dict from optimizer.json and optimizer.safetensors (or the shards a
    data-parallel save wrote), checked against the optimizer; ready for its load_state_dict."""
    from .optim import OffloadAdamW

    path = os.path.join(folder, "optimizer.json")
    if meta.get("optimizer") is False:
        raise ValueError(f"load_checkpoint: {folder} holds no optimizer state (saved with optimizer=None)")
    js = read_json(path)
    _expect(isinstance(js, dict), path, "the file", "a JSON object", js)
    for k in ("state", "param_groups"):
        if k not in js:
            raise ValueError(f"load_checkpoint: {path}: {k!r} is missing")
    groups, params = _groups(path, js["param_groups"], optimizer)
    state = _state_json(path, "'state'", js["state"], params)
    if "shards" in js:  # saved under data parallel: one file per rank, the state of its buckets
        world = js["shards"]
        _expect(_is_int(world) and world >= 1, path, "'shards'", "a positive integer", world)
        for r in range(world):
            base = os.path.join(folder, shard_name(r, world))
            for f in (base + ".json", base + ".safetensors"):
                if not os.path.isfile(f):
                    raise missing(f, f"{path} names {world} optimizer shards")
            state.update(_state_json(base + ".json", "the file", read_json(base + ".json"), params))
            _state_tensors(base + ".safetensors", state, params)
    else:
        _state_tensors(os.path.join(folder, "optimizer.safetensors"), state, params)
    if not isinstance(optimizer, OffloadAdamW):
        for st in state.values():
            if "step" in st and not torch.is_tensor(st["step"]):
                st["step"] = torch.tensor(float(st["step"]), dtype=torch.float32)
    sd = {"state": state, "param_groups": groups}
    if isinstance(optimizer, OffloadAdamW):
        try:
            _offload_checks(optimizer, sd)
        except ValueError as e:
            raise ValueError(f"load_checkpoint: {folder}: the optimizer state does not fit ({e})") from None
    return sd


def _offload_checks(optimizer, sd: dict) -> None:
    """What OffloadAdamW.load_state_dict checks before it changes anything, run here before the
    model is installed: the value rules (optim_checks.check_state_dict: hyper-parameters, steps,
    second moments) and the match with the engine (engine.state.check_state)."""
    from .engine.state import check_state
    from .optim_checks import check_state_dict

    check_state_dict(sd, optimizer.param_groups)
    check_state(optimizer, optimizer.param_groups, sd)


# ---- extras --------------------------------------------------------------------------------------
def read_extra(folder: str) -> dict:
    path = os.path.join(folder, "extra.json")
    out = read_json(path)
    _expect(isinstance(out, dict), path, "the file", "a JSON object {name: value}", out)
    tensors, _ = read_safetensors(os.path.join(folder, "extra.safetensors"))
    out.update({k: v.clone() for k, v in tensors.items()})
    return out
