"""wrap() options: names, accepted values, defaults, and validation with errors that list them.

A leaf: imports torch and the standard library only (tests/test_import_cycles.py checks it), so
every module can validate an option here; quant/model.py and activations/blocks.py re-export
the parsers that lived there."""

from __future__ import annotations

import math
import operator
from dataclasses import dataclass, field, fields
from typing import Any

import torch

_MOMENT_DTYPES = {
    "auto": "auto",
    "float32": "float32",
    "fp32": "float32",
    "bfloat16": "bfloat16",
    "bf16": "bfloat16",
}


def _fail(name: str, value: Any, accepted: str) -> ValueError:
    return ValueError(f"wrap(): option {name}={value!r} is not accepted; accepted: {accepted}")


def parse_moment_dtype(value: Any, *, allow_auto: bool = True, where: str = "wrap(): option") -> str:
    """'float32' / 'bfloat16' (or 'auto') from a string or torch dtype; ValueError otherwise."""
    if value is torch.float32:
        return "float32"
    if value is torch.bfloat16:
        return "bfloat16"
    if isinstance(value, str) and value in _MOMENT_DTYPES and (allow_auto or value != "auto"):
        return _MOMENT_DTYPES[value]
    accepted = "'float32', 'fp32', 'bfloat16', 'bf16', torch.float32, torch.bfloat16"
    if allow_auto:
        accepted = "'auto', " + accepted
    raise ValueError(f"{where} moment_dtype={value!r} is not accepted; accepted: {accepted}")


def parse_max_grad_norm(value: Any, where: str = "wrap(): option") -> float | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or math.isnan(value) or value <= 0:
        raise ValueError(
            f"{where} max_grad_norm={value!r} is not accepted; accepted: None or a number > 0 "
            "(float('inf'): the global norm is taken and checked for NaN/Inf, nothing is clipped)"
        )
    return float(value)


def parse_accumulation_steps(value: Any, where: str = "wrap(): option") -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{where} accumulation_steps={value!r} is not accepted; accepted: an integer >= 1")
    return int(value)


MAX_THREADS = 4096  # the bound RAMSTREAM_NUM_THREADS has in the core


def parse_threads(value: Any, where: str = "wrap(): option") -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= MAX_THREADS:
        raise ValueError(
            f"{where} threads={value!r} is not accepted; accepted: None (all cores) "
            f"or an integer in [1, {MAX_THREADS}]"
        )
    return int(value)


DELAYED_UPDATE_WARMUP = 40  # delayed_update=True: ZeRO-Offload's DPU starts after 40 iterations


def parse_delayed_update(value: Any, where: str = "wrap(): option") -> int | None:
    """delayed_update: False (off: None), True (DELAYED_UPDATE_WARMUP undelayed warm-up steps)
    or an integer >= 0 (that many undelayed warm-up steps); ValueError otherwise."""
    if value is False:
        return None
    if value is True:
        return DELAYED_UPDATE_WARMUP
    if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
        return int(value)
    raise ValueError(
        f"{where} delayed_update={value!r} is not accepted; accepted: False (off), True "
        f"({DELAYED_UPDATE_WARMUP} undelayed warm-up steps) or an integer >= 0 (that many warm-up steps)"
    )


_NVME_ACCEPTED = (
    "'auto' (the plan decides; no disk without one), True (all), False (none) or a number in (0, 1]"
)


def parse_nvme_offload(value: Any, where: str = "wrap(): option") -> str | float:
    """nvme_offload: "auto", or the share (0..1] of the host-updated state's bytes on disk (True:
    1.0, False: 0.0); ValueError naming the accepted values otherwise."""
    if isinstance(value, str) and value == "auto":
        return "auto"
    if value is True or value is False:
        return 1.0 if value else 0.0
    if (
        isinstance(value, (int, float))
        and not isinstance(value, bool)
        and math.isfinite(value)
        and 0.0 < value <= 1.0
    ):
        return float(value)
    raise ValueError(f"{where} nvme_offload={value!r} is not accepted; accepted: {_NVME_ACCEPTED}")


_NVME_WEIGHTS_ACCEPTED = (
    "'auto' (the plan decides; nothing without a plan or a folder), True (every streamed block), "
    "False (none), an int k >= 0 (the last k streamed blocks) or a list of streamed block indices"
)


