"""The one look at a live model and machine that the planner needs: the model's ModelShape (its
quantized layers' packed codes counted as frozen weights) and the HardwareProfile of the device it
will train on, then plan_for(): the Plan wrap() applies, without training; and, when no plan
decided it, the numbers activation_checkpointing="auto" weighs (recompute_rule: planner/wrap_rules.py
decides)."""

from __future__ import annotations

import dataclasses

import torch

from ..planner import rules
from ..planner.plan import plan_training
from ..planner.profile import HardwareProfile
from ..planner.result import Plan, PlanError
from ..planner.shape import ModelShape

# What plan_for() passes on to plan_training (the wrap() options that change the plan).
PLAN_OPTIONS = (
    "param_offload",
    "activation_offload",
    "activation_checkpointing",
    "optimizer_mode",
    "moment_dtype",
    "vram_headroom",
    "max_activation_slowdown",
    "nvme_offload",
    "nvme_weights",
    "accumulation_steps",
    "delayed_update",
)
_GIB = 2**30


def _nbytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def _model_tensors(model: torch.nn.Module) -> list[torch.Tensor]:
    seen = {}
    for t in list(model.parameters()) + list(model.buffers()):
        seen.setdefault(id(t), t)
    return list(seen.values())


def model_shape(model, blocks, *, batch: int, seq: int, loss: str) -> ModelShape:
    """ModelShape.from_model, with each block's packed quantized codes (buffers, not parameters)
    counted as frozen weight bytes and their full-precision elements as frozen elements."""
    from ..quant.packed import packed_buffers, quantized_numel

    shape = ModelShape.from_model(model, blocks, batch=batch, seq=seq, loss=loss)
    out = []
    for b, bs in zip(blocks, shape.blocks):
        packed = sum(t.nbytes for _, _, t in packed_buffers(b))
        if packed:
            bs = dataclasses.replace(
                bs, frozen_bytes=bs.frozen_bytes + packed, frozen_numel=bs.frozen_numel + quantized_numel(b)
            )
        out.append(bs)
    return dataclasses.replace(shape, blocks=tuple(out))


def block_elements(blocks) -> tuple[int, int]:
    """(trained elements, all elements) of the blocks' weights, a quantized layer's frozen weight
    (packed buffers, no parameter) counted by its full-precision elements."""
    from ..quant.packed import quantized_numel

    params = list(dict.fromkeys(p for b in blocks for p in b.parameters()))
    total = sum(p.numel() for p in params) + sum(quantized_numel(b) for b in blocks)
    return sum(p.numel() for p in params if p.requires_grad), total


def is_lora_like(blocks) -> bool:
    """wrap_rules.lora_like on the live blocks (block_elements)."""
    from ..planner.wrap_rules import lora_like

    return lora_like(*block_elements(blocks))


def recompute_rule(model, blocks, device: torch.device, optimizer_mode: str = "auto"):
    """activation_checkpointing="auto" for the live model without a plan: the numbers
    wrap_rules.auto_recompute weighs, counted here (usable VRAM: gpu_memory's cap; the blocks'
    bytes on the device: parameters + a quantized layer's packed codes; the model's parameter
    bytes and its trained parameters' moments and gradients) -> its RecomputeRule."""
    from ..hardware import gpu_memory, kernels_problem
    from ..planner.wrap_rules import auto_recompute, moments_and_gradients
    from ..quant.packed import packed_buffers

    on_gpu = device.type == "cuda"
    trained, total = block_elements(blocks)
    in_blocks = list(dict.fromkeys(p for b in blocks for p in b.parameters()))
    block_bytes = _nbytes(in_blocks) + sum(t.nbytes for b in blocks for _, _, t in packed_buffers(b))
    params = list(model.parameters())
    return auto_recompute(
        n_blocks=len(blocks),
        trained=trained,
        total=total,
        block_bytes=block_bytes,
        weights=_nbytes(params),
        state=sum(moments_and_gradients(p.numel(), p.element_size()) for p in params if p.requires_grad),
        usable=gpu_memory(device)["cap"] if on_gpu else None,
        optimizer_mode=optimizer_mode,
        kernels=on_gpu and kernels_problem() is None,
        hf_checkpointing=any(getattr(b, "gradient_checkpointing", False) for b in blocks),
    )


def auto_checkpointing(model, blocks, device: torch.device, log, optimizer_mode: str = "auto") -> bool:
    """Whether every block recomputes under activation_checkpointing="auto" when no plan decided
    it (recompute_rule), logging the arithmetic when it does."""
    r = recompute_rule(model, blocks, device, optimizer_mode)
    if r.on:
        log(r.log_line())
    return r.on


