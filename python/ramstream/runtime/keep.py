"""activation_checkpointing="auto" for LoRA-like models: after the first step, the blocks whose
activations fit in the VRAM that step left free keep them (they no longer recompute).

The first step recomputes every block; each recompute records what the block's forward leaves
allocated (``Recompute.kept_bytes``: its saved activations and output). After that step the room
is the usable VRAM after headroom less the step's measured peak; the last ``k`` blocks (the ones
nearest the loss) keep their activations, ``k`` = room / (the largest block's bytes x KEEP_SAFETY):
the planner's keep_count (planner/levers.py) decides, this policy measures, applies it through
activations/recompute.py Recompute.keep and records it in the plan history. Keeping or recomputing runs the same forward: results do not change. ``give_back`` is the
watchdog's first lever: kept blocks recompute again, front first.
"""

from __future__ import annotations

import math

import torch

from ..planner.levers import keep_count
from ..planner.rules import KEEP_DECIDE_AFTER
from . import measure as _measure


class KeepPolicy:
    """A step callback of the optimizer (see module docstring). measure: a callable returning
    {"usable", "peak"} in bytes or None (default: the CUDA allocator's figures); log: the event
    log; history: the plan history (runtime/history.py PlanHistory)."""

    def __init__(self, recompute, device, headroom: float, log, history: list, measure=None) -> None:
        self.recompute, self.device, self.headroom = recompute, device, headroom
        self.log, self.history = log, history
        self.measure = measure or self._measure
        self.steps, self.decided = 0, False
        self.kept: list[int] = []
        self.decision: dict | None = None

    def _measure(self) -> dict | None:
        mem = _measure.device_memory(self.device)
        return None if mem is None else {"usable": mem["usable"], "peak": mem["peak"]}

    def after_step(self) -> None:
        self.steps += 1
        if self.decided or self.steps < KEEP_DECIDE_AFTER:
            return
        self.decided = True
        self.recompute.stop_measuring()  # decided once: the recomputes need not measure any more
        m = self.measure()
        sizes = self.recompute.kept_bytes
        if m is None or not sizes:
            return
        candidates = self.recompute.recomputed()
        d = keep_count(
            usable=int(m["usable"]), peak=int(m["peak"]), headroom=self.headroom,
            block_bytes=list(sizes.values()), candidates=len(candidates),
        )  # fmt: skip
        k, room, per_block = d["k"], d["room"], d["block_bytes"]
        self.kept = candidates[len(candidates) - k :] if k else []
        self.recompute.keep(self.kept)
        self.decision = {
            "step": self.steps,
            "change": f"{k} of {len(candidates)} recomputed blocks keep their activations",
            "peak_bytes": int(m["peak"]),
            "usable_bytes": int(m["usable"]),
            "room_bytes": room,
            "block_bytes": per_block,
            "kept": list(self.kept),
        }
        self.history.record(self.decision)
        self.log(
            f"activation_checkpointing=auto after step {self.steps}: peak {m['peak'] / 2**30:.2f} GiB of "
            f"{m['usable'] / 2**30:.2f} usable ({self.headroom:.0%} headroom) leaves "
            f"{max(room, 0) / 2**30:.2f} GiB; a block's activations take {per_block / 2**30:.3f} GiB: "
            f"{k} of {len(candidates)} blocks keep them ({self.kept[:1] + self.kept[-1:] if k else 'none'})"
        )

    def give_back(self, need: int) -> list[int]:
        """Kept blocks recompute again, front first, until about ``need`` bytes are freed; returns
        them (the watchdog's first lever)."""
        per = (self.decision or {}).get("block_bytes") or 0
        if not self.kept or per <= 0:
            return []
        n = min(len(self.kept), max(1, math.ceil(need / per)))
        back, self.kept = self.kept[:n], self.kept[n:]
        self.recompute.recompute_again(back)
        return back

    def report(self) -> dict:
        return {
            "recomputed": self.recompute.recomputed(),
            "kept": list(self.kept),
            "decision": self.decision,
            "measured_block_bytes": {int(i): int(b) for i, b in sorted(self.recompute.kept_bytes.items())},
        }


def measured_memory_fn(device):
    """What Recompute measures with on this device (None off CUDA: nothing to measure)."""
    if getattr(device, "type", None) != "cuda":
        return None
    return lambda: torch.cuda.memory_allocated(device)
