"""The plan's watchdog (runtime/watchdog.py): which levers free VRAM, on the CPU engine with injected
peaks (the CPU has no VRAM: the peaks, and for bucket moves the placements a GPU would have, are
stand-ins) through real training that must stay bit-identical to a run without the watchdog, and
on the GPU a batch that grows under a per-process cap, and a step that runs out of memory."""

from __future__ import annotations

import gc
from types import SimpleNamespace

import pytest
import torch

import ramstream
from ramstream.engine import layout
from ramstream.planner.levers import choose_levers
from ramstream.runtime.measure import bucket_facts

from _models import TinyGPT, batches, clone, make_model, train_torch


def device_bytes(b) -> int:
    return bucket_facts([b])[0].device_bytes


def _buckets(placements, numel=100, dtype=torch.float32, streamed=(), no_state=()):
    return [
        SimpleNamespace(index=i, numel=numel, dtype=dtype, placement=p, streamed=i in streamed,
                        exp_avg=None if i in no_state else torch.empty(0, dtype=torch.float32))
        for i, p in enumerate(placements)
    ]  # fmt: skip


def _levers(buckets, need, paged=None, n_blocks=0, block_bytes=(), allow_host=False):
    return choose_levers(
        bucket_facts(buckets),
        need,
        paged=paged,
        n_blocks=n_blocks,
        block_bytes=list(block_bytes),
        allow_host=allow_host,
    )


# ---- the choice of levers (pure) -----------------------------------------------------------------
def test_device_buckets_go_to_mapped_from_the_back_until_the_need_is_covered():
    bs = _buckets(["device", "device", "device", "mapped", "host"])
    per = device_bytes(bs[0])  # 800: two fp32 moments
    moves = _levers(bs, need=per + 1)
    assert [(m["bucket"], m["from"], m["to"]) for m in moves] == [
        (2, "device", "mapped"),
        (1, "device", "mapped"),
    ]
    assert all(m["lever"] == "optimizer state" and m["bytes"] == per for m in moves)
    assert _levers(bs, need=0) == [] and _levers(bs, need=-5) == []
    assert len(_levers(bs, need=1)) == 1  # at least one lever's worth


def test_streamed_and_stateless_buckets_never_move():
    bs = _buckets(["device", "device", "device"], streamed={2}, no_state={1})
    assert [m["bucket"] for m in _levers(bs, need=10**9)] == [0]


def test_then_more_blocks_page_front_first_by_the_paged_blocks_measured_bytes():
    bs = _buckets(["mapped", "host"])
    moves = _levers(bs, need=1200, paged=[0], n_blocks=5, block_bytes=[500, 0, 0, 0, 0])
    assert moves == [{"lever": "activations", "blocks": [1, 2, 3], "bytes": 1500}]
    assert _levers(bs, need=100, paged=[0], n_blocks=5, block_bytes=[500])[0]["blocks"] == [1]
    # nothing paged yet: no measured size, one block at a time
    assert _levers(bs, need=10**9, paged=[], n_blocks=3, block_bytes=[0, 0, 0])[0]["blocks"] == [0]
    # every block pages already, or no paging at all: no activation lever
    assert _levers(bs, need=100, paged=[0, 1], n_blocks=2, block_bytes=[5, 5]) == []
    assert _levers(bs, need=100) == []


def test_device_share_first_then_activations_then_mapped_to_host_only_when_allowed():
    bs = _buckets(["device", "mapped", "mapped", "host"])
    moves = _levers(bs, need=10**9, paged=[0], n_blocks=2, block_bytes=[100, 0], allow_host=True)
    assert [m["lever"] for m in moves] == ["optimizer state", "activations", "gradients", "gradients"]
    assert [(m["bucket"], m["to"]) for m in moves if "bucket" in m] == [
        (0, "mapped"),
        (2, "host"),
        (1, "host"),
    ]
    assert moves[2]["bytes"] == 100 * 4  # the fp32 gradient no longer waiting in VRAM
    assert [m["lever"] for m in _levers(bs, need=10**9)] == ["optimizer state"]


