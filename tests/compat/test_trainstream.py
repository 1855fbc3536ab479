"""TrainStream 0.4.1 scripts, written as its README and docstrings show them, with ramstream
imported under its name (`import ramstream as trainstream`); the numbers are checked against
torch (docs/compat.md lists every difference that remains)."""

from __future__ import annotations

import pytest
import torch

import ramstream as trainstream
from ramstream import OffloadAdamW

from _models import batches, clone, make_model, max_diff, train_torch

HP = dict(lr=2e-3, betas=(0.9, 0.95), weight_decay=0.05)


def _torch_reference(ref, data, *, per_step=1, max_grad_norm=None, sched=None):
    opt = torch.optim.AdamW(ref.parameters(), foreach=False, **HP)
    lr = torch.optim.lr_scheduler.LambdaLR(opt, sched) if sched else None
    return train_torch(ref, opt, data, accumulation=per_step, max_grad_norm=max_grad_norm, scheduler=lr)


# ---- OffloadAdamW(...).attach(model): the chaining idiom --------------------------------------------
def _chained(device: str) -> None:
    ref = make_model(0).to(device)
    model = clone(ref)
    data = batches(6, device=device)
    want = _torch_reference(ref, data, sched=lambda s: 0.5**s)
    opt = OffloadAdamW(model.parameters(), **HP).attach(model)
    assert isinstance(opt, OffloadAdamW) and opt.attached
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 0.5**s)  # refuses anything but an optimizer
    try:
        got = train_torch(model, opt, data, scheduler=sched)
        opt.synchronize()
        assert got == pytest.approx(want, abs=1e-5)
        assert max_diff(ref, model) < 1e-5
        assert opt.param_groups[0]["lr"] == pytest.approx(HP["lr"] * 0.5**6)
    finally:
        trainstream.unwrap(model)


def test_attach_returns_the_optimizer_and_trains_like_torch():
    _chained("cpu")


@pytest.mark.cuda
def test_attach_returns_the_optimizer_and_trains_like_torch_cuda():
    _chained("cuda")


# ---- max_grad_norm: a backward pass more than accumulation_steps is summed ----------------------------
@pytest.mark.parametrize(
    "kw, eager, max_norm",
    [
        ({"eager": False}, False, None),
        ({"eager": True}, True, None),
        ({"compute_grad_norm": True, "chunk_elems": 1 << 16, "pin_moments": True}, True, float("inf")),
    ],
)
def test_trainstream_constructor_arguments_train_like_torch(kw, eager, max_norm):
    """OffloadAdamW(eager=, compute_grad_norm=, chunk_elems=, pin_moments=) and attach(guard=False),
    TrainStream's spellings: eager is eager_updates, compute_grad_norm takes the norm without
    clipping (last_grad_norm set), the other two are accepted with no effect."""
    ref = make_model(0)
    model = clone(ref)
    data = batches(5)
    want = _torch_reference(ref, data)
    opt = OffloadAdamW(model.parameters(), **HP, **kw).attach(model, guard=False)
    try:
        assert opt._engine.eager_updates is eager and opt.max_grad_norm == max_norm
        assert not opt._engine.guard_params
        got = train_torch(model, opt, data)
        opt.synchronize()
        assert got == pytest.approx(want, abs=1e-5) and max_diff(ref, model) < 1e-5
        assert (opt.last_grad_norm is not None) == (max_norm is not None)
    finally:
        trainstream.unwrap(model)
    with pytest.raises(ValueError, match="eager"):
        OffloadAdamW(make_model(0).parameters(), eager="yes")
    with pytest.raises(ValueError, match="disagree"):
        OffloadAdamW(make_model(0).parameters(), eager=True, eager_updates=False)
    with pytest.raises(ValueError, match="guard"):
        OffloadAdamW(model.parameters()).attach(model, guard=1)


