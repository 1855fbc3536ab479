"""optimizer_mode="auto" refinement: the host / mapped split again, from the rates the run achieved.

The first split and the one after the VRAM share (runtime/optimizer_split.py) use rates measured
in isolation. Under load the host AdamW is slower (it is memory-bound, and the DMA of the mapped
share and of the gradients shares the host's memory bandwidth) and the mapped kernel's PCIe rate
differs from a lone copy's, so the crossing point moves. Schedule (SWITCH_AFTER_STEPS = 2 in
optim.py): the VRAM share is decided after step 2; steps 3-4 are measured; after step 4 the split
is solved again and, when that is worth it, buckets move; a refinement that moved buckets is
measured over the next MEASURE_STEPS and refined once more, unless that window's measured step
took more than MIN_GAIN longer than the window before the move: then the move is undone (the model
below leaves out what a mapped share costs the GPU lane, planner/timing.py). Then the split settles
(at most MAX_REFINEMENTS decisions, no measurement after that: no oscillation).

The host-only trial: the model above balances the host AdamW against PCIe and leaves out what the
mapped share costs the GPU (its kernels hold SMs while they wait on PCIe, and the training thread
falls behind: planner/timing.py's mapped update and ISSUE_EXPOSED). When a refinement keeps a split
that still has mapped buckets, and the host could update all of them too within HOST_TRIAL_SHARE of
the measured step (host_trial_fits), they move to the host for one more window; the trial is kept
when that window's step was not slower, and undone otherwise. Either way the split then settles. Each window starts
after a synchronize (two or three pipeline drains in all, the one before the move included).

Measured over the window, per rate:
  host:   elements the host AdamW updated / seconds it spent (stats host_updated_numel, and
          host_update_s + host_land_s, both counted in the same engine-thread job, so jobs of the
          step before the window that finish inside it do not bias the ratio);
  mapped: PCIe bytes each way the mapped kernels moved / their seconds on the update stream (CUDA
          events around each mapped bucket's launch, gpu_updates.MappedUpdates.timing: two events
          per bucket and step, only inside the window; read after the synchronize the move needs
          anyway). The rate is what the kernel achieved beside the gradients' and weights' copies.
Without host (or mapped) buckets in the window the isolated rate stands in (sources says which).
The record's per-step seconds are the window's sums over its steps (a job of the step before the
window that finishes inside it counts there; the rates, ratios of sums, are not biased by it).

The decisions are the planner's: each window's numbers go as a SplitWindow (planner/training.py:
numbers only) to planner/revise.py revise_training, answered by planner/inflight.py decide_window
(the trial's verdict, the undo, or choose_refined: the model of choose_mapped_fraction minimised
over bucket boundaries) and, after a window that moved nothing, a HostTrialCheck
(decide_host_trial: host_trial_fits); the thresholds MAX_REFINEMENTS, MIN_GAIN and
HOST_TRIAL_SHARE are in planner/rules.py, as MEASURE_STEPS, the window's length this module
schedules with. This module measures the windows, asks, moves the buckets (engine/layout.py
move_buckets) and returns every decision's history entry from after_step; the optimizer's session
records them (runtime/session.py TrainingSession). The "device" share runs at device bandwidth
beside both and stays where it is.
"""

from __future__ import annotations

import time

from ..engine.layout import move_buckets, relocate
from ..planner.revise import revise_training
from ..planner.rules import MEASURE_STEPS
from ..planner.training import HostTrialCheck, SplitWindow
from .measure import bucket_facts, host_room

WINDOW = ("host_numel", "host_s", "mapped_numel", "mapped_s", "mapped_bytes", "throttle_s", "wall_s")


