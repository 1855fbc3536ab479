"""The Pipeline's argument checks (ValueError/TypeError naming the argument) and the split of a
batch into microbatches. Imports torch and nothing from the package."""

from __future__ import annotations

import os

import torch
import torch.nn as nn

__all__ = [
    "check_autocast",
    "check_devices",
    "check_int",
    "check_paths",
    "check_offload",
    "check_params",
    "schedule_hint",
    "dice",
    "split_batch",
    "split_tensors",
]

ISSUE = "issue 28"


def check_int(where: str, name: str, v, lo: int) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or v < lo:
        raise ValueError(f"{where}: {name} must be an int >= {lo}, got {v!r}")
    return v


def check_autocast(autocast):
    """None, a torch dtype (bfloat16 or float16) or "bf16"/"bfloat16"/"fp16"/"float16"."""
    names = {
        "bf16": torch.bfloat16,
        "bfloat16": torch.bfloat16,
        "fp16": torch.float16,
        "float16": torch.float16,
    }
    if autocast is None:
        return None
    if isinstance(autocast, str) and autocast.lower() in names:
        return names[autocast.lower()]
    if autocast in (torch.bfloat16, torch.float16):
        return autocast
    raise ValueError(
        f"Pipeline: autocast must be None, torch.bfloat16, torch.float16 or 'bf16'/'fp16', got {autocast!r}"
    )


def check_devices(devices, n: int | None):
    """`devices` as torch.devices ("cpu" or "cuda[:i]"; a GPU must exist); None: cuda:i round-robin
    over the visible GPUs, else the CPU, for `n` stages."""
    if devices is None:
        k = torch.cuda.device_count() if torch.cuda.is_available() else 0
        n = n or max(k, 1)
        return [torch.device("cuda", i % k) if k else torch.device("cpu") for i in range(n)]
    if isinstance(devices, (str, torch.device)) or not hasattr(devices, "__iter__"):
        raise TypeError(f"Pipeline: devices must be a list of devices (one per stage), got {devices!r}")
    out = []
    for d in devices:
        try:
            dev = torch.device(d)
        except (RuntimeError, TypeError):
            raise ValueError(f"Pipeline: devices: {d!r} is not a device") from None
        if dev.type not in ("cpu", "cuda"):
            raise ValueError(f"Pipeline: devices: only 'cpu' and 'cuda[:i]' stages are supported, got {d!r}")
        if dev.type == "cuda":
            if not torch.cuda.is_available():
                raise RuntimeError(f"Pipeline: devices: {d!r} asks for CUDA, which torch does not see here")
            dev = torch.device("cuda", torch.cuda.current_device() if dev.index is None else dev.index)
            if dev.index >= torch.cuda.device_count():
                raise ValueError(
                    f"Pipeline: devices: {d!r}: only {torch.cuda.device_count()} GPUs are visible"
                )
        out.append(dev)
    if not out:
        raise ValueError("Pipeline: devices must name at least one device")
    if n is not None and len(out) != n:
        raise ValueError(f"Pipeline: devices has {len(out)} entries for {n} stages")
    return out


def _auto_or_int(name: str, v, lo: int) -> None:
    if isinstance(v, bool) or not isinstance(v, int) or v < lo:
        raise ValueError(f"Pipeline: {name} must be an int >= {lo} or 'auto', got {v!r}")


def check_offload(window, pin, keep, grad_accum, acc_slots, activations, act_slots) -> None:
    """RamTorch's offload_* options, checked (their meanings: Pipeline's docstring)."""
    if window != "auto":
        _auto_or_int("offload_window", window, 1)
    if pin != "auto":
        _auto_or_int("offload_pin", pin, 0)
    if keep not in (True, False, "checkpoint") or isinstance(keep, int) and not isinstance(keep, bool):
        raise ValueError(
            f"Pipeline: offload_keep_activations must be True, False or 'checkpoint', got {keep!r}"
        )
    if grad_accum not in ("stream", "cpu"):
        raise ValueError(f"Pipeline: offload_grad_accum must be 'stream' or 'cpu', got {grad_accum!r}")
    if acc_slots is not None:
        check_int("Pipeline", "offload_acc_slots", acc_slots, 1)
    if not isinstance(activations, bool):
        raise TypeError(f"Pipeline: offload_activations must be a bool, got {type(activations).__name__}")
    check_int("Pipeline", "offload_act_slots", act_slots, 1)