def live_profile(
    model: torch.nn.Module, device: torch.device, rates: HardwareProfile | None = None
) -> HardwareProfile:
    """The machine as the plan sees it before wrap() moves anything: VRAM the process may still take
    on `device` (under any per-process cap) plus what the model already holds there; host RAM
    available plus what the model holds in host memory (it leaves for the device, or becomes the
    streamed blocks' pinned home, which the plan counts itself). Rates from `rates` (a cached or
    measured profile), else the H200 machine's defaults (planner/cli_plan.py DEFAULT_RATES)."""
    from ..hardware import allocatable, gpu_memory
    from ..ops.memory import pin_budget
    from ..planner.profile import available_ram, local_world_size
    from ..planner.rules import DEFAULT_RATES

    tensors = _model_tensors(model)
    ram = available_ram()
    on_host = _nbytes(t for t in tensors if t.device.type == "cpu")
    if device.type == "cuda":
        mem = gpu_memory(device)
        on_dev = _nbytes(t for t in tensors if t.device == device)
        # what the caching allocator holds but has not handed out is free to this process too
        vram_total, vram_free = int(mem["total"]), allocatable(mem) + on_dev
        name = torch.cuda.get_device_name(device)
    else:
        vram_total = vram_free = 0
        name = None
    got = {k: getattr(rates, k) for k in DEFAULT_RATES} if rates is not None and rates.vram_total else None
    return HardwareProfile(
        device=str(device), gpu_name=name, vram_total=vram_total, vram_free=vram_free,
        ram_total=int(ram["total"]), ram_available=int(ram["available"]) + on_host,
        pin_budget=int(pin_budget()), local_world_size=local_world_size(),
        source=rates.source if got else "given", **(got or DEFAULT_RATES),
    )  # fmt: skip


def _token_steps(batch, seq):
    """The (batch, seq) pairs plan_for tries: the given ones, else PLAN_BATCH x PLAN_SEQ halving the
    batch, then the sequence, down to PLAN_MIN_TOKENS tokens, then one token (the weights' plan: a
    step's activations are then checked at its first forward, runtime/tokens.py)."""
    if batch is not None or seq is not None:
        return [(batch or 1, seq or rules.PLAN_SEQ)]
    b, s, out = rules.PLAN_BATCH, rules.PLAN_SEQ, []
    while b * s >= rules.PLAN_MIN_TOKENS:
        out.append((b, s))
        b, s = (b // 2, s) if b > 1 else (b, s // 2)
    return out + [(1, 1)]


def plan_model(
    model, blocks, profile: HardwareProfile, *, batch=None, seq=None, loss=None, **options
) -> tuple[Plan, ModelShape]:
    """(Plan, the ModelShape it was made for) for `model` on `profile`; options: PLAN_OPTIONS.
    Without batch / seq, the largest step from PLAN_BATCH x PLAN_SEQ down that fits (the plan's
    shape says which); PlanError (a MemoryError with the smallest step's arithmetic) when none does."""
    loss = loss or rules.PLAN_LOSS
    error = None
    for b, s in _token_steps(batch, seq):
        shape = model_shape(model, blocks, batch=b, seq=s, loss=loss)
        try:
            plan = plan_training(shape, profile, quantize="none", **options)
        except PlanError as e:
            error = e  # the last: the smallest step's arithmetic
            continue
        if error is not None:
            plan.reasons.append(
                f"planned for batch {b} x seq {s}: the default {rules.PLAN_BATCH} x {rules.PLAN_SEQ} does not fit "
                f"(a larger step is checked at its first forward; pass batch= and seq= to plan for it)"
            )
        return plan, shape
    raise error


def plan_for(model: torch.nn.Module, optimizer=None, *, batch: int | None = None, seq: int | None = None,
             loss: str | None = None, device=None, profile: HardwareProfile | None = None, blocks=None,
             **options) -> Plan:  # fmt: skip
    """The Plan wrap(model, optimizer, **options) would apply, without training and without moving
    anything: which blocks stream their weights, which recompute, where the optimizer state lives,
    the moment dtype, the predicted step and memory. Pass it to wrap(..., plan=plan) to pin it.

    Args:
        optimizer: the optimizer wrap() would get (its parameters that require grad are trained;
            None: every parameter that requires grad).
        batch, seq: the step's size, when known (else the default step, halved until it fits:
            planner/rules.py PLAN_BATCH x PLAN_SEQ).
        loss: "dense" (a full cross-entropy: its logits and their gradient count) or "chunked"
            (ramstream.chunked_cross_entropy).
        device: the training device (default: the current CUDA device, else the model's).
        profile: a HardwareProfile to plan on instead of this machine (tests, what-if).
        blocks: the block stack (default: ramstream's find_blocks).
        options: wrap()'s param_offload, activation_offload, activation_checkpointing,
            optimizer_mode, moment_dtype, vram_headroom, max_activation_slowdown, nvme_offload,
            nvme_weights, accumulation_steps, delayed_update.

    Raises PlanError (a MemoryError) with the arithmetic when nothing fits; ValueError / TypeError
    for bad arguments.
    """
    from ..blocks import check_blocks, find_blocks
    from ..options import WrapOptions, parse_device

    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"plan_for(): model must be a torch.nn.Module, got {type(model).__name__}")
    unknown = sorted(set(options) - set(PLAN_OPTIONS))
    if unknown:
        raise ValueError(
            f"plan_for(): unknown option(s) {', '.join(unknown)}; accepted: batch, seq, loss, device, "
            f"profile, blocks, {', '.join(PLAN_OPTIONS)}"
        )
    for name, v in (("batch", batch), ("seq", seq)):
        if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
            raise ValueError(f"plan_for(): {name}={v!r} is not accepted; accepted: None or an int >= 1")
    if loss not in (None, "dense", "chunked"):
        raise ValueError(f"plan_for(): loss={loss!r} is not accepted; accepted: None, 'dense', 'chunked'")
    if profile is not None and not isinstance(profile, HardwareProfile):
        raise TypeError(f"plan_for(): profile must be a HardwareProfile, got {type(profile).__name__}")
    if optimizer is not None and not hasattr(optimizer, "param_groups"):
        raise TypeError(
            f"plan_for(): optimizer must be None or a torch optimizer (with param_groups), got "
            f"{type(optimizer).__name__}"
        )
    opts = WrapOptions.parse(**options)
    if device is None:
        first = next(model.parameters(), None)
        device = torch.device("cuda") if torch.cuda.is_available() else getattr(first, "device", "cpu")
        device = torch.device(device)
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
    else:
        device = parse_device(device, "plan_for():")
    blocks = check_blocks("plan_for()", model, blocks) if blocks is not None else find_blocks(model)
    if profile is None:
        profile = live_profile(model, device, _rates(device))
    kw = {k: getattr(opts, k) for k in PLAN_OPTIONS}
    with _trained_only(model, optimizer):
        plan, _ = plan_model(model, blocks, profile, batch=batch, seq=seq, loss=loss, **kw)
    return plan


