"""The decisions taken while training go through one entry point, planner/revise.py revise_training
(records of numbers in planner/training.py -> a Decision): each kind against hand arithmetic
(pure), and end to end on the CPU engine: a decision taken in training produces exactly one history
entry, recorded by the session (runtime/session.py TrainingSession), and training stays exact."""

from __future__ import annotations

import dataclasses
import math
import sys

import pytest
import torch

import ramstream
from ramstream.engine import layout, rates
from ramstream.planner import inflight
from ramstream.planner.revise import revise_training
from ramstream.planner.rules import KEEP_SAFETY, MAX_REFINEMENTS, MIN_GAIN, WATCHDOG_HEADROOM_USED
from ramstream.planner.training import (
    MEASUREMENTS,
    BucketFacts,
    FreeVram,
    HostTrialCheck,
    KeepCheck,
    PeakCheck,
    ResidentCheck,
    ShareCheck,
    SplitWindow,
)
from ramstream.runtime import measure
from ramstream.runtime.history import PlanHistory
from ramstream.runtime.session import TrainingSession

from _models import batches, clone, make_model, max_diff, train_torch

G = 2**30


def _facts(placements, numel=100, low_precision=False, streamed=()):
    """fp32 moments; an fp32 bucket: 8 B of state in VRAM, 4 B each way per host element, 8 per
    mapped one; a bf16 one: 12 B in VRAM (the fp32 master), 2 B per host element, 12 per mapped one."""
    return tuple(
        BucketFacts(index=i, numel=numel, placement=p, working_bytes=2 if low_precision else 4, moment_bytes=4,
                    low_precision=low_precision, streamed=i in streamed)
        for i, p in enumerate(placements)
    )  # fmt: skip


# ---- each kind, pure ------------------------------------------------------------------------------
def test_resident_check_predicts_the_resident_peak():
    # transient = peak - now = 2 GiB, grads 1 GiB: 1 + 2 + max(2, 1) + 1 // 4 = 5.25 GiB
    m = ResidentCheck(step=2, usable=6 * G, peak=3 * G, now=1 * G, persistent_bytes=2 * G, grad_bytes=1 * G,
                      headroom=0.1)  # fmt: skip
    d = revise_training(m)
    assert d.numbers["predicted_peak"] == 5 * G + G // 4 and d.numbers["room"] == int(6 * G * 0.9)
    assert d.act and d.change == "resident"  # 5.25 <= 5.4
    d = revise_training(dataclasses.replace(m, usable=5 * G))  # room 4.5 GiB
    assert not d.act and d.change == "keep offloading"


def test_share_check_places_the_first_buckets_that_fit_then_splits_the_rest(monkeypatch):
    monkeypatch.setattr(inflight, "MARGIN_BYTES", 1000)
    buckets = _facts(["host"] * 5)  # 800 B of state each in VRAM
    # room = 10000 x 0.9 - 6300 - 1000 = 1700: two buckets' state
    m = ShareCheck(step=2, usable=10_000, peak=6_300, headroom=0.1, buckets=buckets, moment_bytes=4,
                   host_params_per_s=1e6, pcie_bytes_per_s=1.2e7)  # fmt: skip
    d = revise_training(m)
    # the rest (300 elements): host time 300 / 1e6 s against PCIe 300 x (8f + 4 (1 - f)) / 1.2e7 s:
    # equal at f = (1 - 1/3) / (1 + 1/3) = 0.5: a bucket is mapped while mapped + 50 <= 150
    assert d.change == "optimizer state share" and d.act and d.numbers["room_bytes"] == 1700
    assert d.placements == ("device", "device", "mapped", "host", "host")
    assert d.numbers["mapped_fraction_of_rest"] == pytest.approx(0.5)
    assert d.numbers["device_bytes"] == 1600 and d.numbers["mapped_numel"] == 100
    gpu = revise_training(dataclasses.replace(m, gpu_only=True, host_params_per_s=0.0, pcie_bytes_per_s=0.0))
    assert gpu.placements == ("device", "device", "mapped", "mapped", "mapped")
    none = revise_training(dataclasses.replace(m, peak=8_000))  # 9000 - 8000 - 1000 = 0
    assert none.change == "keep optimizer placement" and not none.act and none.numbers == {"room_bytes": 0}
    assert none.placements == ()


def _window(placements, *, host_numel=0, host_s=0.0, mapped_bytes=0, mapped_s=0.0, wall_s=1.0, **kw):
    return SplitWindow(step=4, first=3, buckets=_facts(placements, low_precision=True), host_numel=host_numel,
                       host_s=host_s, mapped_numel=0, mapped_s=mapped_s, mapped_bytes=mapped_bytes,
                       throttle_s=0.5, wall_s=wall_s, host_alone=1e6, pcie_alone=1e9, refinement=1, **kw)  # fmt: skip


