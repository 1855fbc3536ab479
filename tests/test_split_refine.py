"""The measured refinement of optimizer_mode="auto"'s host / mapped split (runtime/refiner.py, deciding through planner/inflight.py): the
decision on injected rates, the schedule and its bookkeeping through the real optimizer on the CPU
engine (injected measurements and moves: the CPU engine has no mapped placement), and on the GPU
the moves themselves, which keep training equal to torch.optim.AdamW."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import pytest
import torch

import ramstream
from ramstream.engine import layout
from ramstream.planner import inflight
from ramstream.planner.inflight import choose_refined
from ramstream.planner.rules import MAX_REFINEMENTS, MEASURE_STEPS
from ramstream.runtime.measure import bucket_facts
from ramstream.runtime.refiner import SplitRefiner, make_refiner

from _models import batches, clone, make_model, max_diff, train_torch


def _buckets(placements, numel=100, dtype=torch.bfloat16, streamed=()):
    """A bf16 model with fp32 moments: 2 B each way per host element, 12 B per mapped one."""
    return bucket_facts(
        [
            SimpleNamespace(
                index=i,
                numel=numel,
                dtype=dtype,
                placement=p,
                streamed=i in streamed,
                exp_avg=torch.empty(0, dtype=torch.float32),
            )  # fmt: skip
            for i, p in enumerate(placements)
        ]
    )


CURRENT = ["mapped"] * 3 + ["host"] * 7  # host 700 elements, PCIe 300 x 12 + 700 x 2 = 5000 B


def test_a_host_slower_than_assumed_gets_more_mapped_buckets():
    # host 700 / 350 = 2 s, PCIe 5000 / 5000 = 1 s: the host is the bound
    out, info = choose_refined(_buckets(CURRENT), host_params_per_s=350, pcie_bytes_per_s=5000)
    assert info["move"] and out.count("mapped") > 3
    k = out.count("mapped")
    assert out == ["mapped"] * k + ["host"] * (10 - k)  # the front of the model, as vram_share
    assert info["predicted_s_before"] == pytest.approx(2.0)
    assert info["predicted_s_after"] < 0.95 * 2.0 and info["gain"] > inflight.MIN_GAIN
    assert info["numel"]["mapped"] == 100 * k and info["numel"]["host"] == 100 * (10 - k)


def test_a_host_faster_than_assumed_gets_fewer_mapped_buckets():
    # host 700 / 1400 = 0.5 s, PCIe 1 s: PCIe is the bound
    out, info = choose_refined(_buckets(CURRENT), host_params_per_s=1400, pcie_bytes_per_s=5000)
    assert info["move"] and 0 <= out.count("mapped") < 3
    assert info["predicted_s_after"] < info["predicted_s_before"]


def test_a_gain_within_the_threshold_moves_nothing():
    # balanced (1 s each): nothing better at bucket granularity
    out, info = choose_refined(_buckets(CURRENT), host_params_per_s=700, pcie_bytes_per_s=5000)
    assert out == CURRENT and not info["move"] and info["gain"] == pytest.approx(0.0)
    # finer buckets and a host 3 % slower: a better boundary exists, but by less than 5 %
    fine = ["mapped"] * 30 + ["host"] * 70
    out, info = choose_refined(_buckets(fine, numel=10), host_params_per_s=700 / 1.03, pcie_bytes_per_s=5000)
    assert 0 < info["gain"] <= inflight.MIN_GAIN and not info["move"] and out == fine
    out, info = choose_refined(
        _buckets(fine, numel=10), host_params_per_s=700 / 1.03, pcie_bytes_per_s=5000, min_gain=0.0
    )
    assert info["move"] and out.count("mapped") > 30


@pytest.mark.parametrize("host_rate", [1.0, 1e12])  # every movable bucket mapped / on the host
def test_streamed_and_device_buckets_never_move(host_rate):
    placements = ["device", "device", "host", "mapped", "host", "host"]
    bs = _buckets(placements, streamed={2})
    out, info = choose_refined(bs, host_params_per_s=host_rate, pcie_bytes_per_s=5000)
    assert out[:3] == ["device", "device", "host"]
    assert set(out[3:]) == ({"mapped"} if host_rate == 1.0 else {"host"})
    assert info["numel"]["device"] == 200
    # another rank's bucket (no state) keeps its placement too
    bs[4] = dataclasses.replace(bs[4], has_state=False)
    out, _ = choose_refined(bs, host_params_per_s=host_rate, pcie_bytes_per_s=5000)
    assert out[4] == "host"


def test_streamed_buckets_count_as_host_work():
    """A streamed bucket is updated on the host: its time weighs on the host side."""
    out_plain, _ = choose_refined(_buckets(["host"] * 4), host_params_per_s=400, pcie_bytes_per_s=8000)
    out_streamed, _ = choose_refined(
        _buckets(["host"] * 8, streamed={4, 5, 6, 7}), host_params_per_s=400, pcie_bytes_per_s=8000
    )
    assert out_streamed[4:] == ["host"] * 4
    assert out_streamed[:4].count("mapped") > out_plain.count("mapped")


def test_make_refiner_only_for_an_auto_split_from_measured_rates():
    rates = {"host_params_per_s": 1e9, "pcie_bytes_per_s": 5e10, "fraction": 0.3}
    mk = lambda mode, info, dist=False: make_refiner(  # noqa: E731
        SimpleNamespace(mode=mode, _distributed=dist, split_info=info), 2
    )
    assert isinstance(mk("auto", rates), SplitRefiner)
    assert mk("cpu", rates) is None and mk("gpu", rates) is None and mk("auto", rates, True) is None
    # no CUDA kernels, or a low-precision model with accumulation: the host updates everything
    assert mk("auto", {"fraction": 0.0, "reason": "low-precision gradients accumulated"}) is None
    assert mk("auto", {}) is None  # a CPU device
    model = make_model(0)
    model, opt = ramstream.wrap(model, torch.optim.AdamW(model.parameters()), device="cpu")
    assert opt._refiner is None and opt.mode == "auto"
    ramstream.unwrap(model)


# ---- the schedule and its bookkeeping through the real optimizer (CPU engine) -------------------
def _wrapped(**kw):
    model = make_model(0, n_blocks=3)
    model, opt = ramstream.wrap(
        model, torch.optim.AdamW(model.parameters(), lr=1e-3), device="cpu", bucket_bytes=4096, **kw
    )
    opt.split_info = {"host_params_per_s": 1e6, "pcie_bytes_per_s": 1e9, "fraction": 0.0}
    return model, opt


def _flip(calls):
    def relocate(engine, b, where):  # the CPU engine has no mapped placement: record and relabel
        calls.append((b.index, b.placement, where))
        b.placement = where

    return relocate


def _after(opt, r, steps):
    """What OffloadAdamW.step does with the refiner: it returns its decisions' history entries and
    the optimizer's session records them."""
    opt._session.take(r.after_step(steps))