def _modules(where: str, items) -> list:
    if isinstance(items, nn.Module) and not isinstance(items, (nn.ModuleList, nn.Sequential)):
        raise TypeError(f"Pipeline: {where} must be a list of nn.Module, got one {type(items).__name__}")
    try:
        items = list(items)
    except TypeError:
        raise TypeError(
            f"Pipeline: {where} must be a list of nn.Module, got {type(items).__name__}"
        ) from None
    if not items:
        raise ValueError(f"Pipeline: {where} must not be empty")
    return items


def dice(stage_modules, chunk_modules, chunks_per_stage, n_devices):
    """(pieces, interleave): `pieces` the modules in chunk order, each an nn.Module or a list of
    them (a chunked stage, run in sequence); `interleave` the chunks per stage v (piece c on stage
    c % stages) or 1 (piece s is stage s)."""
    v = 1
    if isinstance(chunks_per_stage, int) and not isinstance(chunks_per_stage, bool):
        v = check_int("Pipeline", "chunks_per_stage", chunks_per_stage, 1)
        chunks_per_stage = None
    if chunk_modules is not None:
        if stage_modules is not None:
            raise ValueError("Pipeline: give stage_modules or chunk_modules, not both")
        items = _modules("chunk_modules", chunk_modules)
        for i, m in enumerate(items):
            if not isinstance(m, nn.Module):
                raise TypeError(f"Pipeline: chunk_modules[{i}] must be an nn.Module, got {type(m).__name__}")
        if v > 1:
            return items, v
        if chunks_per_stage is not None:
            try:
                counts = [check_int("Pipeline", "chunks_per_stage entries", c, 1) for c in chunks_per_stage]
            except TypeError:
                raise TypeError("Pipeline: chunks_per_stage must be an int or a list of ints") from None
            if sum(counts) != len(items):
                raise ValueError(
                    f"Pipeline: chunks_per_stage sums to {sum(counts)} for {len(items)} chunk_modules"
                )
            if n_devices is not None and n_devices != len(counts):
                raise ValueError(
                    f"Pipeline: chunks_per_stage has {len(counts)} entries for {n_devices} devices"
                )
        else:
            k = n_devices or 1
            if len(items) < k:
                raise ValueError(f"Pipeline: {len(items)} chunk_modules cannot fill {k} stages")
            base, rem = divmod(len(items), k)
            counts = [base + (i < rem) for i in range(k)]
        it = iter(items)
        return [[next(it) for _ in range(c)] for c in counts], 1
    if chunks_per_stage is not None:
        raise ValueError("Pipeline: chunks_per_stage as a list of counts needs chunk_modules")
    items = _modules("stage_modules", stage_modules)
    for i, m in enumerate(items):
        if isinstance(m, (list, tuple, nn.ModuleList)):  # a chunked stage
            if not m or not all(isinstance(x, nn.Module) for x in m):
                raise TypeError(
                    f"Pipeline: stage_modules[{i}] must be an nn.Module or a non-empty list of them"
                )
            items[i] = list(m)
        elif not isinstance(m, nn.Module):
            raise TypeError(f"Pipeline: stage_modules[{i}] must be an nn.Module, got {type(m).__name__}")
    return items, v