def test_split_window_refines_from_the_rates_the_window_measured():
    # bf16, 3 mapped + 7 host buckets of 100: the window's host rate 700 elements / 2 s = 350/s,
    # PCIe 5000 B / 1 s: host 2 s, PCIe (300 x 12 + 700 x 2) / 5000 = 1 s. k mapped: host
    # (1000 - 100k) / 350 s, PCIe (100k x 12 + (1000 - 100k) x 2) / 5000 = (2000 + 1000k) / 5000 s:
    # k = 5 gives max(500/350, 7000/5000) = 1.43 s, the least (k = 4: 1.71 s; k = 6: 1.6 s)
    w = _window(["mapped"] * 3 + ["host"] * 7, host_numel=700, host_s=2.0, mapped_bytes=5000, mapped_s=1.0)
    d = revise_training(w)
    assert d.change == "optimizer split refined" and d.act and d.again == (1 < MAX_REFINEMENTS)
    assert d.placements == ("mapped",) * 5 + ("host",) * 5
    assert d.numbers["host_params_per_s"] == 350 and d.numbers["pcie_bytes_per_s"] == 5000
    assert d.numbers["predicted_s_before"] == pytest.approx(2.0)
    assert d.numbers["predicted_s_after"] == pytest.approx(500 / 350)
    assert d.numbers["rate_sources"] == {
        "host": "measured",
        "pcie": "measured",
        "host_alone": 1e6,
        "pcie_alone": 1e9,
    }
    assert d.numbers["step_s"] == 0.5 and d.numbers["throttle_s_per_step"] == 0.25  # 2 steps in 1 s
    # nothing measured: the isolated rates (host 1e6/s, PCIe 1e9 B/s) stand in
    d = revise_training(_window(["host"] * 10))
    assert d.numbers["rate_sources"]["host"] == d.numbers["rate_sources"]["pcie"] == "isolated"
    assert d.numbers["host_params_per_s"] == 1e6
    # no PCIe rate at all: nothing to refine with
    d = revise_training(dataclasses.replace(_window(["host"] * 10), pcie_alone=None))
    assert (
        d.change == "keep optimizer split" and not d.act and d.numbers["reason"] == "no rate to refine with"
    )


def test_split_window_undoes_a_slower_move_and_judges_the_host_trial():
    before = ("mapped",) * 10
    slower = _window(["host"] * 10, wall_s=2 * 0.5 * (1 + MIN_GAIN) + 1e-9, placements_before=before,
                     step_s_before=0.5)  # fmt: skip
    d = revise_training(slower)
    assert d.change == "optimizer split reverted" and d.settle and d.placements == before
    assert d.numbers == {"step_s": pytest.approx(0.5 * (1 + MIN_GAIN)), "step_s_before": 0.5}
    within = revise_training(dataclasses.replace(slower, wall_s=2 * 0.5 * (1 + MIN_GAIN)))
    assert within.change != "optimizer split reverted" and not within.settle
    kept = revise_training(dataclasses.replace(slower, wall_s=1.0, trial=True))  # 0.5 s/step: not slower
    assert kept.change == "host-only trial kept" and not kept.act and kept.settle and kept.placements == ()
    undone = revise_training(dataclasses.replace(slower, wall_s=1.002, trial=True))
    assert undone.change == "host-only trial undone" and undone.act and undone.placements == before


def test_host_trial_check_runs_when_the_host_could_take_every_movable_bucket():
    # the window's host rate 400 / 1 s; the host would update 2 mapped + 1 host buckets of 100:
    # 0.75 s; the window's step 2 s / 2 = 1 s, of which HOST_TRIAL_SHARE (0.6) is 0.6 s: no trial
    w = _window(["mapped", "mapped", "host"], host_numel=400, host_s=1.0, wall_s=2.0)
    check = HostTrialCheck(window=w, buckets=w.buckets)
    d = revise_training(check)
    assert not d.act and d.numbers["host_all_s"] == pytest.approx(0.75) and d.placements == ()
    d = revise_training(dataclasses.replace(check, window=dataclasses.replace(w, wall_s=2.5)))  # 0.75 <= 0.75
    assert d.act and d.placements == ("host", "host", "host") and d.numbers["mapped_numel"] == 200


