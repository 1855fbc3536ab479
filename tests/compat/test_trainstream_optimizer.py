"""TrainStream 0.4.1's OffloadAdamW surface beyond training: detach() (the model back plain, with
its trained weights, trainable by torch afterwards), the moment_dtype and device attributes and
the stats() keys its tests read (host_state_bytes with bf16 moments), each checked against torch."""

from __future__ import annotations

import pytest
import torch

import ramstream as trainstream
from ramstream import OffloadAdamW

from _models import batches, clone, make_model, max_diff, train_torch

HP = dict(lr=2e-3, betas=(0.9, 0.95), weight_decay=0.05)


def _setup(how: str, model, device: str):
    if how == "attach":
        return model, OffloadAdamW(model.parameters(), **HP).attach(model)
    return trainstream.wrap(
        model,
        torch.optim.AdamW(model.parameters(), **HP),
        device=device,
        param_offload=how == "wrap_streamed",
    )


def _max_diff(a, b) -> float:
    return max(
        float((p.detach().cpu() - q.detach().cpu()).abs().max())
        for p, q in zip(a.parameters(), b.parameters())
    )


def _detach_then_torch(how: str, device: str) -> None:
    ref = make_model(0, n_blocks=4)
    model = clone(ref)  # streamed: built on the CPU, wrap(device=) places it (TrainStream's README)
    ref.to(device)
    if how != "wrap_streamed":
        model.to(device)
    data = batches(8, device=device)
    train_torch(ref, torch.optim.AdamW(ref.parameters(), foreach=False, **HP), data[:4])
    model, opt = _setup(how, model, device)
    train_torch(model, opt, data[:4])
    opt.synchronize()
    assert _max_diff(ref, model) < 1e-5  # trained like torch
    trained = [p.detach().to(device, copy=True) for p in model.parameters()]

    got = opt.detach()
    assert got is model and getattr(model, "_ramstream", None) is None and not opt.attached
    params = list(model.parameters())
    assert all(type(p) is torch.nn.Parameter for p in params)
    assert all(p.device.type == torch.device(device).type for p in params)  # streamed ones too
    assert all(torch.equal(p.detach(), t) for p, t in zip(params, trained))
    assert opt.detach() is None  # idempotent
    with pytest.raises(RuntimeError, match="closed"):
        opt.step()

    # the detached model trains with plain torch exactly as a never-wrapped copy of its weights
    fresh = make_model(0, n_blocks=4).to(device)
    fresh.load_state_dict(model.state_dict())
    a = train_torch(model, torch.optim.AdamW(model.parameters(), foreach=False, **HP), data[4:])
    b = train_torch(fresh, torch.optim.AdamW(fresh.parameters(), foreach=False, **HP), data[4:])
    if device == "cpu":  # the same kernels on the same numbers
        assert a == b
        assert all(torch.equal(p, q) for p, q in zip(model.parameters(), fresh.parameters()))
    else:  # CUDA reductions may order sums differently from run to run
        assert a == pytest.approx(b, abs=1e-6) and _max_diff(model, fresh) < 1e-6
    assert max(float((p.detach() - t).abs().max()) for p, t in zip(model.parameters(), trained)) > 0


@pytest.mark.parametrize("how", ["attach", "wrap", "wrap_streamed"])
def test_detach_gives_the_trained_model_back_plain_and_torch_trains_it(how):
    _detach_then_torch(how, "cpu")


@pytest.mark.cuda
@pytest.mark.parametrize("how", ["attach", "wrap", "wrap_streamed"])
def test_detach_gives_the_trained_model_back_plain_and_torch_trains_it_cuda(how):
    _detach_then_torch(how, "cuda")


def test_detach_of_an_optimizer_attached_to_no_model_only_waits():
    """TrainStream's detach() on a standalone optimizer removes nothing; it keeps training."""
    ref = make_model(0)
    model = clone(ref)
    data = batches(6)
    want = train_torch(ref, torch.optim.AdamW(ref.parameters(), foreach=False, **HP), data)
    opt = OffloadAdamW(model.parameters(), **HP)
    got = train_torch(model, opt, data[:3])
    assert opt.detach() is None and not opt.attached
    got += train_torch(model, opt, data[3:])
    opt.synchronize()
    assert got == pytest.approx(want, abs=1e-5) and max_diff(ref, model) < 1e-5


def test_detach_after_unwrap_changes_nothing():
    model, opt = _setup("wrap", make_model(0), "cpu")
    train_torch(model, opt, batches(2))
    trainstream.unwrap(model)
    before = [p.detach().clone() for p in model.parameters()]
    assert opt.detach() is None
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), before))


def test_moment_dtype_device_and_stats_keys_of_trainstream():
    """TrainStream's attributes and stats() keys; with bf16 moments the host state is 4 bytes per
    element smaller (two 2-byte moments saved), and state_dict() exports fp32 moments."""
    fp32, bf16 = make_model(0), make_model(0)
    data = batches(3)
    a = OffloadAdamW(fp32.parameters(), **HP).attach(fp32)
    b = OffloadAdamW(bf16.parameters(), moment_dtype="bfloat16", **HP).attach(bf16)
    try:
        train_torch(fp32, a, data)
        train_torch(bf16, b, data)
        assert (a.moment_dtype, b.moment_dtype) == ("float32", "bfloat16")
        assert a.device == torch.device("cpu")
        sa, sb = a.stats(), b.stats()
        numel = sum(p.numel() for p in fp32.parameters())
        assert sa["numel"] == numel and sa["params"] == len(list(fp32.parameters()))
        assert (sa["moment_dtype"], sb["moment_dtype"]) == ("float32", "bfloat16")
        padded = sum(bk.numel for bk in a._engine.buckets)  # buckets hold whole, aligned slices
        assert sa["host_state_bytes"] == 3 * 4 * padded  # fp32 master and two fp32 moments
        assert sa["host_state_bytes"] - sb["host_state_bytes"] == 4 * padded
        assert sa["update_ms_total"] == pytest.approx(sa["host_update_s"] * 1e3)
        assert sa["update_ms_total"] > 0
        exp_avg = b.state_dict()["state"][0]["exp_avg"]
        assert exp_avg.dtype == torch.float32
    finally:
        trainstream.unwrap(fp32)
        trainstream.unwrap(bf16)