def _window(host_rate, pcie_rate, wall_s=1.0):
    return lambda: {"host_numel": int(host_rate), "host_s": 1.0, "mapped_numel": 1, "mapped_s": 1.0,
                    "mapped_bytes": int(pcie_rate), "throttle_s": 0.25, "wall_s": wall_s}  # fmt: skip


def test_one_refinement_moves_logs_records_and_a_second_settles():
    model, opt = _wrapped()
    e = opt._engine
    calls, windows = [], iter([_window(1, 1e12), _window(1, 1e12)])
    opt._refiner = r = SplitRefiner(
        opt, start_after=2, measured=lambda: next(windows)(), relocate_fn=_flip(calls)
    )
    for steps in range(1, 2 + MEASURE_STEPS):  # the window opens after step 2
        _after(opt, r, steps)
    assert not calls and not opt.plan_history
    _after(opt, r, 2 + MEASURE_STEPS)  # refined from steps 3-4: a slow host, everything mapped
    assert len(calls) == len(e.buckets) and {c[2] for c in calls} == {"mapped"}
    (entry,) = opt.plan_history
    assert entry["change"] == "optimizer split refined" and entry["step"] == 4
    assert entry["measured_steps"] == [3, 4] and entry["refinement"] == 1
    assert entry["host_params_per_s"] == 1 and entry["rate_sources"] == {
        "host": "measured", "pcie": "measured", "host_alone": 1e6, "pcie_alone": 1e9,
    }  # fmt: skip
    assert entry["moved_buckets"] == len(e.buckets) and entry["throttle_s_per_step"] == 0.125
    assert entry["numel_now"]["mapped"] == sum(b.numel for b in e.buckets) == e.mapped_numel
    report = ramstream.memory_report(model)
    assert report["plan"]["optimizer"]["split"]["refinements"] == [entry]
    assert not report["plan"]["optimizer"]["split"]["settled"]
    assert entry in report["plan"]["history"]
    assert any(
        "refined after step 4 from steps 3-4" in line and "buckets moved" in line for line in report["events"]
    )
    for steps in range(5, 5 + MEASURE_STEPS):  # measured again: 5-6; nothing better -> kept, settled
        _after(opt, r, steps)
    assert len(opt.plan_history) == 2 and opt.plan_history[1]["change"] == "keep optimizer split"
    assert opt.plan_history[1]["measured_steps"] == [5, 6] and r.settled and len(calls) == len(e.buckets)
    for steps in range(7, 20):
        _after(opt, r, steps)
    assert (
        len(opt.plan_history) == 2 and ramstream.memory_report(model)["plan"]["optimizer"]["split"]["settled"]
    )
    for b in e.buckets:
        b.placement = "host"
    ramstream.unwrap(model)