# ---- through the real optimizer on the CPU engine ------------------------------------------------
def _wrap(**kw):
    model = make_model(0, n_blocks=4)
    kw.setdefault("activation_offload", "auto")  # the CPU engine's "auto" pages nothing, but can
    return ramstream.wrap(
        model, torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.05), device="cpu",
        bucket_bytes=4096, min_offload_bytes=0, **kw,
    )  # fmt: skip


def _peaks(values, usable=1000, ooms=None):
    """A measure() stand-in: one figure per call (a call per step from the plan's settling)."""
    it = iter(zip(values, ooms or [0] * len(values)))

    def measure():
        peak, n = next(it)
        return {"usable": usable, "peak": peak, "ooms": n}

    return measure


def _state(model, opt):
    opt.synchronize()
    sd = opt.state_dict()["state"]
    return [p.detach().clone() for p in model.parameters()], {
        k: (v["exp_avg"].clone(), v["exp_avg_sq"].clone(), float(v["step"])) for k, v in sd.items()
    }


def _same(a, b) -> bool:
    return (
        all(torch.equal(x, y) for x, y in zip(a[0], b[0]))
        and a[1].keys() == b[1].keys()
        and all(torch.equal(a[1][k][0], b[1][k][0]) and torch.equal(a[1][k][1], b[1][k][1])
                and a[1][k][2] == b[1][k][2] for k in a[1])
    )  # fmt: skip


DATA = batches(10)


def _reference():
    model, opt = _wrap(watchdog=False)
    assert model._ramstream.watchdog is None
    assert ramstream.memory_report(model)["plan"]["watchdog"] == {"enabled": False}
    train_torch(model, opt, DATA)
    out = _state(model, opt)
    ramstream.unwrap(model)
    return out


def test_flat_peaks_move_nothing():
    model, opt = _wrap()
    wd = model._ramstream.watchdog
    wd.measure = _peaks([900] * 8)  # 90 % of the usable VRAM: under the 95 % trigger
    train_torch(model, opt, DATA)
    report = ramstream.memory_report(model)
    assert wd.settled_at == 3 and wd.checks == 8 and not wd.actions
    assert report["plan"]["watchdog"]["last"] == {
        "step": 10, "peak_bytes": 900, "usable_bytes": 1000, "trigger_bytes": 950
    }  # fmt: skip
    assert not any(str(h.get("change", "")).startswith("watchdog") for h in report["plan"]["history"])
    assert report["activations"]["paged_blocks"] == [] and not any("watchdog" in x for x in report["events"])
    ramstream.unwrap(model)


def test_growth_after_settling_pages_more_blocks_and_stays_bit_identical():
    ref = _reference()
    model, opt = _wrap()
    wd = model._ramstream.watchdog
    resets = []
    wd.reset_peak = lambda: resets.append(opt._engine.stats["steps"])
    # settled at step 3; the peak grows at step 5, is still too close after one block pages at
    # step 6 (blocks 1-2 more, by block 0's measured bytes), then falls back
    wd.measure = _peaks([800, 800, 960, 990, 900, 900, 900, 900], usable=1000)
    train_torch(model, opt, DATA)
    assert _same(_state(model, opt), ref)  # paging more blocks mid-run changes no bit
    acts = wd.actions
    assert [a["step"] for a in acts] == [5, 6] and resets == [5, 6]
    assert acts[0]["moves"] == [{"lever": "activations", "blocks": [0], "bytes": 0}]
    assert acts[0]["need_bytes"] == 960 - 900 and acts[0]["target_bytes"] == 900
    assert acts[0]["peaks"] == [[3, 800], [4, 800], [5, 960]] and acts[0]["reason"] == "peak"
    assert acts[1]["moves"][0]["blocks"] == [1] and acts[1]["moves"][0]["bytes"] > 0
    report = ramstream.memory_report(model)
    assert report["activations"]["paged_blocks"] == [0, 1] and report["activations"]["packed_bytes"] > 0
    assert report["plan"]["watchdog"]["actions"] == acts and not report["plan"]["watchdog"]["exhausted"]
    assert all(a in report["plan"]["history"] for a in acts)
    assert any("watchdog after step 5" in x and "blocks [0] page" in x for x in report["events"])
    ramstream.unwrap(model)


