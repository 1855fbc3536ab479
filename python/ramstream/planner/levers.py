"""The VRAM decisions taken while training, from what the run measured; pure arithmetic.

- keep_count: activation_checkpointing="auto" in LoRA (runtime/keep.py): after the first step, how
  many of the recomputed blocks (the last ones, nearest the loss) keep their activations in the room
  that step's measured peak left.
- watchdog_need / choose_levers: once the plan has settled (runtime/watchdog.py), when a step's
  peak grows toward the cap, how many bytes to free and with which levers, cheapest first:
    1. "device" buckets -> "mapped", from the back of the model (the VRAM share keeps the front):
       their moments, and a low-precision model's fp32 master, leave VRAM; the same CUDA kernel
       updates them: bit for bit.
    2. more blocks page their saved activations to host RAM, front blocks first as
       choose_paged_blocks (each block estimated at the mean of the paged blocks' measured
       bytes): bit for bit.
    3. optimizer_mode="auto" only: "mapped" buckets -> "host", from the back: their gradients no
       longer wait in VRAM for the GPU update (the refinement's tolerance, not bit for bit).
  (Before these, runtime/watchdog.py gives back the blocks keep_count let keep their activations.)"""

from __future__ import annotations

import math

from .inflight import BucketFacts
from .rules import KEEP_SAFETY, WATCHDOG_HEADROOM_USED


def keep_count(*, usable: int, peak: int, headroom: float, block_bytes: list[int], candidates: int) -> dict:
    """How many recomputed blocks keep their activations: room = usable x (1 - headroom) - peak;
    a block takes the largest measured block's bytes x KEEP_SAFETY; k = room // that, within
    [0, candidates]. Returns {"k", "room", "block_bytes"}."""
    per_block = int(max(block_bytes, default=0) * KEEP_SAFETY)
    room = int(usable * (1 - headroom)) - int(peak)
    k = max(0, min(candidates, math.floor(room / per_block))) if per_block > 0 else 0
    return {"k": k, "room": room, "block_bytes": per_block}


def trigger_fraction(headroom: float) -> float:
    """The share of the usable VRAM above which the watchdog acts: 1 - headroom x
    WATCHDOG_HEADROOM_USED."""
    return 1.0 - headroom * WATCHDOG_HEADROOM_USED


def watchdog_trigger(usable: int, headroom: float) -> int:
    """The peak in bytes above which the watchdog acts: usable x trigger_fraction(headroom)."""
    return int(usable * trigger_fraction(headroom))


def watchdog_need(*, usable: int, peak: int, headroom: float, oom: bool) -> tuple[int, int]:
    """(need, target): the bytes to free to bring the peak back to the plan's budget target =
    usable x (1 - headroom); at least one byte (one lever's worth), after an out of memory at least
    usable x headroom x WATCHDOG_HEADROOM_USED."""
    target = int(usable * (1 - headroom))
    need = max(1, int(peak) - target)
    if oom:
        need = max(need, int(usable * headroom * WATCHDOG_HEADROOM_USED))
    return need, target


def choose_levers(
    buckets: list[BucketFacts], need: int, *, paged, n_blocks: int, block_bytes, allow_host: bool
) -> list[dict]:
    """The moves that free about `need` bytes of VRAM, cheapest lever first (module docstring).
    paged: the blocks that page their activations now (None: no activation paging); block_bytes:
    the paged blocks' measured bytes per step. At least one move when any is possible, none when
    need <= 0. Each move: {"lever", "bytes" (the estimate), and "bucket", "from", "to" or
    "blocks"}."""
    out: list[dict] = []
    if need <= 0:
        return out
    freed = 0
    movable = [b for b in reversed(buckets) if b.shareable]
    for b in movable:  # 1. the VRAM share of the optimizer state, from the back
        if freed >= need:
            return out
        if b.placement == "device":
            nbytes = b.device_bytes
            out.append({"lever": "optimizer state", "bucket": b.index, "from": "device", "to": "mapped",
                        "bytes": nbytes})  # fmt: skip
            freed += nbytes
    if paged is not None and freed < need:  # 2. more blocks page their activations, front first
        unpaged = [i for i in range(n_blocks) if i not in set(paged)]
        known = [x for x in block_bytes if x > 0]
        per = sum(known) / len(known) if known else 0
        if unpaged:
            chosen = unpaged[: max(1, math.ceil((need - freed) / per) if per else 1)]
            nbytes = int(per * len(chosen))
            out.append({"lever": "activations", "blocks": chosen, "bytes": nbytes})
            freed += nbytes
    if allow_host:  # 3. mapped buckets to the host: their gradients leave VRAM at once
        for b in movable:
            if freed >= need:
                break
            if b.placement == "mapped":
                nbytes = b.numel * b.working_bytes
                out.append({"lever": "gradients", "bucket": b.index, "from": "mapped", "to": "host",
                            "bytes": nbytes})  # fmt: skip
                freed += nbytes
    return out