def test_at_most_max_refinements_even_when_every_window_asks_for_a_move():
    model, opt = _wrapped()
    calls, flip = [], iter([_window(1, 1e12), _window(1e12, 1), _window(1, 1e12)] * 3)
    r = SplitRefiner(opt, start_after=2, measured=lambda: next(flip)(), relocate_fn=_flip(calls))
    for steps in range(1, 40):
        _after(opt, r, steps)
    entries = [h for h in opt.plan_history if h["change"] == "optimizer split refined"]
    assert len(entries) == len(opt.plan_history) == MAX_REFINEMENTS and r.settled
    assert [h["step"] for h in entries] == [4, 6]
    assert all(b.placement == "host" for b in opt._engine.buckets)  # there and back, then settled
    ramstream.unwrap(model)


def test_a_move_that_made_the_measured_step_slower_is_undone_and_settles():
    model, opt = _wrapped()
    calls = []
    windows = iter([_window(1, 1e12, wall_s=1.0), _window(1, 1e12, wall_s=1.0 * (1 + 2 * inflight.MIN_GAIN))])
    r = SplitRefiner(opt, start_after=2, measured=lambda: next(windows)(), relocate_fn=_flip(calls))
    for steps in range(1, 12):
        _after(opt, r, steps)
    assert [h["change"] for h in opt.plan_history] == ["optimizer split refined", "optimizer split reverted"]
    undo = opt.plan_history[1]
    assert undo["step"] == 6 and undo["step_s_before"] == 0.5 and undo["step_s"] == pytest.approx(0.55)
    assert undo["moved_buckets"] == len(opt._engine.buckets) and r.settled
    assert all(b.placement == "host" for b in opt._engine.buckets) and opt._engine.mapped_numel == 0
    report = ramstream.memory_report(model)
    assert [h["change"] for h in report["plan"]["optimizer"]["split"]["refinements"]] == [
        "optimizer split refined", "optimizer split reverted"]  # fmt: skip
    assert any("moved back, split settled" in line for line in report["events"])
    ramstream.unwrap(model)


def test_running_out_of_memory_keeps_the_bucket_and_the_rest_where_they_were():
    model, opt = _wrapped()
    calls = []
    flip = _flip(calls)

    def relocate(engine, b, where):
        if b.index == 1:
            raise torch.OutOfMemoryError("no room")
        flip(engine, b, where)

    r = SplitRefiner(opt, start_after=2, measured=_window(1, 1e12), relocate_fn=relocate)
    for steps in range(1, 5):
        _after(opt, r, steps)
    assert [b.placement for b in opt._engine.buckets][:3] == ["mapped", "host", "host"]
    (entry,) = opt.plan_history
    assert entry["moved_buckets"] == 1 and entry["numel_now"]["mapped"] == opt._engine.buckets[0].numel
    assert any("bucket 1 stays host" in line for line in ramstream.memory_report(model)["events"])
    opt._engine.buckets[0].placement = "host"
    ramstream.unwrap(model)


def test_host_trial_fits_counts_the_host_share_and_the_mapped_one():
    bs = _buckets(["device", "mapped", "mapped", "host", "host"], streamed={4})
    fits, info = inflight.host_trial_fits(bs, host_params_per_s=100, step_s=4.0 / inflight.HOST_TRIAL_SHARE)
    assert fits and info["mapped_numel"] == 200 and info["host_all_s"] == pytest.approx(4.0)  # 400 of 500
    fits, _ = inflight.host_trial_fits(bs, host_params_per_s=100, step_s=3.9 / inflight.HOST_TRIAL_SHARE)
    assert not fits  # the host would take more than its share of the step
    no_mapped = _buckets(["device", "host", "host"])
    assert not inflight.host_trial_fits(no_mapped, host_params_per_s=1e12, step_s=1.0)[0]
    assert not inflight.host_trial_fits(bs, host_params_per_s=0.0, step_s=1.0)[0]