def test_growth_moves_the_device_share_back_to_mapped_and_stays_bit_identical():
    """The CPU engine's buckets are host buckets: around the watchdog's check, the placements a
    GPU's VRAM share would have made (the last three buckets in VRAM) stand in, and a move copies
    the bucket's state with layout.relocate (into new host tensors) before it is relabelled."""
    ref = _reference()
    model, opt = _wrap(activation_offload=False)
    e, wd = opt._engine, model._ramstream.watchdog
    n = len(e.buckets)
    shadow = {b.index: ("device" if b.index >= n - 3 else "mapped") for b in e.buckets}
    calls = []

    def relocate(engine, b, where):
        calls.append((b.index, b.placement, where))
        b.placement = "mapped"
        layout.relocate(engine, b, "host")  # the state's values copied into new tensors
        shadow[b.index] = b.placement = where

    def pretend():
        opt.synchronize()  # the engine thread reads placements: relabel a quiescent engine
        for b in e.buckets:
            b.placement = shadow[b.index]

    def restore():
        for b in e.buckets:
            b.placement = "host"

    i = opt._step_callbacks.index(wd.after_step)
    opt._step_callbacks[i : i + 1] = [pretend, wd.after_step, restore]
    wd.relocate = relocate
    one = device_bytes(e.buckets[-1])
    # at step 6 the peak passes the trigger (95 %) by one bucket's state over the plan's budget
    # (90 %) plus a byte: the last two buckets move
    usable = 20 * one
    wd.measure = _peaks([10 * one] * 3 + [18 * one + one + 1] + [10 * one] * 4, usable=usable)
    train_torch(model, opt, DATA)
    assert _same(_state(model, opt), ref)
    assert calls == [(n - 2, "device", "mapped"), (n - 1, "device", "mapped")]  # in bucket order
    (act,) = wd.actions
    assert (
        act["step"] == 6
        and act["change"] == "watchdog freed VRAM"
        and act["freed_bytes"] == one + device_bytes(e.buckets[-2])
    )
    assert [m["bucket"] for m in act["moves"]] == [n - 1, n - 2]
    assert [shadow[i] for i in range(n)] == ["mapped"] * (n - 3) + ["device"] + ["mapped"] * 2
    report = ramstream.memory_report(model)
    assert act in report["plan"]["history"] and report["plan"]["watchdog"]["actions"] == [act]
    assert any(f"bucket {n - 1} device -> mapped" in x for x in report["events"])
    ramstream.unwrap(model)


def test_an_out_of_memory_error_triggers_without_a_high_peak_and_no_lever_is_said_once():
    model, opt = _wrap(activation_offload=False)  # host buckets, no paging: nothing to free
    wd = model._ramstream.watchdog
    wd.measure = _peaks([100] * 8, ooms=[2, 2, 3, 3, 3, 4, 4, 4])  # settles with 2 OOMs behind it
    train_torch(model, opt, DATA)
    (act,) = wd.actions  # step 5's OOM; step 8's finds no lever either: not said again
    assert act["step"] == 5 and act["reason"] == "out of memory" and act["ooms"] == 3
    assert act["change"] == "watchdog: nothing left to free" and act["moves"] == [] and wd.exhausted
    assert act["need_bytes"] == int(1000 * 0.10 / 2) and wd.checks == 8
    assert sum("no lever left" in x for x in ramstream.memory_report(model)["events"]) == 1
    ramstream.unwrap(model)


