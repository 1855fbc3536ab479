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
  (Before these, the blocks keep_count let keep their activations recompute again: give_back.)

The runtime measures and hands a record of numbers (planner/training.py KeepCheck, PeakCheck,
FreeVram) to planner/revise.py revise_training(), which answers with decide_keep, decide_peak and
decide_free below; the runtime applies the answer and returns the history entry, which the session
records (runtime/session.py TrainingSession)."""

from __future__ import annotations

import math

from .rules import KEEP_SAFETY, WATCHDOG_HEADROOM_USED
from .training import BucketFacts, Decision


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


def give_back(kept, need: int, block_bytes: int) -> list[int]:
    """The kept blocks that recompute again, front first, to free about `need` bytes at
    `block_bytes` a block: at least one, at most all; none when nothing is kept or a block's bytes
    are unknown."""
    if not kept or block_bytes <= 0:
        return []
    return list(kept[: min(len(kept), max(1, math.ceil(need / block_bytes)))])


# ---- the in-training decisions, from planner/training.py's records (revise_training) -------------
def decide_keep(m) -> Decision:
    """KeepCheck -> the last keep_count candidates keep their activations (blocks), with its numbers."""
    d = keep_count(
        usable=m.usable, peak=m.peak, headroom=m.headroom, block_bytes=list(m.block_bytes),
        candidates=len(m.candidates),
    )  # fmt: skip
    k, n = d["k"], len(m.candidates)
    kept = tuple(m.candidates[n - k :]) if k else ()
    return Decision(
        change=f"{k} of {n} recomputed blocks keep their activations", act=True, numbers=d, blocks=kept
    )


def decide_peak(m) -> Decision:
    """PeakCheck -> act when the peak passed watchdog_trigger or an allocation failed; numbers:
    trigger_bytes (always), target_bytes and need_bytes (watchdog_need) when acting."""
    trigger = watchdog_trigger(m.usable, m.headroom)
    if m.peak <= trigger and not m.oom:
        return Decision(numbers={"trigger_bytes": trigger})
    need, target = watchdog_need(usable=m.usable, peak=m.peak, headroom=m.headroom, oom=m.oom)
    return Decision(
        change="watchdog freed VRAM", act=True,
        numbers={"trigger_bytes": trigger, "target_bytes": target, "need_bytes": need},
    )  # fmt: skip


def decide_free(m) -> Decision:
    """FreeVram -> the kept blocks recompute again first (give_back: blocks, one "recompute" move),
    else choose_levers' moves; none left: "watchdog: nothing left to free" (act False)."""
    back = give_back(m.kept, m.need, m.kept_block_bytes)
    if back:
        return Decision(
            change="watchdog freed VRAM", act=True, moves=({"lever": "recompute", "blocks": back},),
            blocks=tuple(back), numbers={"freed_bytes": len(back) * m.kept_block_bytes},
        )  # fmt: skip
    moves = choose_levers(
        list(m.buckets), m.need, paged=None if m.paged is None else list(m.paged), n_blocks=m.n_blocks,
        block_bytes=list(m.block_bytes), allow_host=m.allow_host,
    )  # fmt: skip
    if not moves:
        return Decision(change="watchdog: nothing left to free", numbers={"freed_bytes": 0})
    return Decision(change="watchdog freed VRAM", act=True, moves=tuple(moves))