def _rates(device: torch.device) -> HardwareProfile | None:
    """This machine's profile as wrap() reads it (profile_hardware: the cache, else measured once and
    cached), so that plan_for() and wrap() plan on the same rates; None on the CPU or on failure
    (the default rates then)."""
    if device.type != "cuda":
        return None
    from ..planner.profile import profile_hardware

    try:
        return profile_hardware(device)
    except Exception:  # noqa: BLE001 - the default rates take over, as in wrap()
        return None


class _trained_only:
    """Within the block, only the optimizer's parameters require grad (the shape counts trained
    elements by requires_grad); restored after."""

    def __init__(self, model, optimizer) -> None:
        self.model, self.optimizer, self.saved = model, optimizer, []

    def __enter__(self):
        if self.optimizer is None:
            return self
        mine = {id(p) for g in self.optimizer.param_groups for p in g["params"]}
        for p in self.model.parameters():
            if p.requires_grad and id(p) not in mine:
                self.saved.append(p)
                p.requires_grad_(False)
        return self

    def __exit__(self, *exc) -> None:
        for p in self.saved:
            p.requires_grad_(True)


LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def config_model(config, *, dtype: str = "bfloat16", lora: int | None = None) -> torch.nn.Module:
    """The Hugging Face causal LM of `config` (a config.json path, its folder or a dict) built on the
    meta device (no memory, no initialisation), with peft LoRA rank `lora` on the seven projections
    and its base frozen: the module wrap() would inspect, for `ramstream plan --config`. ImportError
    without transformers (and peft for lora)."""
    import os

    from transformers import AutoConfig, AutoModelForCausalLM

    if isinstance(config, dict):
        cfg = AutoConfig.for_model(**config)
    else:
        path = os.fspath(config)
        folder = os.path.dirname(path) if os.path.isfile(path) else path
        cfg = AutoConfig.from_pretrained(folder)
    dt = {"bfloat16": torch.bfloat16, "float32": torch.float32, "float16": torch.float16}[dtype]
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(cfg, dtype=dt)
        if lora:
            from peft import LoraConfig, get_peft_model

            model = get_peft_model(
                model, LoraConfig(r=lora, lora_alpha=2 * lora, target_modules=list(LORA_TARGETS))
            )
    return model
