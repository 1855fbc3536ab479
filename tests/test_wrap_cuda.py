"""wrap() on the CUDA engine: parity with torch, host residency of state, waits, state dicts."""

from __future__ import annotations

import pytest
import torch

import ramstream

from _models import batches, clone, make_model, max_diff, train_master_reference, train_torch

pytestmark = pytest.mark.cuda
DEV = "cuda"


def wrap(model, opt=None, **kw):
    """wrap() with offload=True: a small test model fits on the GPU, and offload="auto" would
    switch to the resident optimizer after two steps (tested on its own below)."""
    kw.setdefault("offload", True)
    return ramstream.wrap(model, opt, **kw)


def _pair(seed=0, **kw):
    ref = make_model(seed, **kw).to(DEV)
    return ref, clone(ref)


@pytest.mark.parametrize(
    "kw, torch_kw",
    [
        ({}, {}),
        (dict(max_grad_norm=0.05), dict(max_grad_norm=0.05)),
        (dict(accumulation_steps=3), dict(accumulation=3)),
        (dict(bucket_bytes=8192), {}),
    ],
)
def test_parity_with_torch(kw, torch_kw):
    ref, model = _pair(n_blocks=4)
    data = batches(24, device=DEV)
    train_torch(
        ref, torch.optim.AdamW(ref.parameters(), lr=3e-3, weight_decay=0.05, foreach=False), data, **torch_kw
    )
    model, opt = wrap(model, torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.05), **kw)
    assert opt._engine.dev.type == "cuda"
    train_torch(model, opt, data, accumulation=torch_kw.get("accumulation", 1))
    opt.synchronize()
    assert max_diff(ref, model) < 1e-5


@pytest.fixture
def deterministic():
    """Embedding backward on CUDA adds with atomics; parity at 1e-5 over 20 low-precision steps
    needs the same gradients in both runs."""
    torch.use_deterministic_algorithms(True, warn_only=True)
    yield
    torch.use_deterministic_algorithms(False)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_model_fp32_master(dtype, deterministic):
    ref, model = _pair(dtype=dtype)
    data = batches(20, device=DEV)
    masters_ref = train_master_reference(ref, data, lr=2e-3, weight_decay=0.01)
    model, opt = wrap(model, torch.optim.AdamW(model.parameters(), lr=2e-3, weight_decay=0.01))
    train_torch(model, opt, data)
    masters = opt.master_weights()
    pairs = zip(masters, masters_ref, strict=True)
    worst = max(float((a.detach() - b.detach().cpu()).abs().max()) for a, b in pairs)
    assert worst < 1e-5


def test_state_dict_round_trip_into_torch_adamw():
    ref, model = _pair()
    data = batches(10, device=DEV)
    ropt = torch.optim.AdamW(ref.parameters(), lr=2e-3, foreach=False)
    train_torch(ref, ropt, data[:5])
    model, opt = wrap(model, torch.optim.AdamW(model.parameters(), lr=2e-3))
    train_torch(model, opt, data[:5])
    plain = make_model(0).to(DEV)
    plain.load_state_dict(model.state_dict())
    topt = torch.optim.AdamW(plain.parameters(), lr=2e-3, foreach=False)
    topt.load_state_dict(opt.state_dict())
    train_torch(plain, topt, data[5:])
    train_torch(ref, ropt, data[5:])
    assert max_diff(ref, plain) < 1e-5


def test_gradients_and_state_live_in_host_ram():
    torch.manual_seed(0)
    d = 1024
    model = torch.nn.Sequential(*[torch.nn.Linear(d, d) for _ in range(16)]).to(DEV)
    weights = sum(p.numel() * 4 for p in model.parameters())
    x = torch.randn(64, d, device=DEV)
    model, opt = wrap(
        model, torch.optim.AdamW(model.parameters(), lr=1e-4), offload=True, bucket_bytes=8 << 20
    )
    for _ in range(3):
        model(x).square().mean().backward()
        opt.step()
    opt.synchronize()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    for _ in range(3):
        model(x).square().mean().backward()
        opt.step()
    opt.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    # stock AdamW adds 2 x weights of moments + 1 x weights of gradients (3 x 64 MiB); we hold
    # activations (64 x 1024 x 16 layers x 4 B, a few times) and gradients in flight to the host
    # (a few 4 MiB weights, and the small-parameter staging buffers)
    assert peak < 8 * 64 * d * 16 * 4 + 4 * (4 << 20), (peak, weights)
    for p in model.parameters():
        assert p.grad is None
    for b in opt._engine.buckets:  # host placement, or mapped (optimizer_mode="auto"'s split)
        assert b.exp_avg.device.type == "cpu" and b.placement in ("host", "mapped")
        assert b.landing.is_pinned() if b.placement == "host" else b.exp_avg.is_pinned()