class SplitRefiner:
    """Measures the windows and refines opt's split (module docstring); after_step() is called
    by OffloadAdamW.step() on the training thread, with the engine's step count, and returns the
    history entries of the decisions it took (the session records them).
    measured: a callable returning the window's numbers (tests inject them; default: the
    engine's stats and the mapped launches' events); relocate: layout.relocate's stand-in."""

    def __init__(self, opt, *, start_after: int, measured=None, relocate_fn=None) -> None:
        self.opt = opt
        self.start_after = start_after
        self.measured = measured or self._measure
        self.relocate = relocate_fn or relocate
        self.refinements = 0  # decisions taken (a move or a settle)
        self.settled = False
        self._open_at: int | None = None
        self._snap: dict = {}
        self._t_end = 0.0  # when the window's last step returned
        self._before: dict | None = None  # placements and step_s before the last refinement
        self._trial: dict | None = None  # placements and step_s before the host-only trial

    # ---- the window -------------------------------------------------------------------------------
    def _open(self, steps: int) -> None:
        """Starts a window from a drained pipeline (every window alike: its first step does not
        inherit the last one's queued updates, its own last queued updates count)."""
        e = self.opt._engine
        self.opt.synchronize()
        self._open_at = steps
        self._snap = {
            k: e.stats[k] for k in ("host_update_s", "host_land_s", "host_updated_numel", "throttle_s")
        }
        self._snap["t"] = time.perf_counter()
        e.updater.mapped.timing = []

    def _measure(self) -> dict:
        """The window's numbers, after synchronize()."""
        e, s0 = self.opt._engine, self._snap
        mapped_s, mapped_numel, mapped_bytes = e.updater.mapped.take_timing()
        st = e.stats
        return {
            "host_numel": st["host_updated_numel"] - s0["host_updated_numel"],
            "host_s": st["host_update_s"] + st["host_land_s"] - s0["host_update_s"] - s0["host_land_s"],
            "mapped_numel": mapped_numel,
            "mapped_s": mapped_s,
            "mapped_bytes": mapped_bytes,
            "throttle_s": st["throttle_s"] - s0["throttle_s"],
            "wall_s": self._t_end - s0["t"],  # the window's steps, up to the last one's return
        }

    def _stop(self) -> None:
        self.settled = True
        self._open_at = None
        self.opt._engine.updater.mapped.timing = None

    # ---- the step hook ---------------------------------------------------------------------------
    def after_step(self, steps: int) -> list[dict]:
        if self.settled:
            return []
        if self.opt._resident is not None:  # the resident switch took the whole state
            self._stop()
            return []
        if self._open_at is None:
            if steps >= self.start_after:
                self._open(steps)
            return []
        if steps - self._open_at < MEASURE_STEPS:
            return []
        self._t_end = time.perf_counter()
        self.opt.synchronize()  # relocate needs it (its seconds are not the window's)
        m = self.measured()
        self.refinements += 1
        base = self._trial if self._trial is not None else self._before
        w = SplitWindow(
            step=steps, first=self._open_at + 1, buckets=tuple(bucket_facts(self.opt._engine.buckets)),
            **{k: m[k] for k in WINDOW}, **self._alone(), refinement=self.refinements,
            placements_before=tuple(base["placements"]) if base else (),
            step_s_before=base["step_s"] if base else None, trial=self._trial is not None,
        )  # fmt: skip
        d = revise_training(w)
        if w.trial:
            self._trial = None
            entries = [self._end_trial(d, m, w)]
        elif d.settle:
            entries = [self._revert(d, m, w)]
        else:
            placements = [b.placement for b in self.opt._engine.buckets]
            entry, moved = self._refine(d, m, w)
            entries = [entry]
            self._before = {"placements": placements, "step_s": w.step_s}
            if moved and d.again:
                self._open(steps)
                return entries
            if not moved:
                trial = self._start_trial(w)
                if trial is not None:
                    self._open(steps)
                    return entries + [trial]
        self._stop()
        return entries

    # ---- the host-only trial (module docstring) -----------------------------------------------------
    def _start_trial(self, w: SplitWindow) -> dict | None:
        """The trial's entry when the planner runs it and buckets moved, else None."""
        buckets = self.opt._engine.buckets
        d = revise_training(HostTrialCheck(window=w, buckets=tuple(bucket_facts(buckets))))
        if not d.act:
            return None
        placements = [b.placement for b in buckets]
        moved = self._move(list(d.placements))
        if not moved:
            return None
        step_s, info = w.step_s, d.numbers
        self._trial = {"placements": placements, "step_s": step_s}
        self.opt._log(
            f"optimizer_mode=auto after step {w.step}: the host could update every movable bucket in "
            f"{info['host_all_s'] * 1e3:.0f} ms of the {step_s * 1e3:.0f} ms step; {moved} mapped buckets "
            "move to the host for the next steps (kept unless those steps are slower)"
        )
        return {"step": w.step, "change": d.change, "moved_buckets": moved, "step_s_before": step_s, **info}

    def _end_trial(self, d, m: dict, w: SplitWindow) -> dict:
        keep = not d.act
        moved = self._move(list(d.placements)) if d.act else 0
        step_s, before = d.numbers["step_s"], d.numbers["step_s_before"]
        self.opt._log(
            f"optimizer_mode=auto after step {w.step}: steps {w.first}-{w.step} with the host updating every "
            f"movable bucket took {step_s:.3f} s/step against {before:.3f}: "
            + ("kept, split settled" if keep else f"{moved} buckets moved back, split settled")
        )
        return {
            "step": w.step, "change": d.change, "measured_steps": [w.first, w.step], "step_s": step_s,
            "step_s_before": before, "measured": dict(m), "moved_buckets": moved,
        }  # fmt: skip

    def _revert(self, d, m: dict, w: SplitWindow) -> dict:
        """The measured step got slower after the last move (what the model leaves out: the
        mapped kernel's seconds on the GPU, the issue time): the placements go back, settled."""
        moved = self._move(list(d.placements))
        step_s, before = d.numbers["step_s"], d.numbers["step_s_before"]
        self.opt._log(
            f"optimizer_mode=auto after step {w.step}: steps {w.first}-{w.step} took {step_s:.3f} s/step, "
            f"{step_s / before - 1:.0%} more than before the last refinement "
            f"({before:.3f}); {moved} buckets moved back, split settled"
        )
        return {
            "step": w.step, "change": d.change, "measured_steps": [w.first, w.step],
            "refinement": w.refinement, "step_s": step_s, "step_s_before": before, "measured": dict(m),
            "moved_buckets": moved,
        }  # fmt: skip

    def _alone(self) -> dict:
        """The isolated rates (opt.split_info, else measured once per process)."""
        alone = self.opt.split_info
        if "host_params_per_s" not in alone or "pcie_bytes_per_s" not in alone:
            from .optimizer_split import measured_rates

            alone = {**measured_rates(self.opt._engine.device), **alone}
        return {"host_alone": alone["host_params_per_s"], "pcie_alone": alone.get("pcie_bytes_per_s")}

    def _refine(self, d, m: dict, w: SplitWindow) -> tuple[dict, int]:
        """Moves what the planner's refinement says, logs; returns (entry, buckets moved)."""
        opt, e = self.opt, self.opt._engine
        entry = {"step": w.step, "change": d.change, "measured_steps": [w.first, w.step],
                 "refinement": w.refinement, **d.numbers, "measured": dict(m)}  # fmt: skip
        if "reason" in d.numbers:  # no rate to refine with
            return entry, 0
        moved, t0 = 0, time.perf_counter()
        if d.act:
            moved = self._move(list(d.placements))
        entry.update(moved_buckets=moved, relocate_s=time.perf_counter() - t0)
        got = {p: sum(b.numel for b in e.buckets if b.placement == p and b.exp_avg is not None)
               for p in ("device", "mapped", "host")}  # fmt: skip
        entry["numel_now"] = got
        total = max(1, sum(got.values()))
        share = " / ".join(f"{got[p] / total:.0%} {p}" for p in ("device", "mapped", "host"))
        verdict = (
            f"{moved} buckets moved, now {share}"
            if d.act
            else f"kept ({share}; gain {entry['gain']:.1%} <= {entry['min_gain']:.0%})"
        )
        src = entry["rate_sources"]
        opt._log(
            f"optimizer_mode=auto, refined after step {w.step} from steps {w.first}-{w.step}: host "
            f"{entry['host_params_per_s'] / 1e9:.2f} G params/s ({src['host']}; {src['host_alone'] / 1e9:.2f} "
            f"alone), mapped PCIe {entry['pcie_bytes_per_s'] / 1e9:.1f} GB/s ({src['pcie']}), throttle "
            f"{entry['throttle_s_per_step']:.3f} s/step; predicted optimizer time "
            f"{entry['predicted_s_before'] * 1e3:.0f} -> {entry['predicted_s_after'] * 1e3:.0f} ms: {verdict}"
        )
        return entry, moved

    def _move(self, targets: list[str]) -> int:
        return move_buckets(self.opt, targets, self.relocate, "optimizer split refinement", host_room)


REFINED = (
    "optimizer split refined",
    "keep optimizer split",
    "optimizer split reverted",
    "optimizer split host-only trial",
    "host-only trial kept",
    "host-only trial undone",
)  # plan_history's changes here


def split_report(opt) -> dict:
    """memory_report(model)["plan"]["optimizer"]["split"]: the split from isolated rates
    (split.py), every refinement's entry, and whether the split has settled."""
    r = getattr(opt, "_refiner", None)
    return {
        "initial": dict(opt.split_info),
        "refinements": [h for h in opt.plan_history if h.get("change") in REFINED],
        "settled": r is None or r.settled,
    }


def make_refiner(opt, start_after: int):
    """The refiner of an "auto" split measured with isolated rates (mapped_fraction_for),
    None otherwise: optimizer_mode "cpu"/"gpu", data parallel, a CPU device, no CUDA kernels, a
    low-precision model with accumulation (host only) never refine. With delayed_update the
    moves take their side buffers along (engine/delayed.py placed); a window's synchronize
    installs a pending update early (that step is not delayed)."""
    if opt.mode != "auto" or opt._distributed or "host_params_per_s" not in opt.split_info:
        return None
    return SplitRefiner(opt, start_after=start_after)
