"""The VRAM share of the optimizer state (runtime/optimizer_split.py maybe_share deciding through planner/inflight.py, layout.relocate): the placement
arithmetic on the CPU; on the GPU, moving buckets between host, mapped and device memory
mid-training keeps the run exact (bit for bit between mapped and device: the same kernel)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

import ramstream
from ramstream.engine import layout
from ramstream.planner import inflight
from ramstream.runtime import measure
from ramstream.runtime.measure import bucket_facts


def device_bytes(b) -> int:
    return bucket_facts([b])[0].device_bytes


def choose_placements(buckets, room, mapped_fraction_of):
    return inflight.choose_placements(bucket_facts(buckets), room, mapped_fraction_of)


from _models import batches, clone, make_model, max_diff, train_torch


def _buckets(numels, dtype=torch.float32, moment=torch.float32, streamed=()):
    return [
        SimpleNamespace(
            index=i,
            numel=n,
            dtype=dtype,
            exp_avg=torch.empty(0, dtype=moment),
            streamed=i in streamed,
            placement="host",
        )
        for i, n in enumerate(numels)
    ]


def test_device_bytes_counts_moments_and_a_low_precision_master():
    (b32,) = _buckets([1000])
    (b16,) = _buckets([1000], dtype=torch.bfloat16, moment=torch.bfloat16)
    assert device_bytes(b32) == 1000 * 8  # two fp32 moments; fp32 weights are their own master
    assert device_bytes(b16) == 1000 * (2 + 2 + 4)  # two bf16 moments + the fp32 master


def test_first_buckets_that_fit_go_to_the_device_the_rest_split_by_the_fraction():
    bs = _buckets([100, 100, 100, 100, 100, 100])
    seen = []

    def frac(n):
        seen.append(n)
        return 0.5

    out, info = choose_placements(bs, room=2 * 800 + 799, mapped_fraction_of=frac)
    assert out == ["device", "device", "mapped", "mapped", "host", "host"]
    assert seen == [400]  # the fraction is of what is left after the device share
    assert info["device_numel"] == 200 and info["device_bytes"] == 1600
    assert info["mapped_numel"] == 200 and info["host_numel"] == 200


def test_streamed_buckets_keep_their_placement_and_no_room_means_no_device_share():
    bs = _buckets([100, 100, 100], streamed={0})
    out, info = choose_placements(bs, room=10**9, mapped_fraction_of=lambda n: 0.0)
    assert out == ["host", "device", "device"] and info["device_numel"] == 200
    out, info = choose_placements(bs, room=0, mapped_fraction_of=lambda n: 0.0)
    assert out == ["host", "host", "host"] and info["device_numel"] == 0


def test_relocate_refuses_gpu_placements_on_the_cpu_engine_and_bad_names():
    model = make_model(0)
    model, opt = ramstream.wrap(model, torch.optim.AdamW(model.parameters(), lr=1e-3), device="cpu")
    b = opt._engine.buckets[0]
    with pytest.raises(ValueError, match="needs a CUDA device"):
        layout.relocate(opt._engine, b, "device")
    with pytest.raises(ValueError, match="accepted: 'host', 'mapped', 'device'"):
        layout.relocate(opt._engine, b, "vram")
    assert b.placement == "host"
    ramstream.unwrap(model)


# ---- GPU ---------------------------------------------------------------------------------------
DEV = "cuda"


def _run(model, data, *, mode, moved_to=None, after=2, **kw):
    """Trains with offload=True; after `after` steps relocates every bucket to `moved_to`."""
    model, opt = ramstream.wrap(
        model,
        torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.05),
        optimizer_mode=mode,
        offload=True,
        bucket_bytes=8192,
        **kw,
    )
    train_torch(model, opt, data[:after])
    if moved_to is not None:
        opt.synchronize()
        for b in opt._engine.buckets:
            layout.relocate(opt._engine, b, moved_to)
        assert {b.placement for b in opt._engine.buckets} == {moved_to}
    train_torch(model, opt, data[after:])
    opt.synchronize()
    return model, opt


@pytest.mark.cuda
@pytest.mark.parametrize(
    "dtype, moments", [(torch.float32, "float32"), (torch.bfloat16, "float32"), (torch.float32, "bfloat16")]
)
def test_mapped_to_device_and_back_is_bit_exact(dtype, moments):
    base = make_model(0, dtype=dtype, n_blocks=3).to(DEV)
    data = batches(8, device=DEV)
    ref, _ = _run(clone(base), data, mode="gpu", moment_dtype=moments)
    dev, opt = _run(clone(base), data[:5], mode="gpu", moved_to="device", moment_dtype=moments)
    assert opt._engine.buckets[0].exp_avg.is_cuda
    for b in opt._engine.buckets:  # and back to pinned host memory for the last steps
        layout.relocate(opt._engine, b, "mapped")
    train_torch(dev, opt, data[5:])
    opt.synchronize()
    for a, b in zip(ref.parameters(), dev.parameters()):
        assert torch.equal(a, b)


@pytest.mark.cuda
@pytest.mark.parametrize("accumulation", [1, 2])
def test_host_to_device_matches_torch(accumulation):
    ref = make_model(0, n_blocks=3).to(DEV)
    model = clone(ref)
    data = batches(12, device=DEV)
    train_torch(
        ref,
        torch.optim.AdamW(ref.parameters(), lr=3e-3, weight_decay=0.05, foreach=False),
        data,
        accumulation=accumulation,
    )
    model, opt = ramstream.wrap(
        model,
        torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.05),
        optimizer_mode="cpu",
        offload=True,
        bucket_bytes=8192,
        accumulation_steps=accumulation,
    )
    train_torch(model, opt, data[: 2 * accumulation], accumulation=accumulation)
    opt.synchronize()
    for i, b in enumerate(opt._engine.buckets):
        layout.relocate(opt._engine, b, "device" if i % 2 == 0 else "mapped")
    train_torch(model, opt, data[2 * accumulation :], accumulation=accumulation)
    opt.synchronize()
    assert max_diff(ref, model) < 1e-5


@pytest.mark.cuda
def test_auto_keeps_the_share_that_fits_in_vram_and_stays_exact(monkeypatch):
    """The state starting on the host (a plan that is not resident; this small model's plan is, so
    the start is patched): the share that fits the VRAM left moves there after step 2."""
    import importlib

    wrap_mod = importlib.import_module("ramstream.wrap")
    monkeypatch.setattr(wrap_mod, "state_starts_on_device", lambda *a: (False, "test: the host start"))
    ref = make_model(0, n_blocks=4).to(DEV)
    model = clone(ref)
    data = batches(8, device=DEV)
    train_torch(ref, torch.optim.AdamW(ref.parameters(), lr=3e-3, foreach=False), data)
    model, opt = ramstream.wrap(
        model, torch.optim.AdamW(model.parameters(), lr=3e-3), offload="auto", bucket_bytes=8192
    )
    state = sum(device_bytes(b) for b in opt._engine.buckets)
    real = measure.device_memory

    def fake(device):  # a cap that leaves room for about half of the state, not for all of it
        m = real(device)
        m["usable"] = int((m["peak"] + state // 2) / (1 - opt.vram_headroom))
        return m

    monkeypatch.setattr(measure, "device_memory", fake)
    monkeypatch.setattr(inflight, "MARGIN_BYTES", 0)  # (512 MiB: more than this model's state)
    train_torch(model, opt, data)
    opt.synchronize()
    assert not opt.resident
    placements = [b.placement for b in opt._engine.buckets]
    n_dev = placements.count("device")
    assert 0 < n_dev < len(placements) and placements[:n_dev] == ["device"] * n_dev
    moved = sum(device_bytes(b) for b in opt._engine.buckets if b.placement == "device")
    assert moved <= state // 2 + 1
    plan = ramstream.memory_report(model)["plan"]
    assert plan["optimizer"]["buckets"]["device"] == n_dev
    assert any(h.get("change") == "optimizer state share" for h in plan["history"])
    assert max_diff(ref, model) < 1e-5


def test_low_precision_accumulation_stays_on_the_host(monkeypatch):
    """The GPU update reads the gradient autograd summed in .grad, in bf16 for a bf16 model:
    with accumulation, "auto" keeps such a model on the host (fp32 sums) and shares no VRAM."""
    import ramstream.hardware as hardware
    from ramstream.runtime.optimizer_split import mapped_fraction_for

    monkeypatch.setattr(hardware, "kernels_problem", lambda: None)
    logs = []
    opt = SimpleNamespace(
        _distributed=False,
        param_groups=[{"params": [torch.nn.Parameter(torch.zeros(4, dtype=torch.bfloat16))]}],
        _accumulation_steps=2,
        _log=logs.append,
        split_info={},
        _moment_dtype=torch.float32,
    )
    assert mapped_fraction_for(opt, "auto", torch.device("cuda", 0)) == 0.0
    assert opt.split_info["reason"] == "low-precision gradients accumulated" and "fp32" in logs[-1]
    assert mapped_fraction_for(opt, "gpu", torch.device("cuda", 0)) == 1.0  # asked for: as asked


@pytest.mark.cuda
def test_mapped_to_host_and_back_keeps_the_pinned_state_in_place():
    """A mapped bucket moved to the host keeps its pinned master and moments (the host AdamW reads
    them where they are: a copy would leave the arena's blocks resident beside it, the R5 row's
    host out-of-memory) and gets them back as they are when it moves to mapped again; the run
    equals torch's AdamW."""
    base = make_model(0, dtype=torch.bfloat16, n_blocks=3).to(DEV)
    data = batches(8, device=DEV)
    ref, _ = _run(clone(base), data, mode="gpu")
    model, opt = _run(clone(base), data[:3], mode="gpu")
    e = opt._engine
    ptrs = [(b.master.data_ptr(), b.exp_avg.data_ptr(), b.exp_avg_sq.data_ptr()) for b in e.buckets]
    in_use = ramstream.memory_stats()["bytes_in_use"]
    for b in e.buckets:
        layout.relocate(e, b, "host")
    assert [(b.master.data_ptr(), b.exp_avg.data_ptr(), b.exp_avg_sq.data_ptr()) for b in e.buckets] == ptrs
    landing = sum(b.landing.nbytes for b in e.buckets)
    assert ramstream.memory_stats()["bytes_in_use"] - in_use <= 2 * landing  # the landings, size-classed
    train_torch(model, opt, data[3:5])
    opt.synchronize()
    for b in e.buckets:
        layout.relocate(e, b, "mapped")
    assert [(b.master.data_ptr(), b.exp_avg.data_ptr(), b.exp_avg_sq.data_ptr()) for b in e.buckets] == ptrs
    train_torch(model, opt, data[5:])
    opt.synchronize()
    assert max_diff(ref, model) < 1e-2  # bf16 weights: host and GPU AdamW round alike to ~1 ulp
