"""`ramstream plan`: the plan for a model (a Hugging Face config.json or a built-in GPT size) on this
machine or on given sizes and rates, without training and without a GPU; exit code 2 when it
cannot fit."""

from __future__ import annotations

import importlib.util
import json
import math
import os
import sys

from .._paths import read_json
from . import cli_pipeline
from .plan import PlanError, plan_training
from .profile import HardwareProfile
from .rules import DEFAULT_RATES, DEFAULT_VRAM  # noqa: F401  (cli_plan.DEFAULT_RATES: its old name)
from .shape import GPT_SIZES, ModelShape
from .timing import HOST_UNDER_DMA, MAPPED_EFFICIENCY, MATMUL_EFFICIENCY

_GB = 2**30


def add_arguments(p) -> None:
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument(
        "--config", metavar="PATH", help="a Hugging Face config.json (or its folder): Llama, Qwen2, Mistral"
    )
    src.add_argument(
        "--gpt", metavar="SIZE", choices=sorted(GPT_SIZES), help=f"a built-in GPT: {', '.join(GPT_SIZES)}"
    )
    p.add_argument(
        "--vram-gb",
        type=float,
        help="usable GPU memory in GiB (default: the cached profile's free memory; required when no GPU profile exists)",
    )
    p.add_argument(
        "--ram-gb", type=float, help="available host RAM in GiB (default: this machine's, per rank)"
    )
    p.add_argument("--batch", type=int, default=1, help="sequences per step (default: 1)")
    p.add_argument("--seq", type=int, default=1024, help="tokens per sequence (default: 1024)")
    p.add_argument(
        "--lora", type=int, metavar="R", help="LoRA rank R on q,k,v,o,gate,up,down; the base frozen"
    )
    p.add_argument("--dtype", choices=("bf16", "fp32"), default="bf16", help="working dtype (default: bf16)")
    p.add_argument("--chunked-loss", action="store_true", help="the loss never builds the full logits")
    p.add_argument("--accumulation-steps", type=int, default=1, metavar="N",
                   help="wrap()'s accumulation_steps (N > 1: a 4-byte fp32 sum per trained parameter in RAM)")  # fmt: skip
    p.add_argument("--delayed-update", action="store_true",
                   help="wrap(delayed_update=True): no resident plan, the mapped share chosen for the delay, the host lane the update alone; its buffers count in RAM")  # fmt: skip
    p.add_argument(
        "--autocast",
        action="store_true",
        help="an fp32 --gpt trained under bf16 autocast (activations in bf16)",
    )
    for name, what in (
        ("h2d-gbps", "host-to-device GB/s"),
        ("d2h-gbps", "device-to-host GB/s"),
        ("duplex-gbps", "GB/s each way when both directions run"),
        ("adamw-gbps", "host AdamW state traffic GB/s"),
        ("tflops", "bf16 matmul peak TFLOP/s"),
    ):
        p.add_argument(f"--{name}", type=float, help=what)
    disk = p.add_argument_group("disk tier (wrap()'s nvme_dir, nvme_offload)")
    disk.add_argument("--nvme-dir", metavar="PATH", help="a folder for the optimizer state on disk: its rates are "
                      "measured (2 x 256 MiB written and read) and its free space read")  # fmt: skip
    disk.add_argument("--nvme-gbps", metavar="READ[,WRITE]", help="the disk's read and write GB/s (WRITE defaults to "
                      "READ) instead of measuring; free space from --nvme-dir, --nvme-free-gb or assumed enough")  # fmt: skip
    disk.add_argument("--nvme-free-gb", type=float, metavar="GIB", help="free space on that disk in GiB")
    disk.add_argument("--nvme-offload", default="auto", metavar="{auto,true,false,FLOAT}",
                      help="the share of the host optimizer state on disk: auto (the smallest that fits RAM, when a "
                      "disk is given), true (all), false (none) or a share in [0, 1] (default: auto)")  # fmt: skip
    disk.add_argument("--nvme-weights", default="auto", metavar="{auto,true,false,K}",
                      help="streamed blocks' frozen weights on disk: auto (the fewest, from the back, when RAM is "
                      "short and a disk is given), true (all), false (none) or K (the last K streamed blocks)")  # fmt: skip
    p.add_argument("--json", action="store_true", help="print the plan as JSON")
    cli_pipeline.add_arguments(p)