def test_nothing_is_checked_before_the_plan_settles():
    model, opt = _wrap()
    wd = model._ramstream.watchdog
    seen = []
    wd.measure = lambda: seen.append(opt._engine.stats["steps"]) or {"usable": 1, "peak": 0, "ooms": 0}
    opt._refiner = SimpleNamespace(settled=False, after_step=lambda steps: None)
    acts = wd.activations = SimpleNamespace(phase="unpaged", off=model._ramstream.activations.off)
    # (an "auto" measurement still running)
    train_torch(model, opt, DATA[:4])
    assert seen == [] and wd.settled_at is None
    acts.phase = "done"
    train_torch(model, opt, DATA[4:6])
    assert seen == [] and wd.settled_at is None
    opt._refiner.settled = True
    train_torch(model, opt, DATA[6:8])
    assert seen == [7, 8] and wd.settled_at == 7
    opt._refiner = None
    ramstream.unwrap(model)


def test_the_cpu_engine_has_nothing_to_watch_and_the_option_is_validated():
    model, opt = _wrap()
    train_torch(model, opt, DATA[:5])
    plan = ramstream.memory_report(model)["plan"]["watchdog"]
    assert plan["enabled"] and plan["settled_at"] is None and plan["checks"] == 0
    ramstream.unwrap(model)
    with pytest.raises(ValueError, match=r"watchdog=1 is not accepted; accepted: True, False"):
        _wrap(watchdog=1)
    # the watchdog holds the optimizer weakly: a dropped optimizer is freed
    model, opt = _wrap()
    wd = model._ramstream.watchdog
    ramstream.unwrap(model)
    del opt, model
    gc.collect()
    assert wd.opt is None
    wd.after_step()  # and its callback, if still called, does nothing


# ---- GPU -----------------------------------------------------------------------------------------
def _gpu_model():
    torch.manual_seed(0)
    return TinyGPT(vocab=512, d=256, n_blocks=4)


def _gpu_batches(dev, sizes, t=256, seed=3):
    g = torch.Generator().manual_seed(seed)
    return [
        (
            torch.randint(0, 512, (b, t), generator=g).to(dev),
            torch.randint(0, 512, (b, t), generator=g).to(dev),
        )
        for b in sizes
    ]


def _gpu_wrap(base, dev, **kw):
    """Every bucket's state in VRAM after step 1, as the VRAM share places a state that fits
    (optimizer_mode="gpu", offload=True: no refinement, no share of its own); activations never
    paged (activation_offload="auto" decides from the card's measured rates; on an H100 the watchdog
    did not act, paging the likely cause), so the state is the only lever."""
    model = clone(base).to(dev)
    model, opt = ramstream.wrap(
        model, torch.optim.AdamW(model.parameters(), lr=3e-3), device=dev,
        optimizer_mode="gpu", offload=True, bucket_bytes=1 << 18, param_offload=False,
        activation_checkpointing=False, activation_offload=False, quantize="none", **kw,
    )  # fmt: skip
    return model, opt


def _steps(model, opt, data, first=None):
    for i, (x, y) in enumerate(data):
        model(x, y).backward()
        opt.step()
        opt.zero_grad()
        if first is not None and i == 0:
            first(opt)


def _to_device(opt):
    opt.synchronize()
    for b in opt._engine.buckets:
        layout.relocate(opt._engine, b, "device")


def _clean(dev):
    """After the last reference to a run is gone: its memory and its peak go, so the next run
    (and its watchdog) sees only its own."""
    gc.collect()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(dev)


