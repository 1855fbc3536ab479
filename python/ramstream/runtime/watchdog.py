"""The plan's watchdog: once the plan has settled, frees VRAM when a step's peak grows toward the cap.

The plan settles after the decisions of the first steps: offload="auto"'s resident switch or VRAM
share after step 2 (optimizer_split.py), optimizer_mode="auto"'s refinement (refiner.py) and
activation_offload="auto"'s measured steps (runtime/activation_policy.py). From then on, after every step,
the watchdog reads (cheap host calls, no synchronize)
  peak:   torch.cuda.max_memory_allocated, since the last reset;
  usable: the bytes the process may hold (the per-process cap: measure.device_memory, what the
          VRAM share planned with);
  ooms:   torch.cuda.memory_stats()["num_ooms"]: an allocation failed since the last step (a step
          raised torch.OutOfMemoryError, the failure left weights and state as they were, and the
          loop went on).
The decisions are the planner's (planner/revise.py revise_training): a PeakCheck (planner/training.py:
numbers only) is answered by planner/levers.py decide_peak: act when peak > watchdog_trigger (half
the plan's headroom used up: 95 % of the cap by default) or when ooms grew, freeing watchdog_need
bytes (the peak back to usable x (1 - vram_headroom); after an out of memory at least half the
headroom). Then a FreeVram (the buckets, the paged blocks, the kept ones) is answered by
decide_free: first the blocks the LoRA keep policy let keep their activations recompute again
(levers.give_back; applied by runtime/keep.py), else the levers cheapest first (levers.choose_levers:
"device" buckets -> "mapped", more blocks page their activations, for optimizer_mode="auto"
"mapped" buckets -> "host").
Buckets move with engine/layout.py move_buckets (after synchronize). After acting the peak
statistics are reset (torch.cuda.reset_peak_memory_stats: the record keeps the peak before), so the
next step measures the plan as it now is, and acts again if that is still too close; while nothing
happens nothing is reset. With no lever left it says so once. Every action is logged and its entry
returned by after_step (the optimizer's session records it in the plan history: runtime/session.py
TrainingSession); memory_report(model)["plan"]["watchdog"] is report(). The CPU engine has no
VRAM: the watchdog measures nothing there (tests inject measure and relocate_fn).
"""

from __future__ import annotations

import weakref

import torch

from ..engine.layout import move_buckets, relocate
from ..planner.levers import trigger_fraction
from ..planner.revise import revise_training
from ..planner.training import FreeVram, PeakCheck
from . import measure as _measure

RECENT = 8  # per-step peaks kept for the record


