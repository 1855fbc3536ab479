"""Out of memory anywhere in a step (README "Out of memory in a step"): on the CPU engine an
injected torch.OutOfMemoryError at each fault point (ramstream._faults); on the GPU a real one
under a per-process memory cap. Weights and optimizer state must be bit-equal to before the step,
the step's host and device buffers released, and the next (smaller) step must train as torch."""

from __future__ import annotations

import gc

import pytest
import torch

import ramstream
import ramstream.runtime.measure as measure_mod
from ramstream import _faults

from _models import batches, clone, make_model, max_diff, train_torch

LR = 3e-3


def _wrap(device="cpu", **options):
    base = make_model(0, n_blocks=3)
    model = clone(base).to(device)
    options.setdefault("activation_offload", True)
    model, opt = ramstream.wrap(
        model,
        torch.optim.AdamW(model.parameters(), lr=LR),
        device=device,
        bucket_bytes=1 << 14,
        min_offload_bytes=0,
        **options,
    )
    return base, model, opt


def _snapshot(model, opt):
    opt.synchronize()
    sd = opt.state_dict()["state"]
    return (
        [m.clone() for m in opt.master_weights()],
        [p.detach().clone() for p in model.parameters()],
        {k: (v["exp_avg"].clone(), v["exp_avg_sq"].clone(), float(v["step"])) for k, v in sd.items()},
    )


def _same(a, b) -> bool:
    if a[2].keys() != b[2].keys():
        return False
    return (
        all(torch.equal(x, y) for x, y in zip(a[0], b[0]))
        and all(torch.equal(x, y) for x, y in zip(a[1], b[1]))
        and all(
            torch.equal(x[0], y[0]) and torch.equal(x[1], y[1]) and x[2] == y[2]
            for x, y in ((a[2][k], b[2][k]) for k in a[2])
        )
    )


def _held(model) -> dict:
    """Host bytes the step holds: the pinned arena's blocks in use and the activation pool's
    buffers handed out (the CPU engine's pool uses plain host memory)."""
    gc.collect()
    w = model._ramstream
    pool = w.activations.off.stats() if w.activations is not None else {}
    out = {
        "arena_in_use": ramstream.memory_stats()["bytes_in_use"],
        "pool_in_use": pool.get("host_bytes_in_use", 0),
        # what the pool keeps cached: a failed step gives its buffers back at zero_grad()
        "pool_held": pool.get("host_bytes_held", 0),
    }
    dev = w.optimizer._engine.device
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
        out["cuda_allocated"] = torch.cuda.memory_allocated(dev)
    return out


def _released(after: dict, before: dict) -> bool:
    """Nothing the failed step took is still held: every count at most its value before the step
    (the pool may hold less: a failed step's give-back trims it to the steps' needs)."""
    assert after.keys() == before.keys()
    return all(after[k] <= before[k] for k in after)


def _step(model, opt, batch, k=1):
    for x, y in [batch] * k:
        model(x, y).backward()
    opt.step()
    opt.zero_grad()


def _fails(model, opt, batch, k=1) -> None:
    """A step that runs out of memory somewhere; the user drops it (zero_grad) and goes on, as
    HF Trainer's and Accelerate's find_executable_batch_size do. The exception and its frames
    (which hold the step's tensors) are gone when this returns."""
    raised = False
    try:
        _step(model, opt, batch, k)
    except torch.OutOfMemoryError:
        raised = True
    assert raised, "the step did not run out of memory"
    opt.zero_grad()


# point -> (options, calls that pass first): updates that run during backward (eager, no
# clipping) cannot be undone, so a failure at or after backward uses updates that wait for step()
CASES = {
    "forward.pre_hook": [({}, 4), (dict(max_grad_norm=1.0), 0)],
    "activations.pack": [({}, 5)],
    "activations.buffer": [({}, 2)],
    "backward.grad_hook": [(dict(max_grad_norm=1.0), 6), (dict(eager_updates=False), 3)],
    "backward.landing": [(dict(max_grad_norm=1.0), 6), (dict(eager_updates=False, accumulation_steps=2), 20)],
    "activations.unpack": [(dict(max_grad_norm=1.0), 4), (dict(eager_updates=False), 10)],
    "step.begin": [(dict(max_grad_norm=1.0), 0), (dict(eager_updates=False), 0)],
    "step.updates": [
        (dict(max_grad_norm=1.0), 0),
        (dict(eager_updates=False, accumulation_steps=2, moment_dtype="bf16"), 0),
    ],
}
PARAMS = [
    pytest.param(point, opts, skip, id=f"{point}-{i}")
    for point, cases in CASES.items()
    for i, (opts, skip) in enumerate(cases)
]


@pytest.mark.parametrize("point, options, skip", PARAMS)
def test_oom_at_each_point_leaves_the_step_undone(point, options, skip):
    k = options.get("accumulation_steps", 1)
    small, big = batches(3, b=2), batches(1, b=8, seed=7)[0]
    base, model, opt = _wrap(**options)
    _step(model, opt, small[0], k)  # warm: pool buffers and state exist
    before, held = _snapshot(model, opt), _held(model)
    with _faults.inject(point, skip=skip) as info:
        _fails(model, opt, big, k)
    assert info["fired"] == 1
    assert _same(before, _snapshot(model, opt)), f"{point}: weights or state changed"
    assert _released(_held(model), held)
    for b in small[1:]:
        _step(model, opt, b, k)
    opt.synchronize()
    # the same run without the failed step, and torch's loop
    _, ref_model, ref_opt = _wrap(**options)
    for b in small:
        _step(ref_model, ref_opt, b, k)
    assert _same(_snapshot(ref_model, ref_opt), _snapshot(model, opt))
    ref = clone(base)
    data = [b for b in small for _ in range(k)]
    train_torch(
        ref,
        torch.optim.AdamW(ref.parameters(), lr=LR, foreach=False),
        data,
        accumulation=k,
        max_grad_norm=options.get("max_grad_norm"),
    )
    assert max_diff(ref, model) < (1e-2 if options.get("moment_dtype") else 1e-6)