@pytest.mark.parametrize("accumulation_steps, passes", [(1, 2), (1, 3), (2, 3)])
@pytest.mark.parametrize("param_offload", [False, True])
def test_max_grad_norm_sums_an_extra_backward_like_torch(accumulation_steps, passes, param_offload):
    ref = make_model(0)
    model = clone(ref)
    data = batches(4 * passes)
    _torch_reference(ref, data, per_step=passes, max_grad_norm=0.5)
    model, opt = trainstream.wrap(
        model,
        torch.optim.AdamW(model.parameters(), **HP),
        device="cpu",
        max_grad_norm=0.5,
        accumulation_steps=accumulation_steps,
        param_offload=param_offload,
    )
    try:
        train_torch(model, opt, data, accumulation=passes)
        opt.synchronize()
        assert max_diff(ref, model) < 1e-5
        assert opt.last_grad_norm is not None and opt.last_grad_norm > 0
        assert any("summed" in e for e in trainstream.memory_report(model)["events"])
    finally:
        trainstream.unwrap(model)


def test_without_clipping_an_extra_backward_still_raises():
    model, opt = trainstream.wrap(make_model(0), lr=1e-3, device="cpu")
    (x, y), (x2, y2) = batches(2)
    model(x, y).backward()
    with pytest.raises(RuntimeError, match="accumulation_steps"):
        model(x2, y2).backward()
    trainstream.unwrap(model)


# ---- memory_report(model): TrainStream's keys and meanings ------------------------------------------
def test_memory_report_trainstream_keys_with_paged_weights():
    ref = make_model(0, n_blocks=4)
    model = clone(ref)
    data = batches(3)
    _torch_reference(ref, data)
    model, opt = trainstream.wrap(
        model, torch.optim.AdamW(model.parameters(), **HP), device="cpu", param_offload=True
    )
    try:
        train_torch(model, opt, data)
        opt.synchronize()
        assert max_diff(ref, model) < 1e-5
        r = trainstream.memory_report(model)
        p = r["params"]
        assert p["paged_blocks"] == p["streamed_blocks"] == [0, 1, 2, 3]  # weights paged to RAM
        assert p["quantize"] is None and p["quantized_blocks"] == [] and p["total_blocks"] == 4
        # a block's loads count in forward and again in backward (ramstream keeps the last
        # weight_window + 1 blocks loaded from forward into backward: fewer backward loads)
        assert 3 * 4 < p["loads"] <= 3 * 2 * 4
        assert p["load_bytes"] == p["stream"]["bytes_h2d"] > 0 and p["paged_bytes"] > 0
        t = r["transfers"]
        assert set(t) == {"bytes_d2h", "bytes_h2d", "copies_d2h", "copies_h2d"}
        assert t["bytes_d2h"] == r["optimizer"]["grad_bytes_offloaded"] > 0
        assert t["bytes_h2d"] >= p["load_bytes"] and t["copies_h2d"] >= p["loads"]
        assert r["activations"]["offloaded_blocks"] == r["activations"]["paged_blocks"] == []
        assert r["resident"] is False and set(r["gpu"]) == {"allocated", "reserved", "peak_allocated"}
        assert "live_bytes" in r["pinned"] and isinstance(r["events"], list)
    finally:
        trainstream.unwrap(model)


def test_memory_report_activation_paging_is_not_weight_paging():
    model, opt = trainstream.wrap(
        make_model(0),
        lr=1e-3,
        device="cpu",
        activation_offload=True,
        min_offload_bytes=0,
        param_offload=False,
    )
    try:
        train_torch(model, opt, batches(2))
        r = trainstream.memory_report(model)
        assert r["params"]["paged_blocks"] == []  # no weights paged
        assert r["activations"]["offloaded_blocks"] == [0, 1, 2] and r["activations"]["packed_bytes"] > 0
        assert r["transfers"]["bytes_d2h"] >= r["activations"]["packed_bytes"]
    finally:
        trainstream.unwrap(model)


