"""Checks of a torch-format AdamW state dict before OffloadAdamW.load_state_dict changes anything:
its structure, each group's hyper-parameters (the kernels' rules, ops/_adamw_rules.py) and each
parameter's step and second moment; ValueError naming the entry and what is accepted. Also
OffloadAdamW's own arguments (check_args, check_delayed)."""

from __future__ import annotations

import math
import numbers

import torch

from .ops import _adamw_rules as _rules

_WHERE = "load_state_dict"


def _step_value(step) -> float | None:
    """The step as a float (an int, an integral float or a one-element real tensor); None otherwise."""
    if torch.is_tensor(step):
        if step.numel() != 1 or step.dtype == torch.bool or step.is_complex():
            return None
        step = step.item()
    if isinstance(step, bool) or not isinstance(step, numbers.Real):
        return None
    return float(step)


def check_state_dict(sd, param_groups: list[dict]) -> None:
    """ValueError unless `sd` is an AdamW state dict whose values the optimizer can train on: a dict
    with 'state' (a dict of per-parameter dicts) and 'param_groups' (a list of dicts with 'params'),
    hyper-parameters within the kernels' rules, each 'step' an integer >= 0 and each 'exp_avg_sq'
    >= 0 (a negative one makes the update's square root NaN). Matching counts and shapes are
    checked by engine/state.py's import_state, which this runs before."""
    if not isinstance(sd, dict) or "state" not in sd or "param_groups" not in sd:
        raise ValueError(
            f"{_WHERE}: state_dict must be a dict with 'state' and 'param_groups' (an optimizer's "
            f"state_dict()), got {type(sd).__name__}"
            + (f" with keys {sorted(map(str, sd))}" if isinstance(sd, dict) else "")
        )
    groups = sd["param_groups"]
    if not isinstance(groups, (list, tuple)) or not all(
        isinstance(g, dict) and "params" in g for g in groups
    ):
        raise ValueError(
            f"{_WHERE}: state_dict['param_groups'] must be a list of dicts each with 'params', got "
            f"{type(groups).__name__}"
        )
    for i, g in enumerate(groups):
        if not isinstance(g["params"], (list, tuple)):
            raise ValueError(
                f"{_WHERE}: state_dict['param_groups'][{i}]['params'] must be a list of parameter ids, "
                f"got {type(g['params']).__name__}"
            )
    if len(groups) == len(param_groups):  # else import_state names the counts
        for i, (g, mine) in enumerate(zip(groups, param_groups)):
            _rules.check_group(_WHERE, {**mine, **g}, i)  # keys not saved keep the optimizer's
    state = sd["state"]
    if not isinstance(state, dict):
        raise ValueError(
            f"{_WHERE}: state_dict['state'] must be a dict {{parameter id: AdamW state}}, got "
            f"{type(state).__name__}"
        )
    for pid, st in state.items():
        if not isinstance(st, dict):
            raise ValueError(
                f"{_WHERE}: state_dict['state'][{pid!r}] must be a dict (step, exp_avg, exp_avg_sq), "
                f"got {type(st).__name__}"
            )
        if "step" in st:
            v = _step_value(st["step"])
            if v is None or not math.isfinite(v) or v != int(v) or not 0 <= v < 2**63:
                raise ValueError(
                    f"{_WHERE}: state_dict['state'][{pid!r}]['step'] must be an integer >= 0 (an int, "
                    f"or a one-element tensor as torch saves it), got {st['step']!r}"
                )
        v2 = st.get("exp_avg_sq")
        if torch.is_tensor(v2) and v2.is_floating_point() and v2.numel() and bool((v2 < 0).any()):
            raise ValueError(
                f"{_WHERE}: state_dict['state'][{pid!r}]['exp_avg_sq'] has negative values; accepted: "
                "a second moment >= 0 (an average of squared gradients)"
            )