def test_guard_waits_on_gpu():
    ref, model = _pair()
    data = batches(1, device=DEV)
    train_torch(ref, torch.optim.AdamW(ref.parameters(), lr=1e-2, foreach=False), data)
    model, opt = wrap(model, torch.optim.AdamW(model.parameters(), lr=1e-2))
    x, y = data[0]
    model(x, y).backward()
    opt.step()
    w = model.blocks[1].fc1.weight
    got = (w * 1.0).detach().cpu()  # waits for the update and its H2D copy
    assert torch.allclose(got, ref.blocks[1].fc1.weight.detach().cpu(), atol=1e-5, rtol=0)


def test_to_cpu_and_back_and_wrong_device_error():
    ref, model = _pair()
    data = batches(6, device=DEV)
    train_torch(ref, torch.optim.AdamW(ref.parameters(), lr=3e-3, foreach=False), data)
    model, opt = wrap(model, torch.optim.AdamW(model.parameters(), lr=3e-3))
    train_torch(model, opt, data[:3])
    model.to("cpu")
    x, y = data[3]
    with pytest.raises(RuntimeError, match="model.to"):
        model(x.cpu(), y.cpu()).backward()
    model.to(DEV)
    opt.zero_grad()
    train_torch(model, opt, data[3:])
    opt.synchronize()
    assert max_diff(ref, model) < 1e-5


@pytest.mark.parametrize("mode", ["gpu", "auto"])
@pytest.mark.parametrize(
    "kw, torch_kw",
    [
        ({}, {}),
        (dict(max_grad_norm=0.05), dict(max_grad_norm=0.05)),
        (dict(accumulation_steps=2), dict(accumulation=2)),
    ],
)
def test_gpu_and_auto_modes_match_torch(mode, kw, torch_kw):
    ref, model = _pair(n_blocks=4)
    data = batches(16, device=DEV)
    train_torch(
        ref, torch.optim.AdamW(ref.parameters(), lr=3e-3, weight_decay=0.05, foreach=False), data, **torch_kw
    )
    model, opt = wrap(
        model,
        torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.05),
        optimizer_mode=mode,
        bucket_bytes=8192,
        **kw,
    )
    if mode == "gpu":
        assert opt._engine.mapped_numel == sum(b.numel for b in opt._engine.buckets)
    train_torch(model, opt, data, accumulation=torch_kw.get("accumulation", 1))
    opt.synchronize()
    assert max_diff(ref, model) < 1e-5
    b = opt._engine.buckets[0]
    if b.placement == "mapped":
        assert b.exp_avg.is_pinned() and b.master is None  # fp32 weights are the master


def test_gpu_mode_low_precision_model_and_conversion(deterministic):
    ref, model = _pair(dtype=torch.bfloat16)
    data = batches(12, device=DEV)
    masters_ref = train_master_reference(ref, data, lr=2e-3, weight_decay=0.01)
    model, opt = wrap(
        model, torch.optim.AdamW(model.parameters(), lr=2e-3, weight_decay=0.01), optimizer_mode="gpu"
    )
    train_torch(model, opt, data)
    masters = opt.master_weights()
    assert max(float((a - b.cpu()).abs().max()) for a, b in zip(masters, masters_ref)) < 1e-5


def test_gpu_mode_fp32_master_survives_half_and_back():
    ref, model = _pair()
    data = batches(6, device=DEV)
    train_torch(ref, torch.optim.AdamW(ref.parameters(), lr=3e-3, foreach=False), data)
    model, opt = wrap(model, torch.optim.AdamW(model.parameters(), lr=3e-3), optimizer_mode="gpu")
    train_torch(model, opt, data[:3])
    before = [m.clone() for m in opt.master_weights()]
    model.half()
    model.float()
    for m, p in zip(before, model.parameters()):
        assert torch.equal(p.detach().cpu(), m.view_as(p))  # not rounded through fp16
    train_torch(model, opt, data[3:])
    opt.synchronize()
    assert max_diff(ref, model) < 1e-5