def parse_nvme_weights(value: Any, where: str = "wrap(): option") -> str | bool | int | list[int]:
    """nvme_weights: where streamed blocks' frozen weights live: "auto", True, False, an int k >= 0
    (the last k streamed blocks) or a list of block indices (sorted, unique); ValueError naming the
    accepted values otherwise."""
    if (isinstance(value, str) and value == "auto") or value is True or value is False:
        return value
    if isinstance(value, int) and value >= 0:
        return int(value)
    if isinstance(value, (list, tuple)) and all(
        isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in value
    ):
        return sorted(set(value))
    raise ValueError(f"{where} nvme_weights={value!r} is not accepted; accepted: {_NVME_WEIGHTS_ACCEPTED}")


def parse_nvme_dir(value: Any, where: str = "wrap(): option") -> str | None:
    """nvme_dir: None (the RAMSTREAM_NVME_DIR variable, else no disk) or a folder's path."""
    if value is None:
        return None
    import os

    try:
        path = os.fspath(value)
    except TypeError:
        path = None
    if not isinstance(path, str) or not path:
        raise ValueError(
            f"{where} nvme_dir={value!r} is not accepted; accepted: None (RAMSTREAM_NVME_DIR) or the path "
            "of an existing, writable folder (str or os.PathLike)"
        )
    return path


def parse_mode(value: Any, where: str = "wrap(): option optimizer_mode") -> str:
    if not isinstance(value, str) or value not in ("cpu", "gpu", "auto"):
        raise ValueError(f"{where}={value!r} is not accepted; accepted: 'cpu', 'gpu', 'auto'")
    return value


