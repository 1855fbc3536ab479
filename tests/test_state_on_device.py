"""A resident plan lays the optimizer state out in VRAM from wrap() on (issue 24, point 4): no host
state is pinned that the resident switch would drop, the moments are the optimizer's own precision
from the start, the switch takes the state over without a copy, and a step re-planned to an
offloading plan first moves the state to pinned host memory (runtime/optimizer_split.py
state_starts_on_device, fit_state_to). The decision and the step check run on the CPU; the state in
VRAM, the switch and the move against torch run on a GPU."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

import ramstream
import ramstream.hardware as hardware
from ramstream.engine import layout
from ramstream.options import WrapOptions
from ramstream.report import host_state_bytes
from ramstream.runtime.optimizer_split import fit_state_to, state_starts_on_device
from ramstream.runtime.tokens import PlanOutOfMemoryError

from _models import batches, clone, make_model, train_torch

CUDA = torch.device("cuda:0")
LR = 3e-3


def _plan(mode="resident", placement="device", nvme_share=0.0):
    return SimpleNamespace(mode=mode, optimizer={"placement": placement, "nvme_share": nvme_share})


@pytest.fixture
def kernels(monkeypatch):
    """ramstream's CUDA kernels present (the decision asks hardware.kernels_problem)."""
    monkeypatch.setattr(hardware, "kernels_problem", lambda: None)


def test_a_resident_plan_starts_the_state_in_vram_when_the_mechanism_can_run_it(kernels):
    opts = WrapOptions.parse()
    assert state_starts_on_device(_plan(), opts, CUDA, False, False) == (True, "")
    # not resident, no plan, or a plan whose state is not on the device: the host start, no reason
    for plan in (None, _plan("offload", "host"), _plan("cpu", "host"), _plan(placement="mapped")):
        assert state_starts_on_device(plan, opts, CUDA, False, False) == (False, "")
    refusals = [
        (dict(), torch.device("cpu"), False, False, "CUDA device"),
        (dict(offload=True), CUDA, False, False, "offload='auto'"),
        (dict(optimizer_mode="cpu"), CUDA, False, False, "optimizer_mode='auto'"),
        (dict(), CUDA, True, False, "data parallel"),
        # delayed_update never runs resident (nothing would be left to delay)
        (dict(delayed_update=True), CUDA, False, False, "delayed_update"),
        (dict(accumulation_steps=2), CUDA, False, True, "accumulation of a low-precision model"),
    ]
    for options, device, dp, low, why in refusals:
        start, reason = state_starts_on_device(_plan(), WrapOptions.parse(**options), device, dp, low)
        assert not start and why in reason, (options, reason)
    # accumulation of an fp32 model is summed in fp32 by autograd: the state may start on the device
    assert state_starts_on_device(_plan(), WrapOptions.parse(accumulation_steps=2), CUDA, False, False)[0]
    start, reason = state_starts_on_device(_plan(nvme_share=0.5), opts, CUDA, False, False)
    assert not start and "disk tier" in reason


def test_without_the_cuda_kernels_the_state_starts_on_the_host(monkeypatch):
    monkeypatch.setattr(hardware, "kernels_problem", lambda: "the CUDA kernels were not built")
    assert state_starts_on_device(_plan(), WrapOptions.parse(), CUDA, False, False) == (
        False,
        "the CUDA kernels were not built",
    )


def test_the_device_placement_is_refused_off_cuda_with_the_accepted_values():
    model, opt = ramstream.wrap(make_model(0, n_blocks=2), lr=LR, device="cpu")
    engine, b = opt._engine, opt._engine.buckets[0]
    before = (b.placement, b.device_flat, b.exp_avg, b.exp_avg_sq)
    with pytest.raises(ValueError, match="needs a CUDA device"):
        layout.allocate(engine, b, "device")
    with pytest.raises(ValueError, match="accepted: 'host', 'mapped', 'device'"):
        layout.allocate(engine, b, "vram")
    # refused before anything changed: the bucket keeps its placement, buffers and state
    assert all(x is y for x, y in zip(before, (b.placement, b.device_flat, b.exp_avg, b.exp_avg_sq)))
    ramstream.unwrap(model)
    from ramstream.engine.core import Engine

    groups = [{"params": list(make_model(0, n_blocks=1).parameters()), "lr": LR}]
    with pytest.raises(ValueError, match="device_state=True needs a CUDA device"):
        Engine(groups, device=torch.device("cpu"), moment_dtype=torch.float32, max_grad_norm=None,
               accumulation_steps=1, bucket_bytes=1 << 20, guard_params=True, device_state=True)  # fmt: skip