def _nvme_weights(text: str):
    """--nvme-weights as plan_training's nvme_weights; ValueError naming the flag and the values."""
    low = text.strip().lower()
    if low in ("auto", "true", "false"):
        return {"auto": "auto", "true": True, "false": False}[low]
    if low.isdigit():
        return int(low)
    raise ValueError(f"--nvme-weights {text!r} is not accepted; accepted: auto, true, false or an int K >= 0")


def _nvme_offload(text: str):
    """--nvme-offload as plan_training's nvme_offload; ValueError naming the flag and the values."""
    low = text.strip().lower()
    if low in ("auto", "true", "false"):
        return {"auto": "auto", "true": True, "false": False}[low]
    try:
        v = float(low)
    except ValueError:
        v = math.nan
    if not (0 <= v <= 1):
        raise ValueError(
            f"--nvme-offload {text!r} is not accepted; accepted: auto, true, false or a share in [0, 1]"
        )
    return v


def _disk(args) -> tuple[dict, str | None]:
    """The profile's disk_* fields from --nvme-dir / --nvme-gbps / --nvme-free-gb, and where they came
    from (None: no disk). ValueError naming the flag for a bad value, OSError for the folder."""
    import shutil

    from .measure import disk_rates

    if args.nvme_free_gb is not None and not (math.isfinite(args.nvme_free_gb) and args.nvme_free_gb >= 0):
        raise ValueError(f"--nvme-free-gb must be a finite number >= 0, got {args.nvme_free_gb:g}")
    if args.nvme_gbps is None:
        if args.nvme_dir is None:
            if args.nvme_free_gb is not None:
                raise ValueError("--nvme-free-gb needs --nvme-gbps READ[,WRITE] or --nvme-dir PATH")
            return {}, None
        disk, src = disk_rates(args.nvme_dir), f"measured in {args.nvme_dir}"
    else:
        try:
            rates = [float(x) for x in args.nvme_gbps.split(",")]
        except ValueError:
            rates = []
        if len(rates) not in (1, 2) or not all(math.isfinite(r) and r > 0 for r in rates):
            raise ValueError(
                f"--nvme-gbps {args.nvme_gbps!r} is not accepted; accepted: READ or READ,WRITE in GB/s (finite, > 0)"
            )
        disk = {"disk_read_gbps": rates[0], "disk_write_gbps": rates[-1], "disk_free": None, "disk_dir": None}
        if args.nvme_dir is not None:
            disk.update(
                disk_dir=os.path.abspath(args.nvme_dir), disk_free=int(shutil.disk_usage(args.nvme_dir).free)
            )
        src = "rates given" + (f", free space of {args.nvme_dir}" if args.nvme_dir else "")
    if args.nvme_free_gb is not None:
        disk["disk_free"] = int(args.nvme_free_gb * _GB)
        src += ", free space given"
    elif disk["disk_free"] is None:
        src += ", free space assumed enough"
    return disk, src