def test_resident_switch_on_gpu_is_exact_and_frees_nothing_it_needs():
    ref, model = _pair()
    data = batches(10, device=DEV)
    train_torch(ref, torch.optim.AdamW(ref.parameters(), lr=3e-3, foreach=False), data)
    model, opt = wrap(model, torch.optim.AdamW(model.parameters(), lr=3e-3), offload="auto")
    train_torch(model, opt, data)
    assert opt.resident
    assert any("switching" in e for e in ramstream.memory_report(model)["events"])
    assert max_diff(ref, model) < 1e-5
    assert all(p.grad is None for p in model.parameters())


def test_activation_paging_through_wrap_is_exact_and_auto_decides(deterministic):
    base = make_model(0, d=256, n_blocks=3).to(DEV)
    data = batches(5, b=8, t=256, device=DEV)
    runs = []
    for setting in (False, True, "auto"):
        m = clone(base)
        m, opt = wrap(
            m, torch.optim.AdamW(m.parameters(), lr=1e-3), activation_offload=setting, min_offload_bytes=0
        )
        runs.append((m, train_torch(m, opt, data)))
        opt.synchronize()
    (plain, l0), (paged, l1), (auto, _) = runs
    assert l0 == l1
    for a, b in zip(plain.parameters(), paged.parameters()):
        assert torch.equal(a, b)
    r = ramstream.memory_report(auto)
    assert any("activation_offload=auto: paging" in e for e in r["events"]), r["events"]


def test_weights_over_the_memory_cap_raise_memory_error_and_stay_on_the_cpu():
    """In a fresh process: what earlier tests leave in the caching allocator's fragments counts as
    allocatable (hardware.allocatable), so the cap below would not mean 64 MiB in this one."""
    import subprocess
    import sys

    code = "import test_wrap_cuda as t; t._weights_over_the_cap()"
    here = __import__("os").path.dirname(__file__)
    r = subprocess.run([sys.executable, "-c", code], cwd=here, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]


def _weights_over_the_cap():
    model = torch.nn.Sequential(torch.nn.Linear(4096, 4096), torch.nn.Linear(4096, 4096))  # 128 MiB
    dev = torch.device(DEV, torch.cuda.current_device())
    torch.cuda.empty_cache()  # the plan counts what the allocator caches as free: leave 64 MiB in all
    total = torch.cuda.get_device_properties(dev).total_memory
    used = torch.cuda.memory_reserved(dev)
    torch.cuda.set_per_process_memory_fraction((used + (64 << 20)) / total, dev)
    try:
        with pytest.raises(MemoryError, match="GiB on cuda") as e:
            ramstream.wrap(model, device=DEV, param_offload=False)
        assert "0.13" in str(e.value)  # the arithmetic: the two 64 MiB Linear weights (0.125 GiB)
        assert all(p.device.type == "cpu" for p in model.parameters())
        assert getattr(model, "_ramstream", None) is None
        # the default (param_offload="auto") would stream the two Linear "blocks", but both are on
        # the device at once (the one running and the next): the plan refuses with that arithmetic
        with pytest.raises(MemoryError, match="stream_window 0.13"):
            ramstream.wrap(model, device=DEV)
        assert all(p.device.type == "cpu" for p in model.parameters())
        # with room for the two blocks' window the default streams them and trains
        # room for the window (both 64 MiB blocks loaded in backward), a weight's gradient and the
        # next one's while the first goes to the host: 384 MiB (200 failed in a fresh process)
        torch.cuda.set_per_process_memory_fraction((used + (384 << 20)) / total, dev)
        wrapped, opt = ramstream.wrap(model, device=DEV, param_offload=[0, 1])
        assert ramstream.memory_report(wrapped)["params"]["streamed_blocks"] == [0, 1]
        wrapped(torch.randn(8, 4096, device=DEV)).square().mean().backward()
        opt.step()
        opt.synchronize()
        ramstream.unwrap(wrapped)
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0, dev)


@pytest.mark.cuda
def test_a_build_without_cuda_kernels_updates_on_the_host_for_auto_and_refuses_gpu(monkeypatch):
    """optimizer_mode='auto' on a build whose CUDA kernels cannot run: the host updates every
    parameter and the log says why; 'gpu' raises naming the problem (issue 9)."""
    from ramstream import hardware

    monkeypatch.setattr(hardware, "kernels_problem", lambda: "this build of ramstream has no CUDA kernels")
    m = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 64)).to(DEV)
    opt = ramstream.OffloadAdamW(m.parameters(), mode="auto")
    assert opt._engine.mapped_numel == 0 and "no CUDA kernels" in opt.split_info["reason"]
    opt.close()
    with pytest.raises(RuntimeError, match="mode='gpu' needs ramstream's CUDA kernels"):
        ramstream.OffloadAdamW(m.parameters(), mode="gpu")