def split_tensors(where: str, x, n: int, rows: int | None = None):
    """`x` (a tensor, or a tuple/list of tensors and other values) cut into `n` pieces along dim 0
    (torch.tensor_split: sizes differ by at most one); other values are repeated."""
    if torch.is_tensor(x):
        if x.dim() == 0 or x.shape[0] < n:
            raise ValueError(
                f"Pipeline.step: {where} needs at least n_microbatches={n} rows in dim 0, got shape {tuple(x.shape)}"
            )
        if rows is not None and x.shape[0] != rows:
            hint = (
                "; pre-split microbatches go as a tuple of tuples: ((x0,), (x1,), ...)"
                if where == "data"
                else ""
            )
            raise ValueError(f"Pipeline.step: {where} has {x.shape[0]} rows in dim 0, data has {rows}{hint}")
        return list(torch.tensor_split(x, n, dim=0))
    if isinstance(x, (tuple, list)):
        cols = [split_tensors(where, v, n, rows) if torch.is_tensor(v) else [v] * n for v in x]
        return [tuple(c[i] for c in cols) for i in range(n)]
    if x is None:
        return [None] * n
    raise TypeError(f"Pipeline.step: {where} must be a tensor or a tuple of tensors, got {type(x).__name__}")


def split_batch(data, n: int):
    """Per microbatch, the first chunk's positional arguments; and the rows of dim 0."""
    if torch.is_tensor(data):
        pieces = split_tensors("data", data, n)
        return [(p,) for p in pieces], data.shape[0]
    if isinstance(data, (tuple, list)):
        if data and all(isinstance(v, (tuple, list)) for v in data):
            raise ValueError(
                "Pipeline: data as pre-split microbatches (a tuple of tuples) is accepted by step() and "
                "infer() only; give one batch (a tensor or a flat tuple of tensors)"
            )
        tensors = [v for v in data if torch.is_tensor(v)]
        if not tensors:
            raise TypeError("Pipeline.step: data as a tuple must hold at least one tensor")
        rows = tensors[0].shape[0] if tensors[0].dim() else 0
        return split_tensors("data", tuple(data), n, rows), rows
    raise TypeError(f"Pipeline.step: data must be a tensor or a tuple of tensors, got {type(data).__name__}")


def check_paths(**paths) -> None:
    """trace_path / profile_path: None or a path whose folder exists."""
    for name, path in paths.items():
        if path is not None:
            if not isinstance(path, (str, os.PathLike)):
                raise TypeError(f"Pipeline: {name} must be a path, got {type(path).__name__}")
            folder = os.path.dirname(os.path.abspath(path))
            if not os.path.isdir(folder):
                raise FileNotFoundError(f"Pipeline: {name}: folder {folder} does not exist")


def check_params(chunks) -> list:
    """Every parameter of the chunks (Chunk objects), once each, in pipeline order; ValueError
    when one is shared by two stages."""
    owner: dict = {}
    out, seen = [], set()
    for ch in chunks:
        for p in ch.module.parameters():
            s = owner.setdefault(id(p), ch.stage)
            if s != ch.stage:
                raise ValueError(
                    f"Pipeline: a parameter of shape {tuple(p.shape)} is shared by stages {s} and {ch.stage}; "
                    "a parameter must belong to one stage (untie it, or keep its users in one stage)"
                )
            if id(p) not in seen:
                seen.add(id(p))
                out.append(p)
    return out


def schedule_hint(schedule: str, devices, grouped, microbatches: int) -> str | None:
    """The one-time advice for a 1F1B step whose streamed stages all share one device: there is no
    cross-device overlap to win, and GPipe runs them chunk-major (chunk_major.py), loading each
    chunk twice per step instead of twice per microbatch. None when it does not apply."""
    if schedule != "1f1b" or not grouped or microbatches < 2 or len(set(devices)) != 1:
        return None
    return (
        f"Pipeline.step: schedule '1f1b' with streamed stages that all run on {devices[0]} loads each "
        f"streamed chunk about 2 x {microbatches} times per step; schedule='gpipe' runs them "
        "chunk-major, loading each chunk twice per step (bit-identical results; it holds every "
        "microbatch's activations, as OffloadModel on the whole batch): see the pipeline guide, "
        '"Chunk-major runs". This advice is given once per Pipeline.'
    )
