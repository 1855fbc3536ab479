"""wrap()'s host-RAM arithmetic: the moment dtype for moment_dtype="auto", and the refusal (a
MemoryError showing every component) when the host state and the streamed weights cannot fit; pure
arithmetic on the byte counts and the available RAM wrap() passes in."""

from __future__ import annotations

import torch

from .rules import HOST_RAM_SHARE as SHARE  # of the available RAM ramstream's host memory may take

GIB = 2**30


def host_components(
    numel: int,
    working_bytes: int,
    moment_bytes: int,
    accumulate: bool,
    streamed: int,
    delayed: bool | float = False,
    nvme_share: float = 0.0,
    bucket_bytes: int = 32 << 20,
) -> dict:
    """Host bytes by component for `numel` trained elements: fp32 master, two moments, the
    pinned landing buffer (working dtype), the fp32 accumulator (accumulation_steps > 1) and the
    streamed blocks' weights at home in pinned memory; with `delayed` (delayed_update: True, or
    the host-updated share of the elements, the only ones delayed) the pending weights and a
    second landing buffer (working dtype) and a second accumulator; with
    `nvme_share` (nvme_offload) that share of the master and moments is on disk, and the staging
    buffers (3 buckets' state, disk_tier.py) count instead."""
    keep = 1.0 - nvme_share
    out = {
        "fp32 master": int(numel * 4 * keep),
        "moments": int(numel * 2 * moment_bytes * keep),
        "landing buffer": numel * working_bytes,
        "streamed weights": streamed,
        **step_buffers(numel, working_bytes, accumulate, delayed),
    }
    if nvme_share > 0:
        bucket = min(numel, max(1, bucket_bytes // working_bytes))
        out["nvme staging buffers"] = 3 * bucket * (4 + 2 * moment_bytes)
    return out


def step_buffers(numel: int, working_bytes: int, accumulate: bool, delayed: bool | float) -> dict:
    """Host bytes beside the optimizer state for `numel` host-updated elements: the fp32 gradient
    accumulator (accumulation_steps > 1) and delayed_update's pending weights, second landing
    buffer (working dtype) and second accumulator, for all of them (delayed True) or that share
    (a float: the host-updated ones; GPU-updated buckets are not delayed). wrap()'s check
    (host_components) and the planner's RAM line (offload_host_memory) both count these."""
    out = {}
    if accumulate:
        out["accumulator"] = numel * 4
    share = 1.0 if delayed is True else float(delayed or 0.0)
    if share > 0:
        out["delayed update buffers"] = int(numel * share) * (2 * working_bytes + (4 if accumulate else 0))
    return out


def master_bytes(wb: int) -> int:
    """The fp32 master's bytes per element beside weights of `wb` bytes (none for fp32 weights)."""
    return 4 if wb < 4 else 0


def moment_bytes(moment: str) -> int:
    return 2 if moment == "bfloat16" else 4


def plan_step_buffers(ctx, numel: int, delayed_numel: int | None = None) -> dict:
    """step_buffers with the plan's component names (plan.py's ctx: wb, accumulate, delayed);
    delayed_update's buffers for `delayed_numel` elements (None: `numel`): the host-updated ones
    (a mapped share is not delayed: engine/delayed.py)."""
    extra = step_buffers(numel, ctx.wb, ctx.accumulate, False)
    if ctx.delayed:
        d = numel if delayed_numel is None else delayed_numel
        extra.update(
            {k: v for k, v in step_buffers(d, ctx.wb, ctx.accumulate, True).items() if k != "accumulator"}
        )
    return {k.replace(" ", "_"): v for k, v in extra.items()}


def offload_host_memory(ctx, split: dict, moment: str, ss: set, paged: int) -> tuple[dict, dict]:
    """(RAM, pinned) components of an offloaded plan (plan.py's ctx) with the optimizer placement
    `split` (numel per placement), streamed blocks `ss` and `paged` activation bytes."""
    wb, mb = ctx.wb, moment_bytes(moment)
    h, m = split["host"], split["mapped"]
    streamed_w = sum(ctx.weight(ctx.shape.blocks[i]) for i in ss)
    # an fp32 streamed block's home is its master (engine/updater.py): not counted twice
    shared = 4 * sum(ctx.shape.blocks[i].trained_numel for i in ss) if wb == 4 else 0
    mapped_state = m * (master_bytes(wb) + 2 * mb)
    ram = {"optimizer_state": h * (4 + 2 * mb) - shared + mapped_state, "gradient_landing": h * wb,
           "streamed_weights": streamed_w, "paged_activations": paged}  # fmt: skip
    ram.update(plan_step_buffers(ctx, h + m, delayed_numel=h))
    pinned = {"gradient_landing": h * wb, "streamed_weights": streamed_w, "paged_activations": paged,
              "mapped_state": mapped_state}  # fmt: skip
    return ram, pinned


def cap_mapped_to_pin(ctx, split: dict, moment: str, ss: set, paged: int) -> dict:
    """`split` with its mapped share cut so the plan's pinned memory fits the page-lock budget
    (ctx.pin; 0: unknown, no cut): the runtime keeps a bucket on the host when the arena cannot
    page-lock its mapped state (engine/layout.py), after the landing buffers (the device share's
    included: it starts on the host) and streamed weights took their pinned memory at wrap(). A cut
    element is updated by the host: its state leaves the pinned memory and its landing slot joins
    it. optimizer_mode="gpu" (every element mapped) is not cut. The cut count is in
    split["pin_cut"]."""
    m = split["mapped"]
    if not m or ctx.pin <= 0 or ctx.opt_mode == "gpu":
        return split
    # the landing buffers as wrap() pins them: the device share's too (vram_share moves it later)
    first = {**split, "device": 0, "host": split["host"] + split.get("device", 0)}
    _, pinned = offload_host_memory(ctx, first, moment, ss, paged)
    over = sum(pinned.values()) - ctx.pin
    per = master_bytes(ctx.wb) + 2 * moment_bytes(moment) - ctx.wb
    if over <= 0 or per <= 0:
        return split
    cut = min(m, -(-over // per))
    return {**split, "mapped": m - cut, "host": split["host"] + cut, "pin_cut": split.get("pin_cut", 0) + cut}


def _text(parts: dict) -> str:
    return (
        " + ".join(f"{k} {v / GIB:.2f}" for k, v in parts.items() if v)
        + f" = {sum(parts.values()) / GIB:.2f} GiB"
    )


def pick_moment_dtype(
    option: str,
    *,
    numel: int,
    working_bytes: int,
    accumulate: bool,
    streamed: int,
    check: bool,
    log,
    ram: dict,
    delayed: bool | float = False,
    nvme_share: float = 0.0,
    bucket_bytes: int = 32 << 20,
) -> torch.dtype:
    """float32 or bfloat16 for moment_dtype=`option` ("auto", "float32", "bfloat16"): "auto" takes
    fp32 unless the host memory (host_components) would exceed 90 % of the available RAM (cgroup
    limit included), then bf16; MemoryError (when `check`) if the chosen dtype does not fit, with
    each component and what would fit. `ram`: profile.available_ram()'s dict ("available", and
    "cgroup_limit" or None), as wrap() counts it;
    `delayed`: delayed_update's buffers count too (True: for every element; a float: for that
    host-updated share); `nvme_share`: that share of the state is on disk."""
    avail = ram["available"]
    budget = SHARE * avail
    fp32 = host_components(numel, working_bytes, 4, accumulate, streamed, delayed, nvme_share, bucket_bytes)
    bf16 = host_components(numel, working_bytes, 2, accumulate, streamed, delayed, nvme_share, bucket_bytes)
    where = f"{SHARE:.0%} of {avail / GIB:.2f} GiB available RAM" + (
        f" (cgroup limit {ram['cgroup_limit'] / GIB:.2f} GiB)" if ram.get("cgroup_limit") else ""
    )
    if option == "auto":
        if sum(fp32.values()) <= budget:
            log(f"moment_dtype=auto -> float32 (host memory {_text(fp32)} <= {where})")
            return torch.float32
        if sum(bf16.values()) <= budget:
            log(f"moment_dtype=auto -> bfloat16 (float32: {_text(fp32)} > {where}; bfloat16: {_text(bf16)})")
            return torch.bfloat16
        parts, dtype = bf16, torch.bfloat16
    else:
        dtype = torch.float32 if option == "float32" else torch.bfloat16
        parts = fp32 if dtype == torch.float32 else bf16
        if sum(parts.values()) <= budget:
            return dtype
    if not check:
        log(f"check_memory=False: host memory {_text(parts)} > {where}; going on")
        return dtype
    hints = []
    if dtype == torch.float32:
        hints.append(f"moment_dtype='bfloat16' (needs {_text(bf16)})")
    if streamed:
        hints.append("quantized frozen weights (quantize='int8' or 'nf4') or fewer streamed blocks")
    if nvme_share < 1.0:
        hints.append("nvme_offload=True with nvme_dir= a fast local disk (the master and moments on disk)")
    hints.append("LoRA or fewer trained parameters, or a machine with more RAM")
    raise MemoryError(
        f"wrap(): host memory does not fit: {_text(parts)} for {numel:,} trained elements "
        f"({str(dtype).replace('torch.', '')} moments) > {where}. What would fit: " + "; ".join(hints)
    )