def test_memory_report_quantize_is_the_format():
    ref = make_model(0)
    for b in ref.blocks:
        b.fc1.requires_grad_(False)
        b.fc2.requires_grad_(False)
    model = clone(ref)
    model, opt = trainstream.wrap(model, lr=1e-3, device="cpu", quantize="int8", quant_block_size=32)
    try:
        p = trainstream.memory_report(model)["params"]
        assert p["quantize"] == "int8" and p["quantized_blocks"] == [0, 1, 2] and p["quantized_bytes"] > 0
        assert p["quantization"]["format"] == "int8"  # ramstream's own record
    finally:
        trainstream.unwrap(model)


# ---- invalid quantization requests: ValueError, as TrainStream -------------------------------------
def test_quantization_requests_trainstream_rejects():
    with pytest.raises(ValueError, match="no frozen"):  # trained weights are never quantized
        trainstream.wrap(make_model(0), lr=1e-3, device="cpu", quantize="int8")
    frozen = make_model(0)
    for b in frozen.blocks:
        b.requires_grad_(False)
    trainstream.quantize_model(frozen, "nf4")
    with pytest.raises(ValueError, match="already holds quantized weights"):
        trainstream.wrap(frozen, lr=1e-3, device="cpu", quantize="none")
    for bad in ("fp4", "none", "auto"):
        with pytest.raises(ValueError):
            trainstream.quantize_model(make_model(0), bad)
    with pytest.raises(ValueError):
        trainstream.wrap(make_model(0), lr=1e-3, device="cpu", quantize="fp4")
    with pytest.raises(ValueError):
        trainstream.quantize_model(make_model(0), "int8", block_size=3)


# ---- HardwareProfile: TrainStream's field names -------------------------------------------------------
def test_hardware_profile_trainstream_names_and_units():
    hp = trainstream.profile_hardware("cpu")
    assert isinstance(hp, trainstream.HardwareProfile)
    assert hp.bidir_gbps == 2 * hp.duplex_gbps  # both directions together
    assert hp.cpu_adamw_gelems == pytest.approx(hp.adamw_gbps / 28)  # 1e9 parameters/s
    assert hp.matmul_tflops_bf16 is hp.matmul_tflops is None and hp.matmul_tflops_fp32 is None
    assert hp.device_index is None and hp.sm_count == 0 and hp.vram_bytes == hp.vram_total
    assert hp.transfer_ms(hp.h2d_gbps * 1e9) == pytest.approx(1000.0)
    assert 1.0 <= hp.duplex_factor <= 2.0 and isinstance(hp.summary(), str)
    g = trainstream.HardwareProfile(device="cuda:1", h2d_gbps=50.0, d2h_gbps=50.0, duplex_gbps=40.0,
                                    matmul_tflops=400.0, vram_total=80 << 30)  # fmt: skip
    assert g.device_index == 1 and g.matmul_tflops_bf16 == 400.0 and g.bidir_gbps == 80.0
    assert g.duplex_factor == pytest.approx(1.6) and g.compute_ms(4e14) == pytest.approx(1000.0)
    assert g.break_even_flops_per_byte == pytest.approx(400e12 / 50e9)
    assert g.link_ms(50e9, 50e9) == pytest.approx(2000 / 1.6)
    with pytest.raises(AttributeError):
        g.matmul_tflops_bf16 = 1.0  # read-only: ramstream's field is the one to set


# ---- a model moved off the device and back ----------------------------------------------------------
@pytest.mark.cuda
def test_round_trip_to_cpu_and_back_cuda():
    ref = make_model(0).cuda()
    model = clone(ref)
    data = batches(8, device="cuda")
    want = _torch_reference(ref, data)
    model, opt = trainstream.wrap(model, torch.optim.AdamW(model.parameters(), **HP), offload=True)
    try:
        got = train_torch(model, opt, data[:4])
        model.to("cpu")
        assert next(model.parameters()).device.type == "cpu"
        with pytest.raises(RuntimeError):  # TrainStream's type: the optimizer waits for the GPU
            opt.step()
        model.cuda()
        got += train_torch(model, opt, data[4:])
        opt.synchronize()
        assert got == pytest.approx(want, abs=1e-5)
        assert max_diff(ref, model) < 1e-5
        assert any("engine rebuilt" in e for e in trainstream.memory_report(model)["events"])
    finally:
        trainstream.unwrap(model)
