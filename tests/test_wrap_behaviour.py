"""wrap() behaviour on the CPU engine: guard, .to(), accumulation errors, unwrap, reports."""

from __future__ import annotations

import time

import pytest
import torch

import ramstream
import ramstream.engine.updater as updater  # imported before any patching (it binds host_jobs.update)
from ramstream.engine import host_jobs

from _models import batches, clone, make_model, max_diff, train_torch


@pytest.fixture
def slow_updates(monkeypatch):
    """Makes every host update take at least 0.4 s, so reads can race with it."""
    real = host_jobs.update

    def slow(*a, **k):
        time.sleep(0.4)
        return real(*a, **k)

    monkeypatch.setattr(host_jobs, "update", slow)
    monkeypatch.setattr(updater, "update", slow)


def _one_step(model, opt, data):
    x, y = data[0]
    model(x, y).backward()
    opt.step()


def test_guard_waits_for_a_weight_read_outside_its_module(slow_updates):
    model = make_model(0)
    ref = clone(model)
    data = batches(1)
    train_torch(ref, torch.optim.AdamW(ref.parameters(), lr=1e-2, foreach=False), data)
    model, opt = ramstream.wrap(model, torch.optim.AdamW(model.parameters(), lr=1e-2))
    _one_step(model, opt, data)
    w = model.blocks[1].fc1.weight
    assert w.grad is None and w.shape == (128, 32) and w.dtype == torch.float32  # no wait
    bucket = w._ramstream_slot.bucket
    assert bucket.pending  # metadata reads did not wait
    total = (w * 1.0).sum()  # a real read waits for the update
    assert not bucket.pending
    assert abs(float(total) - float(ref.blocks[1].fc1.weight.sum())) < 1e-4


def test_without_guard_metadata_only_and_forward_still_waits(slow_updates):
    model = make_model(0)
    ref = clone(model)
    data = batches(3)
    train_torch(ref, torch.optim.AdamW(ref.parameters(), lr=1e-2, foreach=False), data)
    model, opt = ramstream.wrap(model, torch.optim.AdamW(model.parameters(), lr=1e-2), guard_params=False)
    assert type(model.blocks[0].fc1.weight) is torch.nn.Parameter
    train_torch(model, opt, data)  # each forward waits in its modules' pre-hooks
    opt.synchronize()
    assert max_diff(ref, model) < 1e-5


def test_undeclared_accumulation_raises():
    model, opt = ramstream.wrap(make_model(0), lr=1e-3)
    (x, y), (x2, y2) = batches(2)
    model(x, y).backward()
    with pytest.raises(RuntimeError, match="accumulation_steps"):
        model(x2, y2).backward()


def test_to_half_and_back_keeps_masters_unrounded():
    model = make_model(0)
    ref = clone(model)
    data = batches(8)
    train_torch(ref, torch.optim.AdamW(ref.parameters(), lr=3e-3, foreach=False), data)
    model, opt = ramstream.wrap(model, torch.optim.AdamW(model.parameters(), lr=3e-3))
    train_torch(model, opt, data[:4])
    model.half()
    assert all(p.dtype == torch.float16 for p in model.parameters())
    for m, p in zip(opt.master_weights(), model.parameters()):
        assert torch.equal(p.detach(), m.half().view_as(p))
    model.float()
    for m, p in zip(opt.master_weights(), model.parameters()):
        assert torch.equal(p.detach(), m.view_as(p))  # not rounded through fp16
    train_torch(model, opt, data[4:])
    opt.synchronize()
    assert max_diff(ref, model) < 1e-5


def test_step_on_wrong_device_raises():
    model, opt = ramstream.wrap(make_model(0), lr=1e-3)
    model.to("meta")
    with pytest.raises(RuntimeError, match="model.to"):
        opt.step()


def test_unwrap_returns_plain_model():
    model = make_model(0)
    model, opt = ramstream.wrap(model, lr=1e-3)
    train_torch(model, opt, batches(2))
    expected = [m.clone() for m in opt.master_weights()]
    plain = ramstream.unwrap(model)
    assert plain is model and not hasattr(plain, "_ramstream")
    for p, e in zip(plain.parameters(), expected):
        assert type(p) is torch.nn.Parameter
        assert not p._post_accumulate_grad_hooks
        assert torch.equal(p.detach(), e.view_as(p))
    x, y = batches(1)[0]
    plain(x, y).backward()  # no engine hook fires: grads stay on the params
    assert all(p.grad is not None for p in plain.parameters())
    with pytest.raises(ValueError, match="not wrapped"):
        ramstream.unwrap(plain)


def test_memory_report_and_stats():
    model, opt = ramstream.wrap(make_model(0), lr=1e-3, moment_dtype="bf16")
    train_torch(model, opt, batches(3))
    opt.synchronize()
    r = ramstream.memory_report(model)
    assert set(r) >= {"events", "params", "optimizer", "plan"}
    assert r["optimizer"]["moment_dtype"] == "bfloat16"
    assert any("wrapped" in e for e in r["events"])
    st = opt.stats()
    n = sum(p.numel() for p in model.parameters())
    assert st["steps"] == 3 and st["bytes_d2h"] == 3 * n * 4
    padded = sum(b.numel for b in opt._engine.buckets)  # parameters start 512-byte aligned
    assert n <= padded < n + len(list(model.parameters())) * 128
    assert r["optimizer"]["host_state_bytes"] == padded * (4 + 2 + 2)


def test_wrap_twice_and_bad_model():
    model, _ = ramstream.wrap(make_model(0), lr=1e-3)
    with pytest.raises(ValueError, match="already wrapped"):
        ramstream.wrap(model)
    with pytest.raises(TypeError, match="nn.Module"):
        ramstream.wrap("model")