def test_host_state_bytes_counts_only_what_is_in_host_ram():
    cpu = torch.zeros(10)
    meta = torch.empty(1000, device="meta")  # paged to disk, or a stand-in for device memory
    b1 = SimpleNamespace(master=cpu, exp_avg=meta, exp_avg_sq=meta, acc=None)
    b2 = SimpleNamespace(master=None, exp_avg=cpu, exp_avg_sq=cpu, acc=cpu)
    assert host_state_bytes(SimpleNamespace(buckets=[b1, b2])) == 4 * 40


def test_wrap_reports_where_its_time_went():
    model, _ = ramstream.wrap(make_model(0, n_blocks=2), lr=LR, device="cpu")
    rep = ramstream.memory_report(model)
    setup = rep["plan"]["setup_s"]
    phases = {k: v for k, v in setup.items() if k != "total"}
    assert {"plan", "moving the weights", "optimizer state", "the rest"} <= phases.keys()
    assert all(v >= 0 for v in phases.values())
    assert abs(sum(phases.values()) - setup["total"]) < 0.01  # the phases cover wrap() whole
    assert any("wrap() took" in e for e in rep["events"])
    ramstream.unwrap(model)


# ---- the step check: a re-planned step puts the state where its plan has it ----------------------
def _replanned(state):
    """The 8-block model wrapped on the CPU engine with the plan for 2 x 8 tokens on an injected
    32 MiB GPU (test_step_replan.py's setting), its step check given `state`."""
    from test_step_replan import _check, _profile, _wrapped

    ref = make_model(0, n_blocks=8, d=128)
    model, opt, _ = _wrapped(ref, _profile(32))
    _check(model).state = state
    return ref, model, opt


def test_a_re_planned_step_asks_the_state_mover_with_its_plan_and_records_what_moved():
    seen = []

    def mover(plan):
        seen.append(plan.mode)
        return {"change": "optimizer state: device -> mapped (the revised plan offloads it)", "numel": 7}

    ref, model, opt = _replanned(mover)
    small, big = batches(2, b=2, t=8), batches(1, b=64, t=8, seed=2)
    want = train_torch(ref, torch.optim.AdamW(ref.parameters(), lr=LR, fused=True), small + big)
    got = train_torch(model, opt, small)
    assert seen == []  # the planned size: no re-plan
    got += train_torch(model, opt, big)
    assert got == want and len(seen) == 1
    hist = ramstream.memory_report(model)["plan"]["history"]
    moved = [h for h in hist if h["change"].startswith("optimizer state: device -> mapped")]
    want_entry = {"step_tokens": 64 * 8, "change": "optimizer state: device -> mapped (the revised plan offloads it)",
                  "numel": 7}  # fmt: skip
    assert moved == [want_entry]
    ramstream.unwrap(model)


def test_refused_pinned_memory_for_the_state_refuses_the_step_with_nothing_changed():
    def mover(plan):
        raise MemoryError("cudaHostAlloc of 1.00 GiB refused")

    ref, model, opt = _replanned(mover)
    train_torch(model, opt, batches(2, b=2, t=8))
    weights = {k: v.detach().clone() for k, v in model.state_dict().items()}
    (x, y), = batches(1, b=64, t=8, seed=2)  # fmt: skip
    with pytest.raises(PlanOutOfMemoryError, match="optimizer state out of VRAM.*cudaHostAlloc") as e:
        model(x, y)
    assert not e.value.replanned
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in weights.items())
    hist = ramstream.memory_report(model)["plan"]["history"]
    assert hist[-1]["change"] == "refused: pinned memory for the optimizer state"
    ramstream.unwrap(model)