def test_peak_check_and_free_vram():
    # trigger: 1000 x (1 - 0.1 x WATCHDOG_HEADROOM_USED); the budget 900
    trigger = int(1000 * (1 - 0.1 * WATCHDOG_HEADROOM_USED))
    calm = revise_training(PeakCheck(step=5, usable=1000, peak=trigger, oom=False, headroom=0.1))
    assert not calm.act and calm.numbers == {"trigger_bytes": trigger}
    d = revise_training(PeakCheck(step=5, usable=1000, peak=trigger + 1, oom=False, headroom=0.1))
    assert d.act and d.numbers == {
        "trigger_bytes": trigger,
        "target_bytes": 900,
        "need_bytes": trigger + 1 - 900,
    }
    oom = revise_training(PeakCheck(step=5, usable=1000, peak=100, oom=True, headroom=0.1))
    assert oom.act and oom.numbers["need_bytes"] == int(1000 * 0.1 * WATCHDOG_HEADROOM_USED)
    # kept blocks first: ceil(2500 / 1100) = 3 of them, front first
    back = revise_training(FreeVram(step=5, need=2500, kept=(4, 5, 6, 7), kept_block_bytes=1100,
                                    buckets=_facts(["device"] * 2)))  # fmt: skip
    assert back.blocks == (4, 5, 6) and back.moves == ({"lever": "recompute", "blocks": [4, 5, 6]},)
    assert back.numbers == {"freed_bytes": 3300}
    # then the device share from the back: 801 bytes take two buckets of 800 (fp32 state)
    d = revise_training(FreeVram(step=5, need=801, buckets=_facts(["device"] * 3)))
    assert [(m["bucket"], m["to"], m["bytes"]) for m in d.moves] == [(2, "mapped", 800), (1, "mapped", 800)]
    none = revise_training(FreeVram(step=5, need=801, buckets=_facts(["host"] * 3)))
    assert not none.act and none.change == "watchdog: nothing left to free" and none.moves == ()


def test_keep_check_keeps_the_last_blocks_that_fit():
    # room 10000 x 0.9 - 6000 = 3000; a block 1000 x KEEP_SAFETY = 1100: floor(3000 / 1100) = 2
    m = KeepCheck(step=1, usable=10_000, peak=6_000, headroom=0.1, block_bytes=(1000, 900, 1000, 1000),
                  candidates=(0, 1, 2, 3))  # fmt: skip
    d = revise_training(m)
    assert KEEP_SAFETY == 1.1 and math.floor(3000 / 1100) == 2
    assert d.blocks == (2, 3) and d.change == "2 of 4 recomputed blocks keep their activations"
    assert d.numbers == {"k": 2, "room": 3000, "block_bytes": 1100}
    assert revise_training(dataclasses.replace(m, peak=9_000)).blocks == ()


def test_records_are_frozen_numbers_and_anything_else_is_refused():
    m = PeakCheck(step=5, usable=1000, peak=0, oom=False, headroom=0.1)
    with pytest.raises(dataclasses.FrozenInstanceError):
        m.peak = 1
    assert all(dataclasses.is_dataclass(t) and t.__dataclass_params__.frozen for t in MEASUREMENTS)
    with pytest.raises(TypeError, match="measured must be one of ResidentCheck, ShareCheck.*got dict"):
        revise_training({"peak": 1})


def test_the_session_records_what_a_decider_returns():
    s = TrainingSession()
    s.take(None)
    s.take({"change": "a"})
    s.take([{"change": "b"}, {"change": "c"}])
    assert [h["change"] for h in s.history] == ["a", "b", "c"] and isinstance(s.history, PlanHistory)
    with pytest.raises(TypeError, match="a step hook returns None, a history entry"):
        s.take(3)
    with pytest.raises(TypeError, match="'change' string"):
        s.take([{"step": 1}])


# ---- end to end on the CPU engine -------------------------------------------------------------------
@pytest.fixture
def writers(monkeypatch):
    """Every PlanHistory.record call's caller module (the session must be the only one)."""
    seen = []
    real = PlanHistory.record

    def record(self, entry):
        seen.append(sys._getframe(1).f_globals["__name__"])
        return real(self, entry)

    monkeypatch.setattr(PlanHistory, "record", record)
    return seen


