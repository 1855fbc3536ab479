"""wrap() on the CPU engine equals torch.optim.AdamW(foreach=False) on the same model and data."""

from __future__ import annotations

import pytest
import torch

import ramstream

from _models import batches, clone, make_model, max_diff, train_master_reference, train_torch

TOL = 1e-5


def _pair(seed=0, **kw):
    ref = make_model(seed, **kw)
    return ref, clone(ref)


def test_plain_20_steps_match_torch():
    ref, model = _pair()
    data = batches(20)
    train_torch(ref, torch.optim.AdamW(ref.parameters(), lr=3e-3, weight_decay=0.05, foreach=False), data)
    model, opt = ramstream.wrap(
        model, torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.05), device="cpu"
    )
    assert isinstance(opt, ramstream.OffloadAdamW)
    train_torch(model, opt, data)
    opt.synchronize()
    assert max_diff(ref, model) < TOL


def test_small_buckets_many_jobs_match_torch():
    ref, model = _pair(n_blocks=4)
    data = batches(12)
    train_torch(ref, torch.optim.AdamW(ref.parameters(), lr=1e-3, foreach=False), data)
    model, opt = ramstream.wrap(model, torch.optim.AdamW(model.parameters(), lr=1e-3), bucket_bytes=1 << 14)
    assert len(opt._engine.buckets) > 3
    train_torch(model, opt, data)
    opt.synchronize()
    assert max_diff(ref, model) < TOL


@pytest.mark.parametrize("max_norm", [0.05, 1e3])
def test_clipping_matches_clip_grad_norm(max_norm):
    ref, model = _pair()
    data = batches(20)
    train_torch(
        ref, torch.optim.AdamW(ref.parameters(), lr=3e-3, foreach=False), data, max_grad_norm=max_norm
    )
    model, opt = ramstream.wrap(model, torch.optim.AdamW(model.parameters(), lr=3e-3), max_grad_norm=max_norm)
    train_torch(model, opt, data)
    opt.synchronize()
    assert max_diff(ref, model) < TOL


def test_accumulation_sums_micro_batches():
    ref, model = _pair()
    data = batches(30)
    train_torch(ref, torch.optim.AdamW(ref.parameters(), lr=3e-3, foreach=False), data, accumulation=3)
    model, opt = ramstream.wrap(model, torch.optim.AdamW(model.parameters(), lr=3e-3), accumulation_steps=3)
    train_torch(model, opt, data, accumulation=3)
    opt.synchronize()
    assert max_diff(ref, model) < TOL


def test_accumulation_with_clipping():
    ref, model = _pair()
    data = batches(20)
    train_torch(
        ref,
        torch.optim.AdamW(ref.parameters(), lr=3e-3, foreach=False),
        data,
        accumulation=2,
        max_grad_norm=0.1,
    )
    model, opt = ramstream.wrap(
        model, torch.optim.AdamW(model.parameters(), lr=3e-3), accumulation_steps=2, max_grad_norm=0.1
    )
    train_torch(model, opt, data, accumulation=2)
    opt.synchronize()
    assert max_diff(ref, model) < TOL


def _groups(model):
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    return [
        {"params": decay, "weight_decay": 0.1, "lr": 2e-3},
        {"params": no_decay, "weight_decay": 0.0, "lr": 5e-3, "betas": (0.8, 0.99)},
    ]


def test_param_groups_and_lr_scheduler():
    ref, model = _pair()
    data = batches(20)
    ropt = torch.optim.AdamW(_groups(ref), foreach=False)
    rs = torch.optim.lr_scheduler.OneCycleLR(ropt, max_lr=[4e-3, 8e-3], total_steps=20)
    train_torch(ref, ropt, data, scheduler=rs)
    model, opt = ramstream.wrap(model, torch.optim.AdamW(_groups(model)))
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=[4e-3, 8e-3], total_steps=20)
    train_torch(model, opt, data, scheduler=sched)
    opt.synchronize()
    assert max_diff(ref, model) < TOL
    assert opt.param_groups[1]["lr"] == pytest.approx(ropt.param_groups[1]["lr"])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_model_keeps_fp32_master(dtype):
    ref, model = _pair(dtype=dtype)
    data = batches(20)
    masters_ref = train_master_reference(ref, data, lr=2e-3, weight_decay=0.01)
    model, opt = ramstream.wrap(model, torch.optim.AdamW(model.parameters(), lr=2e-3, weight_decay=0.01))
    train_torch(model, opt, data)
    masters = opt.master_weights()
    assert max(float((a - b).abs().max()) for a, b in zip(masters, masters_ref)) < TOL
    for m, p in zip(masters, model.parameters()):
        assert p.dtype == dtype
        assert torch.equal(p.detach(), m.to(dtype).view_as(p))