# ---- on a GPU ------------------------------------------------------------------------------------
def _gpu_run(data, *, host_start=False, move_after=None, monkeypatch=None):
    """A small fp32 model wrapped with the defaults on cuda:0 (its plan is resident), trained on
    `data`; host_start: the state starts on the host as before this change (the decision patched);
    move_after: after that many steps the state leaves VRAM (fit_state_to with an offloading plan)."""
    import importlib

    wrap_mod = importlib.import_module("ramstream.wrap")  # the module (ramstream.wrap is the function)
    if host_start:
        monkeypatch.setattr(wrap_mod, "state_starts_on_device", lambda *a: (False, "test: host start"))
    model = make_model(0, n_blocks=2).to(CUDA)
    model, opt = ramstream.wrap(model, torch.optim.AdamW(model.parameters(), lr=LR), device=CUDA)
    info = {"placements": {b.placement for b in opt._engine.buckets}, "host": host_state_bytes(opt._engine)}
    info["ptrs"] = [b.exp_avg.data_ptr() for b in opt._engine.buckets]
    if move_after is None:
        train_torch(model, opt, data)
    else:
        train_torch(model, opt, data[:move_after])
        info["moved"] = fit_state_to(opt, SimpleNamespace(mode="offload"))
        info["after_move"] = {b.placement for b in opt._engine.buckets}
        info["host_after_move"] = host_state_bytes(opt._engine)
        train_torch(model, opt, data[move_after:])
    opt.synchronize()
    return model, opt, info


@pytest.mark.cuda
def test_on_the_gpu_the_state_starts_in_vram_and_the_switch_takes_it_over(monkeypatch):
    torch.use_deterministic_algorithms(True, warn_only=True)  # embedding backward: atomics
    try:
        data = batches(5, device=CUDA)
        ref = clone(make_model(0, n_blocks=2)).to(CUDA)
        train_torch(ref, torch.optim.AdamW(ref.parameters(), lr=LR, fused=True), data)
        model, opt, info = _gpu_run(data)
        plan = ramstream.memory_report(model)["plan"]["planner"]
        assert plan["mode"] == "resident"
        assert info["placements"] == {"device"} and info["host"] == 0  # nothing of the state on the host
        assert opt.resident and opt._moment_dtype == torch.float32
        # the switch took the state over: the resident moments are the buckets' own memory
        ptrs = {st["exp_avg"].untyped_storage().data_ptr() for st in opt._resident.state.values()}
        assert ptrs <= set(info["ptrs"])
        events = "\n".join(ramstream.memory_report(model)["events"])
        assert "the optimizer state starts in VRAM" in events and "switching to fused AdamW" in events
        assert (
            max(
                float((a.detach() - b.detach()).abs().max())
                for a, b in zip(ref.parameters(), model.parameters())
            )
            < 1e-5
        )
        # the same run with the state starting on the host (the switch copies it): the same weights
        host_model, host_opt, host_info = _gpu_run(data, host_start=True, monkeypatch=monkeypatch)
        assert host_info["placements"] != {"device"} and host_opt.resident
        assert (
            max(
                float((a.detach() - b.detach()).abs().max())
                for a, b in zip(host_model.parameters(), model.parameters())
            )
            < 1e-5
        )
        ramstream.unwrap(model)
        ramstream.unwrap(host_model)
    finally:
        torch.use_deterministic_algorithms(False)


@pytest.mark.cuda
def test_on_the_gpu_the_state_leaves_vram_bit_for_bit_when_a_re_plan_offloads_it():
    """The device and mapped placements run the same kernel: moving the state between them changes
    no bit of the trajectory (checked before the resident switch, which comes after step 2)."""
    torch.use_deterministic_algorithms(True, warn_only=True)
    try:
        data = batches(2, device=CUDA)
        stay, _, _ = _gpu_run(data)
        moved, opt, info = _gpu_run(data, move_after=1)
        assert info["placements"] == {"device"} and info["after_move"] == {"mapped"}
        assert info["moved"]["change"].startswith("optimizer state: device -> mapped")
        # the moments now in pinned host memory: 2 fp32 moments per trained element
        assert info["host_after_move"] == 8 * sum(b.numel for b in opt._engine.buckets)  # padded buckets
        assert all(torch.equal(a.detach(), b.detach()) for a, b in zip(stay.parameters(), moved.parameters()))
        ramstream.unwrap(stay)
        ramstream.unwrap(moved)
    finally:
        torch.use_deterministic_algorithms(False)
