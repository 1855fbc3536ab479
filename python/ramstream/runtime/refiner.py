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

The decisions are the planner's (planner/inflight.py choose_refined: the model of
choose_mapped_fraction minimised over bucket boundaries; host_trial_fits; the thresholds
MEASURE_STEPS, MAX_REFINEMENTS, MIN_GAIN and HOST_TRIAL_SHARE in planner/rules.py); this module
measures the windows, asks, moves the buckets (engine/layout.py move_buckets) and records every
decision in the plan history. The "device" share runs at device bandwidth beside both and stays
where it is.
"""

from __future__ import annotations

import time

from ..engine.layout import move_buckets, relocate
from ..planner.inflight import choose_refined, host_only, host_trial_fits
from ..planner.rules import MAX_REFINEMENTS, MEASURE_STEPS, MIN_GAIN
from .measure import bucket_facts


class SplitRefiner:
    """Measures the windows and refines opt's split (module docstring); after_step() is called
    by OffloadAdamW.step() on the training thread, with the engine's step count.
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
    def after_step(self, steps: int) -> None:
        if self.settled:
            return
        if self.opt._resident is not None:  # the resident switch took the whole state
            self._stop()
            return
        if self._open_at is None:
            if steps >= self.start_after:
                self._open(steps)
            return
        if steps - self._open_at < MEASURE_STEPS:
            return
        self._t_end = time.perf_counter()
        self.opt.synchronize()  # relocate needs it (its seconds are not the window's)
        m = self.measured()
        n_steps = steps - self._open_at
        first, step_s = self._open_at + 1, m["wall_s"] / n_steps
        self.refinements += 1
        if self._trial is not None:
            self._end_trial(m, first=first, last=steps, step_s=step_s)
            self._stop()
            return
        before = self._before
        if before is not None and step_s > before["step_s"] * (1 + MIN_GAIN):
            self._revert(before, m, first=first, last=steps, step_s=step_s)
            self._stop()
            return
        placements = [b.placement for b in self.opt._engine.buckets]
        moved = self._refine(m, first=first, last=steps, wall_s=step_s)
        self._before = {"placements": placements, "step_s": step_s}
        if moved and self.refinements < MAX_REFINEMENTS:
            self._open(steps)
        elif not moved and self._start_trial(m, last=steps, step_s=step_s):
            self._open(steps)
        else:
            self._stop()

    # ---- the host-only trial (module docstring) -----------------------------------------------------
    def _start_trial(self, m: dict, *, last: int, step_s: float) -> bool:
        buckets = self.opt._engine.buckets
        host, _, _ = self._rates(m)
        fits, info = host_trial_fits(bucket_facts(buckets), host_params_per_s=host, step_s=step_s)
        if not fits:
            return False
        placements = [b.placement for b in buckets]
        moved = self._move(host_only(bucket_facts(buckets)))
        if not moved:
            return False
        self._trial = {"placements": placements, "step_s": step_s}
        self.opt.plan_history.record({"step": last, "change": "optimizer split host-only trial",
                                      "moved_buckets": moved, "step_s_before": step_s, **info})  # fmt: skip
        self.opt._log(
            f"optimizer_mode=auto after step {last}: the host could update every movable bucket in "
            f"{info['host_all_s'] * 1e3:.0f} ms of the {step_s * 1e3:.0f} ms step; {moved} mapped buckets "
            "move to the host for the next steps (kept unless those steps are slower)"
        )
        return True

    def _end_trial(self, m: dict, *, first: int, last: int, step_s: float) -> None:
        before, self._trial = self._trial, None
        keep = step_s <= before["step_s"]
        moved = 0 if keep else self._move(before["placements"])
        self.opt.plan_history.record({
            "step": last, "change": "host-only trial kept" if keep else "host-only trial undone",
            "measured_steps": [first, last], "step_s": step_s, "step_s_before": before["step_s"],
            "measured": dict(m), "moved_buckets": moved,
        })  # fmt: skip
        self.opt._log(
            f"optimizer_mode=auto after step {last}: steps {first}-{last} with the host updating every "
            f"movable bucket took {step_s:.3f} s/step against {before['step_s']:.3f}: "
            + ("kept, split settled" if keep else f"{moved} buckets moved back, split settled")
        )

    def _revert(self, before: dict, m: dict, *, first: int, last: int, step_s: float) -> None:
        """The measured step got slower after the last move (what the model leaves out: the
        mapped kernel's seconds on the GPU, the issue time): the placements go back, settled."""
        opt = self.opt
        moved = self._move(before["placements"])
        opt.plan_history.record({
            "step": last, "change": "optimizer split reverted", "measured_steps": [first, last],
            "refinement": self.refinements, "step_s": step_s, "step_s_before": before["step_s"],
            "measured": dict(m), "moved_buckets": moved,
        })  # fmt: skip
        opt._log(
            f"optimizer_mode=auto after step {last}: steps {first}-{last} took {step_s:.3f} s/step, "
            f"{step_s / before['step_s'] - 1:.0%} more than before the last refinement "
            f"({before['step_s']:.3f}); {moved} buckets moved back, split settled"
        )

    def _rates(self, m: dict) -> tuple[float, float, dict]:
        alone = self.opt.split_info
        if "host_params_per_s" not in alone or "pcie_bytes_per_s" not in alone:
            from .optimizer_split import measured_rates

            alone = {**measured_rates(self.opt._engine.device), **alone}
        src = {}
        if m["host_numel"] > 0 and m["host_s"] > 0:
            host, src["host"] = m["host_numel"] / m["host_s"], "measured"
        else:
            host, src["host"] = alone["host_params_per_s"], "isolated"
        if m["mapped_bytes"] > 0 and m["mapped_s"] > 0:
            pcie, src["pcie"] = m["mapped_bytes"] / m["mapped_s"], "measured"
        else:
            pcie, src["pcie"] = alone.get("pcie_bytes_per_s", 0.0), "isolated"
        src.update(host_alone=alone["host_params_per_s"], pcie_alone=alone.get("pcie_bytes_per_s"))
        return host, pcie, src

    def _refine(self, m: dict, *, first: int, last: int, wall_s: float) -> bool:
        """Decides, moves, logs, records. Returns whether buckets moved."""
        opt, e = self.opt, self.opt._engine
        host, pcie, src = self._rates(m)
        n_steps = last - first + 1
        entry = {
            "step": last,
            "change": "keep optimizer split",
            "measured_steps": [first, last],
            "refinement": self.refinements,
            "rate_sources": src,
            "host_s_per_step": m["host_s"] / n_steps,
            "mapped_s_per_step": m["mapped_s"] / n_steps,
            "mapped_bytes_per_step": m["mapped_bytes"] // n_steps,
            "throttle_s_per_step": m["throttle_s"] / n_steps,
            "step_s": wall_s,
            "measured": dict(m),  # the window's sums (host_numel, host_s, mapped_*, throttle_s)
        }
        if host <= 0 or pcie <= 0:
            entry["reason"] = "no rate to refine with"
            opt.plan_history.record(entry)
            return False
        targets, info = choose_refined(bucket_facts(e.buckets), host_params_per_s=host, pcie_bytes_per_s=pcie)
        entry.update(info)
        moved, t0 = 0, time.perf_counter()
        if info["move"]:
            entry["change"] = "optimizer split refined"
            moved = self._move(targets)
        entry.update(moved_buckets=moved, relocate_s=time.perf_counter() - t0)
        got = {p: sum(b.numel for b in e.buckets if b.placement == p and b.exp_avg is not None)
               for p in ("device", "mapped", "host")}  # fmt: skip
        entry["numel_now"] = got
        opt.plan_history.record(entry)
        total = max(1, sum(got.values()))
        share = " / ".join(f"{got[p] / total:.0%} {p}" for p in ("device", "mapped", "host"))
        verdict = (
            f"{moved} buckets moved, now {share}"
            if info["move"]
            else f"kept ({share}; gain {info['gain']:.1%} <= {info['min_gain']:.0%})"
        )
        opt._log(
            f"optimizer_mode=auto, refined after step {last} from steps {first}-{last}: host "
            f"{host / 1e9:.2f} G params/s ({src['host']}; {src['host_alone'] / 1e9:.2f} alone), mapped "
            f"PCIe {pcie / 1e9:.1f} GB/s ({src['pcie']}), throttle {entry['throttle_s_per_step']:.3f} "
            f"s/step; predicted optimizer time {info['predicted_s_before'] * 1e3:.0f} -> "
            f"{info['predicted_s_after'] * 1e3:.0f} ms: {verdict}"
        )
        return moved > 0

    def _move(self, targets: list[str]) -> int:
        return move_buckets(self.opt, targets, self.relocate, "optimizer split refinement")


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
    low-precision model with accumulation (host only) never refine."""
    if opt.mode != "auto" or opt._distributed or "host_params_per_s" not in opt.split_info:
        return None
    return SplitRefiner(opt, start_after=start_after)