def test_bf16_moments_track_fp32():
    data = batches(40)
    losses = {}
    for md in ("float32", "bfloat16"):
        model = make_model(0)
        model, opt = ramstream.wrap(model, torch.optim.AdamW(model.parameters(), lr=3e-3), moment_dtype=md)
        losses[md] = train_torch(model, opt, data)
        assert ramstream.memory_report(model)["optimizer"]["moment_dtype"] == md
    a, b = sum(losses["float32"][-10:]), sum(losses["bfloat16"][-10:])
    assert abs(a - b) / a < 0.05


def test_unused_parameter_does_not_hang_and_is_not_updated():
    ref, model = _pair()
    extra_ref = torch.nn.Parameter(torch.randn(5))
    extra = torch.nn.Parameter(extra_ref.detach().clone())
    data = batches(6)
    train_torch(ref, torch.optim.AdamW(list(ref.parameters()) + [extra_ref], lr=1e-3, foreach=False), data)
    model, opt = ramstream.wrap(model, torch.optim.AdamW(list(model.parameters()) + [extra], lr=1e-3))
    train_torch(model, opt, data)
    opt.synchronize()
    assert max_diff(ref, model) < TOL
    assert torch.equal(extra.detach(), extra_ref.detach())
    state = opt.state_dict()["state"]
    assert len(list(model.parameters())) not in state  # torch creates no state without a grad
    assert len(state) == len(list(model.parameters()))


def test_frozen_parameters_are_left_alone():
    ref, model = _pair()
    for m in (ref, model):
        m.blocks[0].fc1.weight.requires_grad_(False)
    data = batches(8)
    train_torch(
        ref, torch.optim.AdamW([p for p in ref.parameters() if p.requires_grad], lr=1e-3, foreach=False), data
    )
    model, opt = ramstream.wrap(model)  # optimizer=None: trainable parameters, lr option
    train_torch(model, opt, data)
    opt.synchronize()
    assert max_diff(ref, model) < TOL


def test_engine_is_bit_identical_to_torch_fused_cpu_adamw():
    """One host AdamW call per parameter: each tensor's update is torch's fused CPU kernel's."""
    ref, model = _pair(n_blocks=2)
    data = batches(10)
    train_torch(ref, torch.optim.AdamW(ref.parameters(), lr=3e-3, weight_decay=0.05, fused=True), data)
    model, opt = ramstream.wrap(
        model, torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.05), bucket_bytes=1 << 14
    )
    train_torch(model, opt, data)
    opt.synchronize()
    for a, b in zip(ref.parameters(), model.parameters()):
        assert torch.equal(a.detach(), b.detach())


def test_split_planner_balances_host_and_pcie():
    from ramstream.planner.inflight import choose_mapped_fraction

    n = 1_000_000_000
    f, info = choose_mapped_fraction(
        numel=n,
        host_params_per_s=4e9,
        pcie_bytes_per_s=40e9,
        working_bytes=4,
        moment_bytes=4,
        master_on_host=False,
    )
    host = (1 - f) * n / 4e9
    pcie = n * (f * 8 + (1 - f) * 4) / 40e9
    assert 0 < f < 1 and abs(host - pcie) < 1e-9
    assert info["t_estimate_s"] == pytest.approx(host)
    # a slow link: everything stays on the host; a slow host: everything goes to the GPU
    f0, _ = choose_mapped_fraction(
        numel=n,
        host_params_per_s=4e9,
        pcie_bytes_per_s=1e9,
        working_bytes=4,
        moment_bytes=4,
        master_on_host=False,
    )
    f1, _ = choose_mapped_fraction(
        numel=n,
        host_params_per_s=1e6,
        pcie_bytes_per_s=40e9,
        working_bytes=4,
        moment_bytes=4,
        master_on_host=False,
    )
    assert f0 == 0.0 and f1 > 0.999


def test_gpu_mode_needs_cuda_and_auto_falls_back_to_cpu():
    model = make_model(0)
    with pytest.raises(ValueError, match="CUDA"):
        ramstream.wrap(model, optimizer_mode="gpu")
    model, opt = ramstream.wrap(make_model(0), optimizer_mode="auto")
    assert opt._engine.mapped_numel == 0


def test_bucket_layout_large_first_small_tail_aligned():
    from ramstream.engine.buckets import ALIGN_BYTES, Slot, build_buckets

    sizes = [(32, 300_000, 32, 32, 1000), (32, 32, 1000)]  # with and without a large slot
    buckets = []
    for case in sizes:
        params = [torch.nn.Parameter(torch.zeros(n)) for n in case]
        slots = [Slot(param=p, index=i, group=0, numel=p.numel()) for i, p in enumerate(params)]
        buckets += build_buckets(slots, 8 << 20, 4)
    assert any(not any(s.direct for s in b.slots) for b in buckets)
    for b in buckets:
        small = [s for s in b.slots if not s.direct]
        assert all(s.offset >= b.small_lo for s in small)
        assert all(s.offset + s.numel <= b.small_lo for s in b.slots if s.direct)
        assert all(s.offset * 4 % ALIGN_BYTES == 0 for s in b.slots)
        assert all(s.offset + s.numel <= b.numel for s in b.slots)
        if small and not any(s.direct for s in b.slots):
            assert b.small_lo == 0