def test_the_vram_share_is_one_entry_recorded_by_the_session_and_training_stays_exact(monkeypatch, writers):
    """offload="auto" on the CPU engine with injected device figures: the resident switch declines,
    the share decides (device for the first two buckets, the rest split at the seeded rates' f =
    0.5); the CPU engine has no device placement, so the moves are recorded, not made."""
    import ramstream.hardware as hardware

    ref = make_model(0, n_blocks=4)
    plain, model = clone(ref), clone(ref)
    data = batches(6)
    train_torch(ref, torch.optim.AdamW(ref.parameters(), lr=3e-3, foreach=False), data)
    plain, popt = ramstream.wrap(plain, torch.optim.AdamW(plain.parameters(), lr=3e-3), device="cpu",
                                 offload=True, bucket_bytes=4096)  # fmt: skip
    train_torch(plain, popt, data)
    popt.synchronize()

    model, opt = ramstream.wrap(model, torch.optim.AdamW(model.parameters(), lr=3e-3), device="cpu",
                                offload="auto", bucket_bytes=4096, watchdog=False)  # fmt: skip
    n = [b.numel for b in opt._engine.buckets]
    assert len(n) >= 4 and opt.mode == "auto"
    peak = 10**6
    usable = int((peak + 8 * (n[0] + n[1]) + 4 * n[2]) / 0.9)  # room: two buckets' state and a half
    room = int(usable * 0.9) - peak
    monkeypatch.setattr(measure, "device_memory", lambda d: {"usable": usable, "peak": peak, "now": peak})
    monkeypatch.setattr(hardware, "kernels_problem", lambda: None)
    monkeypatch.setattr(inflight, "MARGIN_BYTES", 0)
    monkeypatch.setitem(rates._MEASURED, "cpu", {"host_params_per_s": 1e6, "pcie_bytes_per_s": 1.2e7})
    moves = []
    monkeypatch.setattr(layout, "relocate", lambda engine, b, where: moves.append((b.index, where)))
    train_torch(model, opt, data)
    opt.synchronize()

    rest = sum(n[2:])
    mapped, want = 0, ["device", "device"]
    for x in n[2:]:  # the mapped share of the rest: f = 0.5, a bucket while mapped + x / 2 <= f x rest
        use = mapped + x / 2 <= 0.5 * rest
        want.append("mapped" if use else "host")
        mapped += x if use else 0
    assert "mapped" in want[2:] and "host" in want[2:]  # the rest really split
    assert moves == [(i, w) for i, w in enumerate(want) if w != "host"]
    switch, share = opt.plan_history
    assert switch["change"] == "keep offloading" and switch["step"] == 2
    assert share["change"] == "optimizer state share" and share["step"] == 2 and share["room_bytes"] == room
    assert share["device_numel"] == n[0] + n[1] and share["mapped_numel"] == mapped
    assert share["moved_buckets"] == len(moves) and share["measured_peak_bytes"] == peak
    assert writers == ["ramstream.runtime.session"] * 2
    assert ramstream.memory_report(model)["plan"]["history"] == [switch, share]
    assert all(torch.equal(a, b) for a, b in zip(plain.parameters(), model.parameters()))
    assert max_diff(ref, model) < 1e-5
    ramstream.unwrap(model)
    ramstream.unwrap(plain)


def test_the_watchdog_and_the_refiner_record_through_the_session(writers):
    """Real training with injected figures: the watchdog's one action and the refiner's decisions
    are returned by their hooks and recorded by the session, nowhere else."""
    from ramstream.runtime.refiner import SplitRefiner
    from test_split_refine import _flip, _window
    from test_watchdog import DATA, _peaks, _wrap

    model, opt = _wrap(activation_offload=False)
    wd = model._ramstream.watchdog
    wd.measure = _peaks([100] * 8, ooms=[0, 0, 1, 1, 1, 1, 1, 1])
    train_torch(model, opt, DATA)
    (act,) = wd.actions
    assert opt.plan_history == [act] and writers == ["ramstream.runtime.session"]
    ramstream.unwrap(model)

    writers.clear()
    model = make_model(0, n_blocks=3)
    model, opt = ramstream.wrap(model, torch.optim.AdamW(model.parameters(), lr=1e-3), device="cpu",
                                bucket_bytes=4096, watchdog=False)  # fmt: skip
    opt.split_info = {"host_params_per_s": 1e6, "pcie_bytes_per_s": 1e9, "fraction": 0.0}
    calls = []
    opt._refiner = SplitRefiner(opt, start_after=2, measured=_window(1, 1e12), relocate_fn=_flip(calls))
    train_torch(model, opt, batches(4))  # the window: steps 3-4 (after step 4 the labels say "mapped")
    (entry,) = opt.plan_history
    assert entry["change"] == "optimizer split refined" and entry["moved_buckets"] == len(calls) > 0
    assert writers == ["ramstream.runtime.session"]
    for b in opt._engine.buckets:
        b.placement = "host"
    ramstream.unwrap(model)
