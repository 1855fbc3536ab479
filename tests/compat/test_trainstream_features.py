"""TrainStream 0.4.1 scripts beyond the training loop, as its README and its test files use them:
pinned_stats() and memory_report() without a model, the optimizers wrap() converts or refuses,
verbose=True, a cast after wrap() keeping the fp32 masters, and (on a GPU) the resident switch;
numbers against torch and ramstream's own counters."""

from __future__ import annotations

import pytest
import torch

import ramstream as trainstream

from _models import batches, clone, make_model, max_diff, train_torch

HP = dict(lr=2e-3, betas=(0.9, 0.95), weight_decay=0.05)
PINNED = {
    "live_bytes",
    "peak_live_bytes",
    "cached_bytes",
    "reserved_bytes",
    "host_alloc_calls",
    "host_free_calls",
    "cache_hits",
}


def test_pinned_stats_and_memory_report_without_a_model_are_the_arenas_counters():
    before = trainstream.pinned_stats()
    t = trainstream.pinned_empty((1 << 20,), torch.float32)  # 4 MiB from the pinned host arena
    try:
        s = trainstream.pinned_stats()
        ms = trainstream.memory_stats()
        assert set(s) == PINNED | {"by_tag"} and s["by_tag"] == {}
        assert s["live_bytes"] == ms["bytes_in_use"] >= before["live_bytes"] + t.nbytes
        assert s["peak_live_bytes"] == ms["peak_bytes_in_use"] >= s["live_bytes"]
        assert s["reserved_bytes"] == ms["bytes_pinned"] and s["cached_bytes"] == ms["bytes_cached"]
        r = trainstream.memory_report()  # TrainStream's snapshot
        assert set(r) == {"pinned", "pinned_by_tag", "gpu"} and r["pinned_by_tag"] == {}
        assert r["pinned"] == {k: v for k, v in s.items() if k != "by_tag"}
        if torch.cuda.is_available():
            assert r["gpu"]["reserved"] == torch.cuda.memory_reserved()
        else:
            assert r["gpu"] == {"allocated": 0, "reserved": 0, "peak_allocated": 0}
    finally:
        del t
    assert trainstream.pinned_stats()["live_bytes"] == before["live_bytes"]
    with pytest.raises(ValueError, match="not wrapped"):
        trainstream.memory_report(make_model(0))


def test_wrap_converts_adam_and_refuses_what_trainstream_refuses():
    ref = make_model(0)
    model = clone(ref)
    data = batches(4)
    adam = dict(lr=2e-3, betas=(0.9, 0.95))
    want = train_torch(ref, torch.optim.Adam(ref.parameters(), foreach=False, **adam), data)
    model, opt = trainstream.wrap(model, torch.optim.Adam(model.parameters(), **adam), device="cpu")
    try:
        got = train_torch(model, opt, data)
        opt.synchronize()
        assert got == pytest.approx(want, abs=1e-5) and max_diff(ref, model) < 1e-5
    finally:
        trainstream.unwrap(model)
    m = make_model(0)
    with pytest.raises(TypeError, match="SGD"):  # TrainStream's type (also a ValueError here)
        trainstream.wrap(m, torch.optim.SGD(m.parameters(), lr=0.1), device="cpu")
    for kw in ({"amsgrad": True}, {"maximize": True}):
        with pytest.raises(ValueError, match="amsgrad or maximize"):
            trainstream.wrap(m, torch.optim.AdamW(m.parameters(), **kw), device="cpu")
    # differs: TrainStream warns and applies decoupled decay; ramstream refuses to change the math
    with pytest.raises(ValueError, match="L2"):
        trainstream.wrap(m, torch.optim.Adam(m.parameters(), weight_decay=0.1), device="cpu")


def test_verbose_prints_the_decisions_memory_report_logs(capsys):
    model, opt = trainstream.wrap(make_model(0), lr=1e-3, device="cpu", verbose=True)
    try:
        out = [line for line in capsys.readouterr().out.splitlines() if line.startswith("ramstream: ")]
        events = trainstream.memory_report(model)["events"]
        assert out and len(out) == len(events)
        assert all(e.endswith(line[len("ramstream: ") :]) for line, e in zip(out, events))
    finally:
        trainstream.unwrap(model)


def test_cast_after_wrap_keeps_the_fp32_master_and_trains_on():
    model, opt = trainstream.wrap(make_model(0), lr=2e-3, device="cpu")
    try:
        data = batches(6)
        train_torch(model, opt, data[:3])
        masters = [e["master"].clone() for e in opt.state_dict()["state"].values()]
        model.to(torch.bfloat16)
        assert all(p.dtype == torch.bfloat16 for p in model.parameters())
        after = [e["master"] for e in opt.state_dict()["state"].values()]
        assert all(a.dtype == torch.float32 and torch.equal(a, b) for a, b in zip(after, masters))
        assert all(torch.equal(p.detach(), m.bfloat16()) for p, m in zip(model.parameters(), masters))
        losses = train_torch(model, opt, data[3:])
        opt.synchronize()
        assert all(torch.isfinite(torch.tensor(x)) for x in losses)
        new = opt.master_weights()
        assert any(not torch.equal(a, b) for a, b in zip(new, masters))  # the masters trained on
        assert all(torch.equal(p.detach(), m.bfloat16()) for p, m in zip(model.parameters(), new))
    finally:
        trainstream.unwrap(model)


def _mlp(device):
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.GELU(), torch.nn.Linear(256, 10)).to(device)


def _loop(model, opt, data):
    out = []
    for x, y in data:
        loss = torch.nn.functional.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        out.append(loss.item())
    return out


@pytest.mark.cuda
def test_small_model_goes_resident_and_trains_like_torch_cuda():
    ref, mine = _mlp("cuda"), _mlp("cuda")
    g = torch.Generator().manual_seed(1)
    data = [
        (torch.randn(32, 64, generator=g).cuda(), torch.randint(0, 10, (32,), generator=g).cuda())
        for _ in range(10)
    ]
    want = _loop(ref, torch.optim.AdamW(ref.parameters(), foreach=False, **HP), data)
    mine, opt = trainstream.wrap(mine, torch.optim.AdamW(mine.parameters(), **HP), activation_offload=False)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    try:
        got = []
        for batch in data:
            got += _loop(mine, opt, [batch])
            sched.step()
        assert opt.resident and opt.stats()["mode"] == "resident"
        assert opt.stats()["host_state_bytes"] == 0  # the state lives on the device
        assert got == pytest.approx(want, abs=1e-4) and max_diff(ref, mine) < 1e-4
    finally:
        trainstream.unwrap(mine)
    model = _mlp("cuda")
    model, opt = trainstream.wrap(model, torch.optim.AdamW(model.parameters(), **HP), offload=True)
    try:
        _loop(model, opt, data[:4])
        assert not opt.resident
    finally:
        trainstream.unwrap(model)
