"""TrainStream's public names (issue 9): OffloadAdamW.attach, stats(), memory_report, master state."""

from __future__ import annotations

import pytest
import torch

import ramstream

from _models import batches, clone, make_model, max_diff, train_torch

HP = dict(lr=3e-3, weight_decay=0.05)


def _exact(a: torch.nn.Module, b: torch.nn.Module) -> bool:
    return all(torch.equal(x.detach(), y.detach()) for x, y in zip(a.parameters(), b.parameters()))


def _attach_loop(device: str) -> None:
    ref = make_model(0).to(device)
    wrapped, attached = clone(ref), clone(ref)
    data = batches(8, device=device)
    train_torch(ref, torch.optim.AdamW(ref.parameters(), foreach=False, **HP), data)
    wrapped, w_opt = ramstream.wrap(wrapped, torch.optim.AdamW(wrapped.parameters(), **HP), offload=True)
    opt = ramstream.OffloadAdamW(attached.parameters(), **HP)
    assert not opt.attached
    assert opt.attach(attached) is attached
    assert opt.attached and w_opt.attached
    assert opt.eager_active and opt.accumulation_steps == 1 and opt.max_grad_norm is None
    try:
        train_torch(wrapped, w_opt, data)
        train_torch(attached, opt, data)
        opt.synchronize()
        w_opt.synchronize()
        assert _exact(wrapped, attached)  # the same engine and hooks as wrap()
        assert max_diff(ref, attached) < 1e-5
        assert not opt.resident
        assert opt.stats()["steps"] == w_opt.stats()["steps"] == 8
        if device == "cuda":  # every step uploads each fp32 weight once
            numel = opt.stats()["numel"]
            assert opt.stats()["param_bytes_uploaded"] == 8 * numel * 4
    finally:
        ramstream.unwrap(attached)
        ramstream.unwrap(wrapped)
    assert not opt.attached


def test_attach_trains_as_wrap_and_torch():
    _attach_loop("cpu")


@pytest.mark.cuda
def test_attach_trains_as_wrap_and_torch_cuda():
    _attach_loop("cuda")


def test_attach_properties_and_errors():
    model = make_model(0)
    opt = ramstream.OffloadAdamW(model.parameters(), max_grad_norm=1.0, accumulation_steps=2)
    assert opt.max_grad_norm == 1.0 and opt.accumulation_steps == 2 and not opt.eager_active
    with pytest.raises(TypeError, match="model must be a torch.nn.Module"):
        opt.attach(object())
    with pytest.raises(ValueError, match="does not hold this optimizer's parameters"):
        opt.attach(make_model(1))
    opt.attach(model)
    with pytest.raises(RuntimeError, match="already attached"):
        opt.attach(model)
    with pytest.raises(ValueError, match="already wrapped"):
        ramstream.wrap(model)
    assert any("attached" in e for e in ramstream.memory_report(model)["events"])
    ramstream.unwrap(model)
    assert not ramstream.OffloadAdamW(make_model(0).parameters(), eager_updates=False).eager_active


def test_stats_trainstream_names_follow_the_arithmetic():
    model = make_model(0)
    params = list(model.parameters())
    numel = sum(p.numel() for p in params)
    opt = ramstream.OffloadAdamW(params, bucket_bytes=1 << 14, **HP)
    opt.attach(model)
    try:
        steps = 3
        train_torch(model, opt, batches(steps))
        opt.synchronize()
        s = opt.stats()
        n_buckets = len(opt._engine.buckets)
        assert n_buckets > 1
        assert s["numel"] == numel and s["mode"] == "cpu"
        assert s["grad_bytes_offloaded"] == s["bytes_d2h"] == steps * numel * 4  # fp32 gradients
        assert s["param_bytes_uploaded"] == s["bytes_h2d"] == 0  # a CPU device: updated in place
        assert s["grad_hook_calls"] == steps * len(params)
        assert s["eager_updates"] == steps * n_buckets
        assert s["guard_waits"] == s["waits"]
        # the guard: metadata and .grad do not wait, a real read of a weight in flight does
        model(*batches(1, seed=7)[0]).backward()
        opt.step()
        before = opt.stats()["guard_waits"]
        _ = [(p.grad, p.shape, p.dtype, p.numel()) for p in params]
        assert opt.stats()["guard_waits"] == before
        _ = params[-1].sum()
        assert opt.stats()["guard_waits"] == before + 1
    finally:
        ramstream.unwrap(model)


def test_stats_no_eager_updates_with_clipping_or_deferred():
    for kw in (dict(max_grad_norm=1.0), dict(eager_updates=False)):
        model = make_model(0)
        opt = ramstream.OffloadAdamW(model.parameters(), **kw, **HP)
        opt.attach(model)
        train_torch(model, opt, batches(2))
        s = opt.stats()
        assert s["eager_updates"] == 0 and s["steps"] == 2, kw
        ramstream.unwrap(model)


def _report_keys(r: dict) -> None:
    assert isinstance(r["events"], list)
    assert {"loads", "paged_blocks", "quantize"} <= set(r["params"])
    assert "packed_bytes" in r["activations"]
    assert "grad_bytes_offloaded" in r["optimizer"]
    assert isinstance(r["plan"]["history"], list)


def test_memory_report_carries_trainstream_keys():
    model = make_model(0)
    numel = sum(p.numel() for p in model.parameters())
    model, opt = ramstream.wrap(model, lr=1e-3)
    try:
        r0 = ramstream.memory_report(model)
        _report_keys(r0)
        assert r0["params"]["loads"] == 0 and r0["params"]["quantize"] is None
        assert r0["activations"]["packed_bytes"] == 0 and r0["optimizer"]["grad_bytes_offloaded"] == 0
        train_torch(model, opt, batches(2))
        r = ramstream.memory_report(model)
        _report_keys(r)
        assert r["optimizer"]["grad_bytes_offloaded"] == 2 * numel * 4 == opt.stats()["bytes_d2h"]
        assert r["activations"]["packed_bytes"] == 0  # no activation paging asked for
        assert not any("engine rebuilt" in e for e in r["events"])
        model.to(torch.bfloat16).float()  # a cast rebinds the engine
        assert sum("engine rebuilt" in e for e in ramstream.memory_report(model)["events"]) == 2
        model.to("cpu")  # nothing changes: nothing rebuilt
        assert sum("engine rebuilt" in e for e in ramstream.memory_report(model)["events"]) == 2
    finally:
        ramstream.unwrap(model)


def test_memory_report_packed_bytes_with_activation_paging():
    model = make_model(0)
    model, opt = ramstream.wrap(model, lr=1e-3, activation_offload=True, min_offload_bytes=0)
    try:
        train_torch(model, opt, batches(2))
        r = ramstream.memory_report(model)
        _report_keys(r)
        stats = r["plan"]["activations"]["stats"]
        assert r["params"]["paged_blocks"] and r["activations"]["packed_bytes"] == stats["bytes_d2h"] > 0
    finally:
        ramstream.unwrap(model)