def _machine(args) -> tuple[HardwareProfile, dict]:
    """The profile to plan on and where each number came from."""
    from ..ops.memory import pin_budget
    from .profile import available_ram, cached_profile, local_world_size

    cached = None
    try:
        cached = cached_profile()
    except (RuntimeError, ValueError):
        cached = None
    gpu = cached is not None and cached.vram_total > 0
    rates = {k: getattr(cached, k) for k in DEFAULT_RATES} if gpu else dict(DEFAULT_RATES)
    sources = {
        "rates": "cached profile of this machine" if gpu else "H200-machine defaults (no cached GPU profile)"
    }
    given = {
        "h2d_gbps": args.h2d_gbps,
        "d2h_gbps": args.d2h_gbps,
        "duplex_gbps": args.duplex_gbps,
        "adamw_gbps": args.adamw_gbps,
        "matmul_tflops": args.tflops,
    }
    for k, v in given.items():
        if v is not None:
            rates[k] = v
            sources[k] = "given"
    if args.duplex_gbps is None and (args.h2d_gbps is not None or args.d2h_gbps is not None):
        rates["duplex_gbps"] = (
            min(rates["h2d_gbps"], rates["d2h_gbps"])
            * DEFAULT_RATES["duplex_gbps"]
            / min(DEFAULT_RATES["h2d_gbps"], DEFAULT_RATES["d2h_gbps"])
        )
    if args.vram_gb is not None:
        vram, sources["vram"] = int(args.vram_gb * _GB), "given"
    elif gpu:
        vram, sources["vram"] = cached.vram_free, f"free on {cached.gpu_name}"
    else:  # no GPU to read: the caller says what to plan for (run() asks for --vram-gb)
        return None, sources
    if args.ram_gb is not None:
        ram = int(args.ram_gb * _GB)
        ram_total, pin, world = ram, ram // 2, 1
        sources["ram"] = "given"
    else:
        r = available_ram()
        ram, ram_total, pin, world = r["available"], r["total"], pin_budget(), local_world_size()
        sources["ram"] = "available on this machine"
    disk, sources["disk"] = _disk(args)
    if sources["disk"] is None:
        del sources["disk"]
    prof = HardwareProfile(device="cuda", vram_total=vram, vram_free=vram, ram_total=ram_total, ram_available=ram,
                           pin_budget=pin, local_world_size=world, source="given", **rates, **disk)  # fmt: skip
    return prof, sources


def _refuse(message: str) -> int:
    print(f"ramstream plan: {message}", file=sys.stderr)
    return 2


def _cached_vram() -> int | None:
    """The cached profile's free GPU memory (None without a cached GPU profile)."""
    from .profile import cached_profile

    try:
        cached = cached_profile()
    except (RuntimeError, ValueError):
        return None
    return cached.vram_free if cached is not None and cached.vram_total > 0 else None


def read_config(path: str) -> dict:
    """The JSON object of --config: a config.json, or a folder holding one. OSError or ValueError
    naming the file (checked before any work)."""
    if os.path.isdir(path):
        if not os.path.isfile(os.path.join(path, "config.json")):
            raise FileNotFoundError(f"--config folder {path!r} holds no config.json")
        path = os.path.join(path, "config.json")
    config = read_json(path, "--config")
    if not isinstance(config, dict):
        raise ValueError(f"--config {path!r} holds a JSON {type(config).__name__}, not an object")
    if "model_type" not in config and importlib.util.find_spec("transformers") is not None:
        raise ValueError(
            f"--config {path!r} has no 'model_type' key (a Hugging Face config.json names its "
            "architecture, e.g. 'llama', 'qwen2', 'mistral')"
        )
    return config


def _config_shape(args, config: dict, dtype: str, loss: str) -> ModelShape:
    """The shape wrap() would see: the model of the config (read_config) built on the meta device and
    inspected as wrap() inspects a live model (runtime/inspect.py), so that the plan printed is the
    one wrap() applies on the same machine; without transformers (or peft for --lora), the config's
    arithmetic (ModelShape.from_hf_config)."""
    try:
        from ..blocks import find_blocks
        from ..runtime.inspect import config_model, model_shape

        model = config_model(config, dtype=dtype, lora=args.lora)
    except ImportError:
        return ModelShape.from_hf_config(
            config, batch=args.batch, seq=args.seq, dtype=dtype, lora=args.lora, loss=loss
        )
    return model_shape(model, find_blocks(model), batch=args.batch, seq=args.seq, loss=loss)