def test_every_point_is_covered_and_unarmed_points_are_free():
    covered = set(CASES) | {"resident.switch", "resident.step"}
    assert covered == set(_faults.POINTS)
    assert not _faults._armed
    with pytest.raises(ValueError, match="name="):
        with _faults.inject("nowhere"):
            pass


@pytest.fixture
def roomy(monkeypatch):
    monkeypatch.setattr(measure_mod, "device_memory", lambda d: {"usable": 1 << 40, "peak": 0, "now": 0})


def test_oom_in_the_resident_switch_keeps_offloading(roomy):
    """The switch runs after step 2's updates were queued: the step is done, so an OOM while
    building the device state is not raised; the optimizer keeps offloading."""
    data = batches(4, b=2)
    base, model, opt = _wrap(offload="auto")
    with _faults.inject("resident.switch", skip=3) as info:
        _step(model, opt, data[0])
        held = _held(model)
        with pytest.warns(RuntimeWarning, match="ran out of memory building the resident"):
            _step(model, opt, data[1])
    assert info["fired"] == 1 and not opt.resident
    assert _released(_held(model), held)
    for b in data[2:]:
        _step(model, opt, b)
    opt.synchronize()
    ref = clone(base)
    train_torch(ref, torch.optim.AdamW(ref.parameters(), lr=LR, foreach=False), data)
    assert max_diff(ref, model) < 1e-6
    assert "keeps offloading" in "\n".join(ramstream.memory_report(model)["events"])


@pytest.mark.parametrize("options", [{}, dict(max_grad_norm=1.0)], ids=["plain", "clip"])
def test_oom_in_a_resident_step(roomy, options):
    data = batches(5, b=2)
    base, model, opt = _wrap(offload="auto", **options)
    for b in data[:2]:
        _step(model, opt, b)
    assert opt.resident
    before, held = _snapshot(model, opt), _held(model)
    with _faults.inject("resident.step") as info:
        _fails(model, opt, batches(1, b=8, seed=7)[0])
    assert info["fired"] == 1
    assert _same(before, _snapshot(model, opt)) and _held(model) == held
    for b in data[2:]:
        _step(model, opt, b)
    ref = clone(base)
    train_torch(
        ref,
        torch.optim.AdamW(ref.parameters(), lr=LR, foreach=False),
        data,
        max_grad_norm=options.get("max_grad_norm"),
    )
    assert max_diff(ref, model) < 1e-6


def test_buffers_grown_for_a_large_step_are_given_back():
    """The engine's staging buffers live for one flush; the activation pool drops free buffers
    after two passes unused: two steps after a large batch, host memory is back to the small
    batches' level."""
    small, big = batches(6, b=2), batches(1, b=16, seed=7)[0]
    _, model, opt = _wrap(max_grad_norm=1.0)
    pool = model._ramstream.activations.off
    for b in small[:2]:
        _step(model, opt, b)
    steady = pool.stats()["host_bytes_held"]
    _step(model, opt, big)
    assert pool.stats()["host_bytes_held"] > steady
    for b in small[2:]:
        _step(model, opt, b)
    assert pool.stats()["host_bytes_held"] <= steady
    assert all(b.staging is None for b in opt._engine.buckets)


# ---- the GPU: a real out of memory under a per-process cap ------------------------------------
def _gpu_model():
    torch.manual_seed(0)
    from _models import TinyGPT

    return TinyGPT(vocab=512, d=256, n_blocks=4)


@pytest.mark.cuda
@pytest.mark.parametrize(
    "options",
    [
        dict(max_grad_norm=1.0, activation_offload=True),
        dict(eager_updates=False),
        dict(max_grad_norm=1.0, optimizer_mode="gpu"),
    ],
    ids=["clip+paging", "deferred", "mapped"],
)
def test_real_oom_on_the_gpu(options):
    torch.use_deterministic_algorithms(True, warn_only=True)  # embedding backward: atomics
    dev = torch.device("cuda", torch.cuda.current_device())  # the memory cap needs an index
    torch.cuda.empty_cache()
    base = _gpu_model()
    options = dict(options, offload=True, min_offload_bytes=0)
    model, opt = ramstream.wrap(clone(base).to(dev), lr=LR, device=dev, **options)
    g = torch.Generator().manual_seed(3)

    def batch(b, t=256):
        return (
            torch.randint(0, 512, (b, t), generator=g).to(dev),
            torch.randint(0, 512, (b, t), generator=g).to(dev),
        )

    small = [batch(2) for _ in range(3)]
    _step(model, opt, small[0])
    torch.cuda.synchronize()
    free_cap = (torch.cuda.memory_reserved() + (256 << 20)) / torch.cuda.get_device_properties(
        dev
    ).total_memory
    torch.cuda.set_per_process_memory_fraction(free_cap, dev)
    try:
        before, held = _snapshot(model, opt), _held(model)
        _fails(model, opt, batch(512))  # activations of 512 x 256 tokens: OOM
        assert _same(before, _snapshot(model, opt))
        assert _released(_held(model), held)
        for b in small[1:]:
            _step(model, opt, b)
        opt.synchronize()
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0, dev)
        torch.use_deterministic_algorithms(False)
    ref_model, ref_opt = ramstream.wrap(clone(base).to(dev), lr=LR, device=dev, **options)
    for b in small:
        _step(ref_model, ref_opt, b)
    ref_opt.synchronize()
    assert max_diff(ref_model, model) < 1e-6  # the same run without the failed step