@pytest.mark.cuda
def test_a_batch_that_grows_under_a_cap_moves_the_state_out_of_vram_bit_exact():
    torch.use_deterministic_algorithms(True, warn_only=True)  # embedding backward: atomics
    dev = torch.device("cuda", torch.cuda.current_device())  # the memory cap needs an index
    base = _gpu_model()
    small, large = _gpu_batches(dev, [2] * 4), _gpu_batches(dev, [24] * 3, seed=4)
    total = torch.cuda.get_device_properties(dev).total_memory
    try:
        _clean(dev)
        ref, ref_opt = _gpu_wrap(base, dev, watchdog=False)
        _steps(ref, ref_opt, small, first=_to_device)
        torch.cuda.synchronize(dev)
        torch.cuda.reset_peak_memory_stats(dev)
        _steps(ref, ref_opt, large[:1])
        torch.cuda.synchronize(dev)
        peak = torch.cuda.max_memory_allocated(dev)  # the large batch's peak, state in VRAM
        _steps(ref, ref_opt, large[1:])
        ref_opt.synchronize()
        want = [p.detach().clone() for p in ref.parameters()]
        ramstream.unwrap(ref)
        del ref, ref_opt
        _clean(dev)

        # vram_headroom 0.5: the trigger is 75 % of the cap; the large step's peak is at 85 %
        model, opt = _gpu_wrap(base, dev, vram_headroom=0.5)
        wd = model._ramstream.watchdog
        _steps(model, opt, small, first=_to_device)
        assert wd.settled_at == 3 and not wd.actions  # the small steps are far from any cap
        assert {b.placement for b in opt._engine.buckets} == {"device"}
        torch.cuda.empty_cache()
        torch.cuda.set_per_process_memory_fraction(min(1.0, peak / 0.85 / total), dev)
        _steps(model, opt, large)
        opt.synchronize()
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0, dev)
        torch.use_deterministic_algorithms(False)
    assert wd.actions, (peak, wd.report(), ramstream.memory_report(model)["plan"]["history"])
    first = wd.actions[0]
    assert first["step"] == 5 and first["reason"] == "peak"
    assert first["peak_bytes"] > first["trigger_bytes"] and first["peak_bytes"] <= first["usable_bytes"]
    assert {m["lever"] for m in first["moves"]} == {"optimizer state"}
    # the state of this model is far smaller than what the step needs back: all of it leaves VRAM
    assert {b.placement for b in opt._engine.buckets} == {"mapped"}
    assert opt._engine.buckets[0].exp_avg.is_pinned()
    plan = ramstream.memory_report(model)["plan"]
    assert plan["optimizer"]["buckets"]["mapped"] == len(opt._engine.buckets)
    assert first in plan["history"] and plan["watchdog"]["actions"][0] == first
    for a, b in zip(want, model.parameters()):  # device -> mapped: the same kernel, bit for bit
        assert torch.equal(a, b)
    ramstream.unwrap(model)


@pytest.mark.cuda
def test_a_step_that_ran_out_of_memory_moves_the_state_out_of_vram_bit_exact():
    torch.use_deterministic_algorithms(True, warn_only=True)
    dev = torch.device("cuda", torch.cuda.current_device())
    base = _gpu_model()
    small = _gpu_batches(dev, [2] * 6)
    (huge,) = _gpu_batches(dev, [512], seed=5)
    try:
        _clean(dev)
        ref, ref_opt = _gpu_wrap(base, dev, watchdog=False, eager_updates=False)
        _steps(ref, ref_opt, small, first=_to_device)
        ref_opt.synchronize()
        want = [p.detach().clone() for p in ref.parameters()]
        ramstream.unwrap(ref)
        del ref, ref_opt
        _clean(dev)

        model, opt = _gpu_wrap(base, dev, eager_updates=False)
        wd = model._ramstream.watchdog
        _steps(model, opt, small[:4], first=_to_device)
        assert wd.settled_at == 3 and not wd.actions
        torch.cuda.synchronize(dev)
        cap = torch.cuda.memory_reserved(dev) + (256 << 20)
        torch.cuda.set_per_process_memory_fraction(
            cap / torch.cuda.get_device_properties(dev).total_memory, dev
        )
        raised = False
        try:
            _steps(model, opt, [huge])  # activations of 512 x 256 tokens: more than the cap
        except torch.OutOfMemoryError:
            raised = True
        assert raised, "the step did not run out of memory"
        opt.zero_grad()  # the failed step is dropped; weights and state are as before it
        _steps(model, opt, small[4:])
        opt.synchronize()
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0, dev)
        torch.use_deterministic_algorithms(False)
    first = wd.actions[0]
    assert first["step"] == 5 and first["reason"] == "out of memory" and first["moves"]
    assert all(m["from"] == "device" and m["to"] == "mapped" for m in first["moves"])
    assert opt._engine.buckets[-1].placement == "mapped"  # the back of the model first
    for a, b in zip(want, model.parameters()):  # as the run without the failed step, bit for bit
        assert torch.equal(a, b)
    ramstream.unwrap(model)