class Watchdog:
    """Watches the settled plan (module docstring). after_step() is a step callback of opt (run
    on the training thread after every successful step; returns the entry of an action, which the
    session records, or None). activations: wrap()'s ActivationPolicy
    or None. measure: a callable returning {"usable", "peak", "ooms"} or None (no device memory
    to watch; default: the CUDA allocator's figures); relocate_fn: layout.relocate's stand-in;
    reset_peak: called after acting (default: torch.cuda.reset_peak_memory_stats)."""

    def __init__(
        self,
        opt,
        activations=None,
        *,
        start_after: int = 2,
        measure=None,
        relocate_fn=None,
        reset_peak=None,
        keep=None,
    ) -> None:
        self._opt = weakref.ref(opt)  # opt holds this watchdog's after_step: no cycle
        self.activations = activations
        self.keep = keep  # runtime/keep.py KeepPolicy: kept blocks recompute again first
        self.start_after = start_after
        self.measure = measure or self._measure
        self.relocate = relocate_fn or relocate
        self.reset_peak = reset_peak or self._reset_peak
        self.headroom = opt.vram_headroom
        self.fraction = trigger_fraction(self.headroom)  # the trigger, of the usable VRAM
        self.settled_at: int | None = None
        self.checks = 0
        self.exhausted = False  # a trigger found no lever left (said once)
        self._ooms = 0
        self.recent: list[list[int]] = []  # [step, peak] of the last RECENT checks
        self.actions: list[dict] = []
        self.last: dict | None = None

    @property
    def opt(self):
        return self._opt()

    # ---- the default measurements -------------------------------------------------------------
    def _measure(self) -> dict | None:
        dev = self.opt._engine.device
        mem = _measure.device_memory(dev)
        if mem is None:
            return None
        return {
            "usable": mem["usable"],
            "peak": mem["peak"],
            "ooms": torch.cuda.memory_stats(dev).get("num_ooms", 0),
        }

    def _reset_peak(self) -> None:
        dev = self.opt._engine.device
        if dev.type == "cuda":
            torch.cuda.reset_peak_memory_stats(dev)

    # ---- the step hook ------------------------------------------------------------------------
    def _plan_settled(self, steps: int) -> bool:
        r, a = self.opt._refiner, self.activations
        return (
            steps > self.start_after
            and (r is None or r.settled)
            and (a is None or getattr(a, "phase", "done") == "done")
        )

    def after_step(self) -> dict | None:
        if self.opt is None:
            return None
        steps = self.opt._engine.stats["steps"]
        if self.settled_at is None:
            if not self._plan_settled(steps):
                return None
            m = self.measure()
            if m is None:
                return None
            self.settled_at, self._ooms = steps, m.get("ooms", 0)
        else:
            m = self.measure()
            if m is None:
                return None
        self.checks += 1
        usable, peak = int(m["usable"]), int(m["peak"])
        self.recent = (self.recent + [[steps, peak]])[-RECENT:]
        ooms = m.get("ooms", 0)
        oom, self._ooms = ooms > self._ooms, ooms
        d = revise_training(PeakCheck(step=steps, usable=usable, peak=peak, oom=oom, headroom=self.headroom))
        trigger = d.numbers["trigger_bytes"]
        self.last = {"step": steps, "peak_bytes": peak, "usable_bytes": usable, "trigger_bytes": trigger}
        if not d.act:
            return None
        return self._act(steps, m, oom=oom, **{k: d.numbers[k] for k in ("need_bytes", "target_bytes")})

    def _act(self, steps: int, m: dict, *, oom: bool, need_bytes: int, target_bytes: int) -> dict | None:
        opt, e, a, keep = self.opt, self.opt._engine, self.activations, self.keep
        off = a.off if a is not None else None
        kept = keep.kept if keep is not None else []
        d = revise_training(
            FreeVram(
                step=steps, need=need_bytes,
                buckets=tuple(_measure.bucket_facts(e.buckets)) if opt._resident is None else (),
                paged=tuple(off.paged) if off is not None else None,
                n_blocks=len(off.blocks) if off is not None else 0,
                block_bytes=tuple(off.stats()["block_bytes"]) if off is not None else (),
                allow_host=opt.mode == "auto" and e.dp is None,
                kept=tuple(kept), kept_block_bytes=((keep.decision or {}).get("block_bytes") or 0) if kept else 0,
            )
        )  # fmt: skip
        entry = {
            "step": steps, "change": d.change, "reason": "out of memory" if oom else "peak",
            "peak_bytes": int(m["peak"]), "usable_bytes": int(m["usable"]),
            "trigger_bytes": self.last["trigger_bytes"], "target_bytes": target_bytes, "need_bytes": need_bytes,
            "ooms": m.get("ooms", 0), "peaks": [list(x) for x in self.recent],
        }  # fmt: skip
        if d.blocks:  # the cheapest lever: blocks that kept their activations recompute again
            back = keep.recompute_again(list(d.blocks))
            entry.update(moves=list(d.moves), freed_bytes=d.numbers["freed_bytes"])
            self.actions.append(entry)
            self.reset_peak()
            opt._log(f"watchdog after step {steps}: {self._numbers(entry)}; blocks {back} recompute again")
            return entry
        if not d.act:
            if self.exhausted:
                return None
            self.exhausted = True
            entry.update(moves=[], freed_bytes=0)
            self.actions.append(entry)
            opt._log(
                f"watchdog after step {steps}: {self._numbers(entry)}; no lever left to free VRAM "
                "(no optimizer state in VRAM, every block pages its activations)"
            )
            return entry
        done = self._apply(list(d.moves))
        entry.update(moves=done, freed_bytes=sum(x["bytes"] for x in done))
        self.actions.append(entry)
        self.reset_peak()
        what = "; ".join(
            f"bucket {x['bucket']} {x['from']} -> {x['to']}"
            if "bucket" in x
            else f"blocks {x['blocks']} page"
            for x in done
        )
        opt._log(
            f"watchdog after step {steps}: {self._numbers(entry)}; freeing {need_bytes / 2**20:.0f} MiB: "
            f"{what or 'nothing could move'} (about {entry['freed_bytes'] / 2**20:.0f} MiB)"
        )
        return entry

    def _apply(self, moves: list[dict]) -> list[dict]:
        """Moves the buckets (quiescent: after synchronize) and pages the blocks; returns the
        moves done (a bucket that could not move ends the bucket moves, as in refiner.py)."""
        opt, e, done = self.opt, self.opt._engine, []
        buckets = [x for x in moves if "bucket" in x]
        if buckets:
            opt.synchronize()
            targets = [b.placement for b in e.buckets]
            for x in buckets:
                targets[x["bucket"]] = x["to"]
            before = [b.placement for b in e.buckets]
            move_buckets(opt, targets, self.relocate, "watchdog", _measure.host_room)
            done += [x for x in buckets if before[x["bucket"]] != e.buckets[x["bucket"]].placement]
        for x in moves:
            if x["lever"] == "activations":
                off = self.activations.off
                off.set_paged(sorted(set(off.paged) | set(x["blocks"])))
                done.append(x)
        return sorted(done, key=moves.index)

    @staticmethod
    def _numbers(entry: dict) -> str:
        mib = lambda x: f"{x / 2**20:.0f} MiB"  # noqa: E731
        return (
            f"{entry['reason']}: peak {mib(entry['peak_bytes'])} of {mib(entry['usable_bytes'])} usable "
            f"(trigger {mib(entry['trigger_bytes'])}, plan's budget {mib(entry['target_bytes'])})"
        )

    def report(self) -> dict:
        """memory_report(model)["plan"]["watchdog"]."""
        return {
            "enabled": True,
            "settled_at": self.settled_at,
            "trigger_fraction": self.fraction,
            "checks": self.checks,
            "last": dict(self.last) if self.last else None,
            "peaks": [list(x) for x in self.recent],
            "actions": list(self.actions),
            "exhausted": self.exhausted,
        }