def run(args) -> int:
    """The `ramstream plan` command: prints the plan (or the reason it cannot fit, exit code 2)."""
    for name in ("batch", "seq", "lora"):
        v = getattr(args, name)
        if v is not None and v < 1:
            print(f"ramstream plan: --{name} must be >= 1, got {v}", file=sys.stderr)
            return 2
    for name in ("vram_gb", "ram_gb", "h2d_gbps", "d2h_gbps", "duplex_gbps", "adamw_gbps", "tflops"):
        v = getattr(args, name)
        if v is not None and not (math.isfinite(v) and v > 0):
            flag = "--" + name.replace("_", "-")
            print(f"ramstream plan: {flag} must be a finite number > 0, got {v:g}", file=sys.stderr)
            return 2
    config = None
    if args.config:
        try:
            config = read_config(args.config)
        except (OSError, ValueError) as e:
            print(f"ramstream plan: {e}", file=sys.stderr)
            return 2
    dtype = "bfloat16" if args.dtype == "bf16" else "float32"
    loss = "chunked" if args.chunked_loss else "dense"
    try:
        if config is not None:
            shape = _config_shape(args, config, dtype, loss)
        else:
            if args.lora:
                print("ramstream plan: --lora applies to --config models only", file=sys.stderr)
                return 2
            amp = "bf16" if args.autocast and dtype == "float32" else None
            shape = ModelShape.gpt(
                args.gpt, batch=args.batch, seq=args.seq, dtype=dtype, loss=loss, autocast=amp
            )
    except (OSError, ValueError, TypeError) as e:
        where = f"--config {args.config!r}: " if args.config else ""
        print(f"ramstream plan: {where}{e}", file=sys.stderr)
        return 2
    if getattr(args, "stages", None) is not None:
        return cli_pipeline.run(args, shape, _cached_vram(), _refuse)
    try:
        nvme = _nvme_offload(args.nvme_offload)
        nvme_w = _nvme_weights(args.nvme_weights)
        if args.accumulation_steps < 1:
            raise ValueError(
                f"--accumulation-steps {args.accumulation_steps} is not accepted; accepted: an integer >= 1"
            )
        prof, sources = _machine(args)
    except (OSError, ValueError) as e:
        print(f"ramstream plan: {e}", file=sys.stderr)
        return 2
    if prof is None:
        print(
            "ramstream plan: no GPU is visible here and no cached GPU profile exists: pass --vram-gb, the "
            "GPU memory to plan for in GiB (the rates default to the H200 machine's; --h2d-gbps etc. change them)",
            file=sys.stderr,
        )
        return 2
    try:
        plan = plan_training(shape, prof, nvme_offload=nvme, nvme_weights=nvme_w,
                             accumulation_steps=args.accumulation_steps, delayed_update=args.delayed_update)  # fmt: skip
    except PlanError as e:
        if args.json:
            print(json.dumps({"fits": False, "error": str(e), "arithmetic": e.arithmetic, "options": e.options,
                              "profile": prof.to_dict(), "sources": sources}, indent=2))  # fmt: skip
        print(str(e), file=sys.stderr)
        return 2
    if args.json:
        print(
            json.dumps(
                {"fits": True, "plan": plan.to_dict(), "profile": prof.to_dict(), "sources": sources},
                indent=2,
            )
        )
        return 0
    print(plan.explain())
    print("numbers: " + "; ".join(f"{k}: {v}" for k, v in sources.items()))
    print(
        f"rates: H2D {prof.h2d_gbps:g} GB/s, D2H {prof.d2h_gbps:g}, both at once {prof.duplex_gbps:g} each, host AdamW "
        f"{prof.adamw_gbps:g} GB/s (x {HOST_UNDER_DMA:g} beside DMA), mapped GPU AdamW {MAPPED_EFFICIENCY:g} x H2D "
        f"each way, bf16 matmul {prof.matmul_tflops:g} TFLOP/s x efficiency {MATMUL_EFFICIENCY:g}"
        + (
            f", disk read {prof.disk_read_gbps:.3g} GB/s, write {prof.disk_write_gbps:.3g}"
            + (f", {prof.disk_free / _GB:.2f} GiB free" if prof.disk_free is not None else "")
            if prof.disk_read_gbps
            else ""
        )
    )
    return 0
