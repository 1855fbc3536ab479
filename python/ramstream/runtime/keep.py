"""activation_checkpointing="auto" for LoRA-like models: after the first step, the blocks whose
activations fit in the VRAM that step left free keep them (they no longer recompute).

The first step recomputes every block; each recompute records what the block's forward leaves
allocated (``Recompute.kept_bytes``: its saved activations and output). After that step the room
is the usable VRAM after headroom less the step's measured peak; the last ``k`` blocks (the ones
nearest the loss) keep their activations, ``k`` = room / (the largest block's bytes x KEEP_SAFETY).
The planner decides (a KeepCheck, numbers only, to planner/revise.py revise_training: levers.py
decide_keep, keep_count); this policy measures, applies the answer through
activations/recompute.py Recompute.keep and returns the history entry from after_step (the
optimizer's session records it: runtime/session.py TrainingSession). Keeping or recomputing runs
the same forward: results do not change. The watchdog's first lever makes kept blocks recompute
again, front first (the planner's levers.give_back; recompute_again applies it).
"""

from __future__ import annotations

import torch

from ..planner.revise import revise_training
from ..planner.rules import KEEP_DECIDE_AFTER
from ..planner.training import FreeVram, KeepCheck
from . import measure as _measure


class KeepPolicy:
    """A step callback of the optimizer (see module docstring): after_step returns the decision's
    history entry once (None otherwise). measure: a callable returning {"usable", "peak"} in bytes
    or None (default: the CUDA allocator's figures); log: the event log."""

    def __init__(self, recompute, device, headroom: float, log, measure=None) -> None:
        self.recompute, self.device, self.headroom = recompute, device, headroom
        self.log = log
        self.measure = measure or self._measure
        self.steps, self.decided = 0, False
        self.kept: list[int] = []
        self.decision: dict | None = None

    def _measure(self) -> dict | None:
        mem = _measure.device_memory(self.device)
        return None if mem is None else {"usable": mem["usable"], "peak": mem["peak"]}

    def after_step(self) -> dict | None:
        self.steps += 1
        if self.decided or self.steps < KEEP_DECIDE_AFTER:
            return None
        self.decided = True
        self.recompute.stop_measuring()  # decided once: the recomputes need not measure any more
        m = self.measure()
        sizes = self.recompute.kept_bytes
        if m is None or not sizes:
            return None
        candidates = self.recompute.recomputed()
        d = revise_training(
            KeepCheck(
                step=self.steps, usable=int(m["usable"]), peak=int(m["peak"]), headroom=self.headroom,
                block_bytes=tuple(sizes.values()), candidates=tuple(candidates),
            )
        )  # fmt: skip
        k, room, per_block = d.numbers["k"], d.numbers["room"], d.numbers["block_bytes"]
        self.kept = list(d.blocks)
        self.recompute.keep(self.kept)
        self.decision = {
            "step": self.steps,
            "change": d.change,
            "peak_bytes": int(m["peak"]),
            "usable_bytes": int(m["usable"]),
            "room_bytes": room,
            "block_bytes": per_block,
            "kept": list(self.kept),
        }
        self.log(
            f"activation_checkpointing=auto after step {self.steps}: peak {m['peak'] / 2**30:.2f} GiB of "
            f"{m['usable'] / 2**30:.2f} usable ({self.headroom:.0%} headroom) leaves "
            f"{max(room, 0) / 2**30:.2f} GiB; a block's activations take {per_block / 2**30:.3f} GiB: "
            f"{k} of {len(candidates)} blocks keep them ({self.kept[:1] + self.kept[-1:] if k else 'none'})"
        )
        return self.decision

    def give_back(self, need: int) -> list[int]:
        """Kept blocks recompute again, front first, as many as the planner frees about ``need``
        bytes with (FreeVram with the kept blocks only: levers.give_back); returns them."""
        per = (self.decision or {}).get("block_bytes") or 0
        d = revise_training(FreeVram(step=self.steps, need=need, kept=tuple(self.kept), kept_block_bytes=per))
        return self.recompute_again(list(d.blocks))

    def recompute_again(self, blocks: list[int]) -> list[int]:
        """The lever: these kept blocks (the front of the kept ones) recompute again; returns them."""
        if not blocks:
            return []
        self.kept = [i for i in self.kept if i not in set(blocks)]
        self.recompute.recompute_again(blocks)
        return blocks

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
