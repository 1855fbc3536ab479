"""wrap()'s size rules as pure functions over numbers: whether the blocks are LoRA-like, the share of
usable VRAM the resident weights may take, how many front blocks stream to get under it, and
activation_checkpointing="auto" (every block recomputes, or none), and the gradients' in-flight
budget. Nothing here sees a module: the
runtime counts the numbers on the live model (runtime/inspect.py) and the planner on a ModelShape
(policy.py), and both ask these functions, so that the plan and wrap() cannot disagree. Every
threshold is read from rules.py."""

from __future__ import annotations

from dataclasses import dataclass

from .rules import (
    GRAD_INFLIGHT_MAX,
    GRAD_INFLIGHT_MIN,
    LORA_LIKE,
    RECOMPUTE_FULL_FT,
    RECOMPUTE_LORA_WEIGHTS,
    STREAM_SHARE,
)

_GIB = 2**30


def lora_like(trained: int, total: int) -> bool:
    """Whether blocks that train `trained` of their `total` weight elements (a quantized layer's
    frozen weight counted by its full-precision elements) are LoRA-like: less than LORA_LIKE of
    them train. No elements: not LoRA-like."""
    return total > 0 and trained < LORA_LIKE * total


def weight_share(trained: int, total: int, recompute_all: bool = False) -> float:
    """The share of usable VRAM the resident weights may take (STREAM_SHARE): 70 % for LoRA-like
    blocks (a frozen base: little room for gradients and optimizer state) or when every block
    recomputes (activations then take little room), 50 % otherwise. quantize="auto" and
    param_offload="auto" both plan with it."""
    return STREAM_SHARE[bool(recompute_all) or lora_like(trained, total)]


def front_blocks_to_stream(total_bytes: int, block_bytes, room: float) -> int:
    """The fewest front blocks whose streaming brings the resident weights (`total_bytes`, of which
    block i holds block_bytes[i]) to at most `room` bytes; every block when even that does not."""
    k, resident = 0, total_bytes
    while resident > room and k < len(block_bytes):
        resident -= block_bytes[k]
        k += 1
    return k


def grad_inflight_bytes(usable: int) -> int:
    """The default max_inflight_bytes (the device bytes gradients on their way to the host may hold
    before backward waits; OffloadAdamW passes it to the engine): a tenth of the `usable` bytes
    (gpu_memory's cap: a per-process cap included), within [GRAD_INFLIGHT_MIN, GRAD_INFLIGHT_MAX]."""
    return max(GRAD_INFLIGHT_MIN, min(GRAD_INFLIGHT_MAX, usable // 10))


def moments_and_gradients(numel: int, grad_bytes: int) -> int:
    """Device bytes full fine-tuning needs per trained parameter beside its weight: two fp32
    moments (8 B an element) and a gradient of `grad_bytes` an element."""
    return numel * (8 + grad_bytes)


@dataclass(frozen=True)
class RecomputeRule:
    """activation_checkpointing="auto"'s decision and the numbers behind it. `rule`: "lora" or
    "full_ft" (the rule that was weighed), or why none was: "cpu engine", "no blocks",
    "hf checkpointing", "no elements", "optimizer cpu", "no kernels"."""

    on: bool
    rule: str
    trained: int = 0
    total: int = 0
    usable: int = 0
    block_bytes: int = 0
    weights: int = 0
    state: int = 0

    def why(self) -> str:
        """The plan's reason (Plan.reasons: "activation_checkpointing=auto: ... (why)")."""
        cmp = ">" if self.on else "<="
        if self.rule == "lora":
            return (
                f"LoRA-like, block weights {self.block_bytes / _GIB:.2f} GiB {cmp} "
                f"{RECOMPUTE_LORA_WEIGHTS:.0%} of {self.usable / _GIB:.2f} GiB"
            )
        if self.rule == "full_ft":
            return (
                f"full fine-tuning, weights {self.weights / _GIB:.2f} + moments and gradients "
                f"{self.state / _GIB:.2f} GiB {cmp} {RECOMPUTE_FULL_FT:.0%} of {self.usable / _GIB:.2f} GiB"
            )
        return {
            "optimizer cpu": "full fine-tuning with optimizer_mode='cpu'",
            "no kernels": "full fine-tuning without ramstream's CUDA kernels",
            "hf checkpointing": "Hugging Face's gradient checkpointing recomputes the layers already",
            "no elements": "the blocks hold no weight elements",
            "cpu engine": "the CPU engine",
        }.get(self.rule, self.rule)

    def log_line(self) -> str | None:
        """wrap()'s log line when every block recomputes (None when none does)."""
        if not self.on:
            return None
        if self.rule == "lora":
            return (
                f"activation_checkpointing=auto: {self.trained / self.total:.1%} of the blocks' parameters "
                f"train (LoRA-like) and their weights ({self.block_bytes / _GIB:.2f} GiB) fill more than a "
                f"quarter of {self.usable / _GIB:.2f} GiB: every block recomputes in backward"
            )
        return (
            f"activation_checkpointing=auto: full fine-tuning; weights {self.weights / _GIB:.2f} GiB + "
            f"moments and gradients {self.state / _GIB:.2f} GiB > {RECOMPUTE_FULL_FT:.0%} of "
            f"{self.usable / _GIB:.2f} GiB usable: every block recomputes in backward, so that VRAM keeps "
            "a share of the optimizer state"
        )


def auto_recompute(
    *,
    n_blocks: int,
    trained: int,
    total: int,
    block_bytes: int,
    weights: int,
    state: int,
    usable: int | None,
    optimizer_mode: str = "auto",
    kernels: bool = True,
    hf_checkpointing: bool = False,
) -> RecomputeRule:
    """activation_checkpointing="auto": whether every block recomputes in backward.

    - LoRA-like blocks (`trained` < LORA_LIKE x `total` elements, quantized weights at full size):
      when their weights (`block_bytes`: what VRAM holds of them, a quantized layer's packed bytes)
      exceed RECOMPUTE_LORA_WEIGHTS of `usable` (recomputing a frozen layer is cheaper than paging
      its activations, measured on the Qwen2.5-7B shape).
    - Full fine-tuning: when the model's `weights` + `state` (moments_and_gradients of its trained
      parameters) exceed RECOMPUTE_FULL_FT of `usable`: the VRAM activations would hold keeps a
      share of the optimizer state instead, updated on the GPU (runtime/optimizer_split.py); never
      with optimizer_mode="cpu" or without ramstream's CUDA kernels (`kernels`).
    - Never on the CPU engine (`usable` None), without blocks or block elements, or with Hugging
      Face's own gradient checkpointing on (`hf_checkpointing`: the layers recompute already).
    """
    if usable is None:
        return RecomputeRule(False, "cpu engine")
    if n_blocks == 0:
        return RecomputeRule(False, "no blocks")
    if hf_checkpointing:
        return RecomputeRule(False, "hf checkpointing")
    if total == 0:
        return RecomputeRule(False, "no elements")
    nums = dict(
        trained=trained, total=total, usable=usable, block_bytes=block_bytes, weights=weights, state=state
    )
    if lora_like(trained, total):
        return RecomputeRule(block_bytes > usable * RECOMPUTE_LORA_WEIGHTS, "lora", **nums)
    if optimizer_mode == "cpu":
        return RecomputeRule(False, "optimizer cpu", **nums)
    if not kernels:
        return RecomputeRule(False, "no kernels", **nums)
    return RecomputeRule(weights + state > RECOMPUTE_FULL_FT * usable, "full_ft", **nums)