@dataclass
class WrapOptions:
    """Every wrap() option with its default. See the options table of docs/guide/wrap.md for what
    each does."""

    optimizer_mode: str = "auto"
    offload: Any = "auto"
    device: Any = None
    distributed: Any = None
    guard_params: bool = True
    max_grad_norm: float | None = None
    accumulation_steps: int = 1
    moment_dtype: str = "auto"
    threads: int | None = None
    lr: float = 1e-3
    verbose: bool = False
    bucket_bytes: int = 32 << 20
    vram_headroom: float = 0.10
    max_inflight_bytes: int | None = None
    eager_updates: bool = True
    skip_nonfinite: bool = False
    delayed_update: Any = False
    nvme_dir: Any = None
    nvme_offload: Any = "auto"
    nvme_weights: Any = "auto"
    activation_offload: Any = False
    prefetch_depth: int = 1
    min_offload_bytes: int = 1 << 20
    max_activation_slowdown: float = 0.15
    blocks: Any = None
    param_offload: Any = "auto"
    activation_checkpointing: Any = "auto"
    weight_window: int = 2
    check_memory: bool = True
    profile: bool = True
    quantize: Any = "auto"
    quant_block_size: int = 64
    prefer: str = "exact"
    watchdog: bool = True
    plan: Any = None
    batch: int | None = None
    seq: int | None = None
    loss: str | None = None
    _extra: dict = field(default_factory=dict, repr=False)

    @classmethod
    def names(cls) -> list[str]:
        return sorted(f.name for f in fields(cls) if not f.name.startswith("_"))

    @classmethod
    def parse(cls, **options: Any) -> "WrapOptions":
        known = set(cls.names())
        unknown = sorted(set(options) - known)
        if unknown:
            raise ValueError(
                f"wrap(): unknown option(s) {', '.join(unknown)}; accepted options: "
                f"{', '.join(sorted(known))}"
            )
        o = cls(**options)
        o.optimizer_mode = parse_mode(o.optimizer_mode)
        if not (isinstance(o.offload, str) and o.offload == "auto") and o.offload is not True:
            raise _fail("offload", o.offload, "'auto', True")
        o.device = parse_device(o.device)
        if not any(o.distributed is v for v in (None, True, False)):  # 1 == True: not accepted
            raise _fail("distributed", o.distributed, "None (auto), True, False")
        o.param_offload = parse_param_offload(o.param_offload)
        o.activation_checkpointing = parse_checkpointing(o.activation_checkpointing)
        for name in (
            "guard_params",
            "verbose",
            "eager_updates",
            "skip_nonfinite",
            "check_memory",
            "profile",
            "watchdog",
        ):
            if not isinstance(getattr(o, name), bool):
                raise _fail(name, getattr(o, name), "True, False")
        o.max_grad_norm = parse_max_grad_norm(o.max_grad_norm)
        parse_delayed_update(o.delayed_update)  # kept as given: OffloadAdamW takes the same values
        if o.delayed_update is not False and o.optimizer_mode == "gpu":
            raise ValueError(
                "wrap(): option delayed_update needs the host AdamW: optimizer_mode='gpu' updates on the "
                "GPU, where the update cannot be delayed; pass optimizer_mode='cpu' or 'auto' (which "
                "updates on the host with delayed_update)"
            )
        if o.delayed_update is not False and o.distributed is True:
            raise ValueError(
                "wrap(): option delayed_update is not supported with distributed=True (the owners' "
                "broadcast of the new weights is not delayed); pass delayed_update=False"
            )
        # delayed_update: "auto" keeps its mapped share and its VRAM share (no resident switch:
        # optim.py), both updated by the GPU without delay (engine/delayed.py)
        share = parse_nvme_offload(o.nvme_offload)  # kept as given: OffloadAdamW takes the same values
        o.nvme_dir = parse_nvme_dir(o.nvme_dir)
        if share != "auto" and share > 0:
            for bad, why in (
                (o.optimizer_mode == "gpu", "optimizer_mode='gpu' updates on the GPU; pass 'cpu' or 'auto'"),
                (o.distributed is True, "distributed=True is not supported with it yet"),
            ):
                if bad:
                    raise ValueError(
                        f"wrap(): option nvme_offload={o.nvme_offload!r} puts the host-updated optimizer "
                        f"state on disk: {why}; or pass nvme_offload=False"
                    )
            o.optimizer_mode, o.offload = "cpu", True  # the state stays on the host (and disk)
        o.nvme_weights = parse_nvme_weights(o.nvme_weights)
        if o.nvme_weights not in ("auto", False, 0, []) and o.distributed is True:
            raise ValueError(
                f"wrap(): option nvme_weights={o.nvme_weights!r} puts streamed blocks' frozen weights on "
                "disk: distributed=True is not supported with it yet; pass nvme_weights=False"
            )
        o.accumulation_steps = parse_accumulation_steps(o.accumulation_steps)
        o.moment_dtype = parse_moment_dtype(o.moment_dtype)
        o.threads = parse_threads(o.threads)
        if (
            isinstance(o.lr, bool)
            or not isinstance(o.lr, (int, float))
            or not math.isfinite(o.lr)
            or o.lr < 0
        ):
            raise _fail("lr", o.lr, "a finite number >= 0")
        o.lr = float(o.lr)
        if isinstance(o.bucket_bytes, bool) or not isinstance(o.bucket_bytes, int) or o.bucket_bytes < 4096:
            raise _fail("bucket_bytes", o.bucket_bytes, "an integer >= 4096")
        if o.max_inflight_bytes is not None and (
            isinstance(o.max_inflight_bytes, bool)
            or not isinstance(o.max_inflight_bytes, int)
            or o.max_inflight_bytes < (1 << 20)
        ):
            raise _fail("max_inflight_bytes", o.max_inflight_bytes, "None or an integer >= 1 MiB")
        o.activation_offload = parse_activation_offload(o.activation_offload)
        for name, lo in (("prefetch_depth", 1), ("min_offload_bytes", 0), ("weight_window", 1)):
            v = getattr(o, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < lo:
                raise _fail(name, v, f"an integer >= {lo}")
        v = o.max_activation_slowdown
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0:
            raise _fail("max_activation_slowdown", v, "a finite number >= 0")
        o.max_activation_slowdown = float(v)
        if o.blocks is not None:
            if (
                not isinstance(o.blocks, (list, tuple))
                or not o.blocks
                or not all(isinstance(m, torch.nn.Module) for m in o.blocks)
            ):
                raise _fail("blocks", o.blocks, "None (auto-detect) or a non-empty list of nn.Module")
        if (
            isinstance(o.vram_headroom, bool)
            or not isinstance(o.vram_headroom, (int, float))
            or not 0.0 <= o.vram_headroom < 1.0
        ):
            raise _fail("vram_headroom", o.vram_headroom, "a number in [0, 1)")
        o.quantize = parse_quantize_option(o.quantize)
        o.quant_block_size = parse_quant_block_size(o.quant_block_size)
        o.prefer = parse_prefer(o.prefer)
        for name in ("batch", "seq"):
            v = getattr(o, name)
            if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
                raise _fail(name, v, "None (planned for the default step) or an integer >= 1")
        if o.loss not in (None, "dense", "chunked"):
            raise _fail("loss", o.loss, "None (dense), 'dense', 'chunked'")
        if o.plan is not None and type(o.plan).__name__ != "Plan":
            raise TypeError(
                f"wrap(): option plan must be a ramstream Plan (ramstream.plan_for), got {type(o.plan).__name__}"
            )
        return o


def parse_activation_offload(value: Any):
    """ "auto", True, False, or a fraction in [0, 1] of the block stack."""
    return parse_block_choice("activation_offload", value, lists=False)


def parse_block_choice(name: str, value, *, auto: bool = True, lists: bool = True):
    """A wrap() option that chooses blocks: "auto" (if `auto`), True, False, a fraction in [0, 1]
    of the stack (from the front), or (if `lists`) a list of block indices (sorted, unique);
    ValueError naming `name` and the accepted values otherwise."""
    if value is True or value is False or (auto and isinstance(value, str) and value == "auto"):
        return value
    if (
        isinstance(value, (int, float))
        and not isinstance(value, bool)
        and math.isfinite(value)
        and 0 <= value <= 1
    ):
        return float(value)
    if (
        lists
        and isinstance(value, (list, tuple))
        and all(isinstance(i, int) and not isinstance(i, bool) for i in value)
    ):
        return sorted(set(value))
    accepted = (
        ("'auto', " if auto else "")
        + "True, False, a fraction in [0, 1]"
        + (", or a list of block indices" if lists else "")
    )
    raise ValueError(f"wrap(): option {name}={value!r} is not accepted; accepted: {accepted}")


def parse_param_offload(value):
    """ "auto", True, False, a fraction in [0, 1] of the block stack, or a list of block indices."""
    return parse_block_choice("param_offload", value)


def parse_checkpointing(value):
    """ "auto", False, True, a fraction in [0, 1] of the block stack (from the front), or block
    indices."""
    return parse_block_choice("activation_checkpointing", value)


def parse_quantize_option(value) -> str:
    """'auto', 'none' (also None, False), 'int8', 'nf4'."""
    if value is None or value is False:
        return "none"
    if isinstance(value, str) and value in ("auto", "none", "int8", "nf4"):
        return value
    raise ValueError(
        f"wrap(): option quantize={value!r} is not accepted; accepted: 'auto', 'none', None, False, 'int8', 'nf4'"
    )


def parse_prefer(value) -> str:
    if isinstance(value, str) and value in ("exact", "speed"):
        return value
    raise ValueError(f"wrap(): option prefer={value!r} is not accepted; accepted: 'exact', 'speed'")


def parse_block_size(value, where: str = "quantize_model(): block_size") -> int:
    v = None
    if not isinstance(value, (bool, float)):
        try:
            v = operator.index(value)
        except TypeError:
            pass
    if v is None or v < 2 or v % 2 or v >= 2**31:
        raise ValueError(
            f"{where}={value!r} is not accepted; accepted: an even integer in [2, 2**31) (default 64)"
        )
    return v


def parse_quant_block_size(value) -> int:
    return parse_block_size(value, "wrap(): option quant_block_size")


def parse_device(value: Any, where: str = "wrap(): option") -> torch.device | None:
    """None, 'cpu', 'cuda', 'cuda:N' or a torch.device; ValueError otherwise, RuntimeError for a
    CUDA device when torch sees no GPU."""
    if value is None:
        return None
    accepted = "None, 'cpu', 'cuda', 'cuda:N', a torch.device"
    if (
        isinstance(value, bool)
        or not isinstance(value, (str, torch.device, int))
        or (isinstance(value, int) and value < 0)
    ):
        raise ValueError(f"{where} device={value!r} is not accepted; accepted: {accepted}")
    try:
        # an integer is a CUDA index (torch.device(int) would pick whichever accelerator exists)
        dev = torch.device("cuda", value) if isinstance(value, int) else torch.device(value)
    except (RuntimeError, TypeError, ValueError):
        raise ValueError(f"{where} device={value!r} is not accepted; accepted: {accepted}") from None
    if dev.type not in ("cpu", "cuda"):
        raise ValueError(f"{where} device={value!r} is not accepted; accepted: {accepted}")
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise RuntimeError(
                f"{where} device={value!r}: torch sees no CUDA GPU; pass "
                "device='cpu' to run the engine on the CPU"
            )
        if dev.index is None:
            dev = torch.device("cuda", torch.cuda.current_device())
        elif dev.index >= torch.cuda.device_count():
            raise ValueError(
                f"{where} device={value!r} is not accepted: torch sees "
                f"{torch.cuda.device_count()} CUDA device(s), cuda:0 to "
                f"cuda:{torch.cuda.device_count() - 1}"
            )
    return dev