@pytest.mark.parametrize(
    "options, match",
    [
        (dict(bogus=1), "unknown option.*bogus"),
        (dict(optimizer_mode="tpu"), "optimizer_mode"),
        (dict(offload=False), "offload"),
        (dict(device="xla"), "device"),
        (dict(distributed="yes"), "distributed"),
        (dict(guard_params=1), "guard_params"),
        (dict(max_grad_norm=-1.0), "max_grad_norm"),
        (dict(max_grad_norm=float("nan")), "max_grad_norm"),
        (dict(accumulation_steps=0), "accumulation_steps"),
        (dict(accumulation_steps=2.0), "accumulation_steps"),
        (dict(moment_dtype="fp8"), "moment_dtype"),
        (dict(moment_dtype=torch.float16), "moment_dtype"),
        (dict(threads=0), "threads"),
        (dict(lr=float("inf")), "lr"),
        (dict(verbose="no"), "verbose"),
    ],
)
def test_bad_options_raise_value_error_naming_them(options, match):
    with pytest.raises(ValueError, match=match):
        ramstream.wrap(make_model(0), **options)


def test_bad_optimizer_types():
    m = make_model(0)
    with pytest.raises(ValueError, match="SGD"):
        ramstream.wrap(m, torch.optim.SGD(m.parameters(), lr=0.1))
    with pytest.raises(ValueError, match="L2"):
        ramstream.wrap(m, torch.optim.Adam(m.parameters(), weight_decay=0.1))
    with pytest.raises(ValueError, match="amsgrad"):
        ramstream.wrap(m, torch.optim.AdamW(m.parameters(), amsgrad=True))


def test_bad_hyper_parameter_at_step_leaves_state_unchanged():
    model, opt = ramstream.wrap(make_model(0), lr=1e-3, max_grad_norm=1.0)
    train_torch(model, opt, batches(2))
    opt.synchronize()
    before = [m.clone() for m in opt.master_weights()]
    sd = opt.state_dict()
    before_m = {k: v["exp_avg"].clone() for k, v in sd["state"].items()}
    opt.param_groups[0]["lr"] = float("nan")
    x, y = batches(1)[0]
    model(x, y).backward()
    with pytest.raises(ValueError, match="lr"):
        opt.step()
    for a, b in zip(before, opt.master_weights()):
        assert torch.equal(a, b)
    for k, v in opt.state_dict()["state"].items():
        assert torch.equal(v["exp_avg"], before_m[k])


def test_offload_adamw_standalone_threads_and_thread_safety():
    model = make_model(0)
    ref = clone(model)
    data = batches(5)
    train_torch(ref, torch.optim.AdamW(ref.parameters(), lr=1e-3, foreach=False), data)
    from ramstream._native import lib

    before = lib().num_threads()
    try:
        opt = ramstream.OffloadAdamW(model.parameters(), lr=1e-3, threads=1)
        assert lib().num_threads() == 1
        train_torch(model, opt, data)  # no forward hooks: reads go through the guard
        assert max_diff(ref, model) < 1e-5
    finally:
        lib().set_num_threads(before)


def test_dropped_optimizers_release_their_engine_thread():
    """The engine threads these wraps start end once the optimizers are dropped. Only threads
    named ramstream-* that did not exist before count: threads of earlier tests (or of torch)
    that end meanwhile, or live on, change nothing."""
    import gc
    import threading

    def ours():
        return {t for t in threading.enumerate() if t.name.startswith("ramstream-")}

    gc.collect()
    before = ours()
    started = set()
    for _ in range(3):
        model, opt = ramstream.wrap(make_model(0), lr=1e-3)
        train_torch(model, opt, batches(1))
        started |= ours() - before
        del model, opt
    assert len(started) >= 3  # one engine thread per wrap, seen while it was alive
    gc.collect()
    deadline = time.time() + 10
    while any(t.is_alive() for t in started) and time.time() < deadline:
        time.sleep(0.05)
    assert not [t.name for t in started if t.is_alive()]


@pytest.mark.parametrize(
    "kw, match",
    [
        (dict(bucket_bytes=0), "bucket_bytes"),
        (dict(seed=-1), "seed"),
        (dict(max_inflight_bytes=10), "max_inflight_bytes"),
        (dict(vram_headroom=1.5), "vram_headroom"),
        (dict(mode="tpu"), "mode"),
        (dict(offload=False), "offload"),
        (dict(lr=-1.0), "lr"),
        (dict(betas=(0.9, 1.0)), "betas"),
        (dict(moment_dtype="fp8"), "moment_dtype"),
    ],
)
def test_offload_adamw_rejects_bad_arguments(kw, match):
    with pytest.raises(ValueError, match=match):
        ramstream.OffloadAdamW(make_model(0).parameters(), **kw)


def test_weights_that_cannot_fit_the_device_raise_memory_error_with_the_arithmetic():
    from ramstream.wrap import check_weights_fit

    gib = 2**30
    mem = {"free": 3 * gib, "cap": 8 * gib, "total": 80 * gib, "reserved": 5 * gib}
    dev = torch.device("cuda", 0)
    check_weights_fit(3 * gib, mem, dev)  # exactly fits: no error
    with pytest.raises(MemoryError) as e:
        check_weights_fit(7 * gib, mem, dev)
    msg = str(e.value)
    for part in (
        "7.00 GiB on cuda:0",
        "3.00 GiB more",
        "cap 8.00 of 80.00 GiB",
        "5.00 GiB already reserved",
        "bfloat16",
    ):
        assert part in msg