def _trial(trial_step_s: float, step_s: float = 1.0):
    """Every bucket mapped, windows whose rates keep that split (the host 2n params/s, PCIe 160n
    B/s: moving buckets to the host gains < MIN_GAIN), a step of step_s: the host could update all
    n params in 0.5 s. The trial window measures trial_step_s."""
    model, opt = _wrapped()
    e = opt._engine
    for b in e.buckets:  # labels only: the CPU engine has no mapped placement
        b.placement = "mapped"
    n = sum(b.numel for b in e.buckets)
    calls = []
    windows = iter(
        [_window(2 * n, 160 * n, wall_s=2 * step_s), _window(2 * n, 160 * n, wall_s=2 * trial_step_s)]
    )
    r = SplitRefiner(opt, start_after=2, measured=lambda: next(windows)(), relocate_fn=_flip(calls))
    for steps in range(1, 14):
        _after(opt, r, steps)
    return model, opt, r, calls


@pytest.mark.parametrize("faster", [True, False])
def test_a_kept_mapped_share_is_tried_on_the_host_and_kept_only_when_not_slower(faster):
    model, opt, r, calls = _trial(0.9 if faster else 1.1)
    e = opt._engine
    changes = [h["change"] for h in opt.plan_history]
    end = "host-only trial kept" if faster else "host-only trial undone"
    assert changes == ["keep optimizer split", "optimizer split host-only trial", end] and r.settled
    trial = opt.plan_history[1]
    assert trial["step"] == 4 and trial["moved_buckets"] == len(e.buckets)
    assert trial["host_all_s"] == pytest.approx(0.5) and trial["step_s_before"] == pytest.approx(1.0)
    done = opt.plan_history[2]
    assert done["measured_steps"] == [5, 6] and done["step_s"] == pytest.approx(0.9 if faster else 1.1)
    want = "host" if faster else "mapped"
    assert {b.placement for b in e.buckets} == {want}
    assert e.mapped_numel == (0 if faster else sum(b.numel for b in e.buckets))
    assert len(calls) == len(e.buckets) * (1 if faster else 2)
    split = ramstream.memory_report(model)["plan"]["optimizer"]["split"]
    assert [h["change"] for h in split["refinements"]] == changes and split["settled"]
    events = ramstream.memory_report(model)["events"]
    assert any("move to the host for the next steps" in line for line in events)
    assert any(("kept, split settled" if faster else "moved back, split settled") in line for line in events)
    for b in e.buckets:
        b.placement = "host"
    ramstream.unwrap(model)


def test_no_trial_when_the_host_would_take_too_much_of_the_step():
    model, opt, r, calls = _trial(0.1, step_s=0.5 / inflight.HOST_TRIAL_SHARE * 0.95)
    assert [h["change"] for h in opt.plan_history] == ["keep optimizer split"] and r.settled and not calls
    for b in opt._engine.buckets:
        b.placement = "host"
    ramstream.unwrap(model)


def test_the_host_rate_is_measured_from_the_engine_in_training():
    """Real training on the CPU engine: the window's host elements and seconds come from stats();
    with no mapped bucket the isolated PCIe rate stands in."""
    model, opt = _wrapped()
    calls = []
    opt._refiner = SplitRefiner(opt, start_after=2, relocate_fn=_flip(calls))
    opt.split_info["pcie_bytes_per_s"] = 1e30  # PCIe for free: everything goes to the GPU
    train_torch(model, opt, batches(4))
    numel = opt.stats()["numel"]
    assert opt.stats()["host_updated_numel"] == 4 * numel
    (entry,) = opt.plan_history
    assert entry["rate_sources"]["host"] == "measured" and entry["rate_sources"]["pcie"] == "isolated"
    assert entry["host_s_per_step"] > 0 and entry["mapped_s_per_step"] == 0
    m = entry["measured"]  # steps 3-4
    assert m["host_numel"] == 2 * numel and m["mapped_numel"] == 0  # the window opens drained
    assert entry["step_s"] == pytest.approx(m["wall_s"] / 2) and m["wall_s"] > 0
    assert entry["host_params_per_s"] == pytest.approx(m["host_numel"] / m["host_s"])
    assert entry["change"] == "optimizer split refined" and {c[2] for c in calls} == {"mapped"}
    for b in opt._engine.buckets:
        b.placement = "host"
    ramstream.unwrap(model)