def check_args(*, mode, offload, flags: dict, bucket_bytes, seed, max_inflight_bytes, vram_headroom) -> None:
    """OffloadAdamW's constructor arguments that it does not parse into values: ValueError naming
    the argument and what is accepted (flags: name -> a value that must be a bool)."""
    if not isinstance(mode, str) or mode not in ("cpu", "gpu", "auto"):
        raise ValueError(f"OffloadAdamW: mode={mode!r} is not accepted; accepted: 'cpu', 'gpu', 'auto'")
    if not (offload is True or (isinstance(offload, str) and offload == "auto")):
        raise ValueError(f"OffloadAdamW: offload={offload!r}; accepted: True, 'auto'")
    for name, value in flags.items():
        if not isinstance(value, bool):
            raise ValueError(f"OffloadAdamW: {name}={value!r}; accepted: True, False")
    for name, value, lo in (("bucket_bytes", bucket_bytes, 4096), ("seed", seed, 0)):
        if isinstance(value, bool) or not isinstance(value, int) or value < lo:
            raise ValueError(f"OffloadAdamW: {name}={value!r}; accepted: an integer >= {lo}")
    if max_inflight_bytes is not None and (
        isinstance(max_inflight_bytes, bool)
        or not isinstance(max_inflight_bytes, int)
        or max_inflight_bytes < (1 << 20)
    ):
        raise ValueError(
            f"OffloadAdamW: max_inflight_bytes={max_inflight_bytes!r}; accepted: None or an integer >= 1 MiB"
        )
    if (
        isinstance(vram_headroom, bool)
        or not isinstance(vram_headroom, (int, float))
        or not 0.0 <= vram_headroom < 1.0
    ):
        raise ValueError(f"OffloadAdamW: vram_headroom={vram_headroom!r}; accepted: a number in [0, 1)")
    if flags.get("distributed"):
        import torch.distributed as dist

        if not dist.is_available() or not dist.is_initialized():
            raise ValueError(
                "OffloadAdamW: distributed=True needs torch.distributed "
                "initialised (torch.distributed.init_process_group) first"
            )


def check_hyper(lr, betas, eps, weight_decay) -> None:
    """The rules of ramstream.ops._adamw_rules; ValueError naming the bad one."""
    b1, b2 = _rules.check_betas("OffloadAdamW", betas)
    _rules.check_hypers(
        "OffloadAdamW",
        lr=lr,
        beta1=b1,
        beta2=b2,
        eps=eps,
        weight_decay=weight_decay,
        names={"beta1": "betas[0]", "beta2": "betas[1]"},
        type_error=ValueError,
    )


def check_delayed(value, mode: str, offload, distributed) -> tuple:
    """OffloadAdamW's delayed_update: (warm-up steps or None, mode, offload). Only host-updated
    parameters are delayed: mode "auto" keeps its mapped share and offload "auto" its VRAM share
    (no resident switch), both updated by the GPU without delay; "cpu" delays every parameter;
    mode "gpu" (nothing left to delay) and distributed are refused (ValueError naming
    delayed_update)."""
    from .options import parse_delayed_update

    warmup = parse_delayed_update(value, "OffloadAdamW:")
    if warmup is None:
        return None, mode, offload
    if mode == "gpu":
        raise ValueError(
            "OffloadAdamW: delayed_update needs the host AdamW; mode='gpu' updates on the GPU, "
            "where the update cannot be delayed; pass mode='cpu' or 'auto'"
        )
    if distributed:
        raise ValueError(
            "OffloadAdamW: delayed_update is not supported with distributed=True (the owners' "
            "broadcast of the new weights is not delayed)"
        )
    return warmup, mode, offload


def check_nvme(
    nvme_offload, nvme_dir, mode: str, offload, distributed, auto_share=0.0, where="OffloadAdamW:"
):
    """nvme_offload / nvme_dir: (share of the host-updated state on disk, folder or None, mode,
    offload). "auto" takes `auto_share` (the plan's; 0 without one or without a folder); a share
    > 0 keeps the state on the host (mode "cpu", offload True). ValueError naming the options for a
    share without a folder (option or RAMSTREAM_NVME_DIR), mode "gpu" or data parallel; OSError
    naming the path for a folder that is missing, not a folder or not writable."""
    import errno
    import os

    from . import env
    from .options import parse_nvme_dir, parse_nvme_offload

    share = parse_nvme_offload(nvme_offload, where)
    directory = parse_nvme_dir(nvme_dir, where) or env.get("RAMSTREAM_NVME_DIR")
    if share == "auto":
        share = float(auto_share) if directory else 0.0
    if share <= 0:
        return 0.0, directory, mode, offload
    if directory is None:
        raise ValueError(
            f"{where} nvme_offload={nvme_offload!r} needs a folder for the state: pass nvme_dir= (an existing, "
            "writable folder on a fast local disk) or set RAMSTREAM_NVME_DIR; or pass nvme_offload=False"
        )
    if mode == "gpu":
        raise ValueError(
            f"{where} nvme_offload={nvme_offload!r} puts the host-updated optimizer state on disk; "
            "mode='gpu' updates on the GPU: pass mode='cpu' or 'auto', or nvme_offload=False"
        )
    if distributed:
        raise ValueError(
            f"{where} nvme_offload={nvme_offload!r} is not supported with data parallel (distributed) yet; "
            "pass nvme_offload=False"
        )
    if not os.path.exists(directory):
        raise FileNotFoundError(errno.ENOENT, f"{where} nvme_dir: no such folder", directory)
    if not os.path.isdir(directory):
        raise NotADirectoryError(errno.ENOTDIR, f"{where} nvme_dir: not a folder", directory)
    if not os.access(directory, os.W_OK | os.X_OK):
        raise PermissionError(errno.EACCES, f"{where} nvme_dir: the folder is not writable", directory)
    return share, directory, "cpu", True