# ---- GPU ---------------------------------------------------------------------------------------
DEV = "cuda"


@pytest.mark.cuda
@pytest.mark.parametrize("accumulation", [1, 2])
def test_forced_refinements_move_buckets_and_match_torch(accumulation):
    """Injected windows: a slow host after steps 3-4 (every bucket to mapped), then a slow PCIe
    after 5-6 (every bucket back to the host); training stays within 1e-5 of torch's AdamW."""
    ref = make_model(0, n_blocks=3).to(DEV)
    model = clone(ref)
    data = batches(12 * accumulation, device=DEV)
    torch_opt = torch.optim.AdamW(ref.parameters(), lr=3e-3, weight_decay=0.05, foreach=False)
    train_torch(ref, torch_opt, data, accumulation=accumulation)
    model, opt = ramstream.wrap(
        model,
        torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.05),
        optimizer_mode="auto",
        offload=True,
        bucket_bytes=8192,
        accumulation_steps=accumulation,
    )
    assert opt._refiner is not None
    for b in opt._engine.buckets:  # from all on the host, whatever the isolated split chose
        layout.relocate(opt._engine, b, "host")
    windows = iter([_window(1, 1e15), _window(1e15, 1)])
    seen = []
    real = layout.relocate

    def relocate(engine, b, where):
        seen.append((b.index, b.placement, where))
        real(engine, b, where)

    opt._refiner = SplitRefiner(opt, start_after=2, measured=lambda: next(windows)(), relocate_fn=relocate)
    train_torch(model, opt, data[: 4 * accumulation], accumulation=accumulation)
    assert {b.placement for b in opt._engine.buckets} == {"mapped"}
    assert opt._engine.buckets[0].exp_avg.is_pinned()
    train_torch(model, opt, data[4 * accumulation :], accumulation=accumulation)
    opt.synchronize()
    assert {b.placement for b in opt._engine.buckets} == {"host"}
    assert any(w == "mapped" for _, _, w in seen) and any(w == "host" for _, _, w in seen)
    assert [h["change"] for h in opt.plan_history] == ["optimizer split refined"] * 2
    assert max_diff(ref, model) < 1e-5
    ramstream.unwrap(model)


@pytest.mark.cuda
def test_measured_refinement_on_the_gpu_records_real_rates_and_stays_exact():
    """No injection: the window's rates are the engine's own (host stats, CUDA events around the
    mapped launches); whatever it decides, training equals torch's AdamW."""
    ref = make_model(0, n_blocks=4).to(DEV)
    model = clone(ref)
    data = batches(10, device=DEV)
    train_torch(ref, torch.optim.AdamW(ref.parameters(), lr=3e-3, foreach=False), data)
    model, opt = ramstream.wrap(
        model, torch.optim.AdamW(model.parameters(), lr=3e-3), optimizer_mode="auto", offload=True,
        bucket_bytes=8192,
    )  # fmt: skip
    e = opt._engine
    mapped_before = sum(1 for b in e.buckets if b.placement == "mapped")
    train_torch(model, opt, data)
    opt.synchronize()
    entries = ramstream.memory_report(model)["plan"]["optimizer"]["split"]["refinements"]
    # at most MAX_REFINEMENTS split decisions, then at most one host-only trial and its verdict
    # (runtime/refiner.py's schedule); the first after step 4
    decisions = [x for x in entries if "trial" not in x["change"]]
    trials = [x for x in entries if "trial" in x["change"]]
    assert 1 <= len(decisions) <= MAX_REFINEMENTS and len(trials) <= 2 and entries[0]["step"] == 4
    assert [x["change"] for x in entries] == [x["change"] for x in decisions + trials]
    first = entries[0]
    assert first["rate_sources"]["host"] == ("measured" if mapped_before < len(e.buckets) else "isolated")
    if mapped_before:
        assert first["rate_sources"]["pcie"] == "measured" and first["mapped_bytes_per_step"] > 0
        assert first["mapped_s_per_step"] > 0
    assert e.updater.mapped.timing is None or not opt._refiner.settled
    assert max_diff(ref, model) < 1e-5
    ramstream.unwrap(model)
