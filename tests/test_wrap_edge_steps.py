"""Unusual step sequences: zero_grad(set_to_none=False), step() without backward, two steps in
a row, backward through part of the model, a step() before the last declared micro-batch
with clipping, unfreezing after wrap(), a closed optimizer,
memory_report() consistency."""

from __future__ import annotations

import pytest
import torch

import ramstream

from _models import batches, clone, make_model, max_diff

TOL = 1e-5


def _pair(**kw):
    ref = make_model(0, n_blocks=2)
    model = clone(ref)
    ropt = torch.optim.AdamW(ref.parameters(), lr=3e-3, weight_decay=0.05, foreach=False)
    model, opt = ramstream.wrap(
        model, torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.05), **kw
    )
    return ref, ropt, model, opt


def _both(ref, ropt, model, opt, fn):
    fn(ref, ropt)
    fn(model, opt)


def test_zero_grad_keeping_tensors_and_steps_without_backward():
    """step() consumes the gradients: a step() with no backward since the last one changes
    nothing (torch does the same when zero_grad() set the gradients to None)."""
    ref, ropt, model, opt = _pair(bucket_bytes=1 << 13)
    data = batches(6)
    for i, (x, y) in enumerate(data):
        if i % 2 == 0:
            ropt.step()  # torch: gradients are None, nothing happens
            opt.step()
        for m, o in ((ref, ropt), (model, opt)):
            m(x, y).backward()
            o.step()
            o.zero_grad(set_to_none=i % 2 == 1)  # zeroed tensors that the next pass adds to
        if i % 2 == 0:
            opt.synchronize()
            before = opt.master_weights()
            opt.step()  # a second step() in a row
            assert all(torch.equal(a, b) for a, b in zip(before, opt.master_weights()))
    opt.synchronize()
    assert max_diff(ref, model) < TOL
    sd, rsd = opt.state_dict(), ropt.state_dict()
    assert all(float(sd["state"][k]["step"]) == float(v["step"]) == 6.0 for k, v in rsd["state"].items())


def _partial_loss(m, x, y, depth):
    """Only the embedding and the first `depth` blocks get gradients (a probe on their output)."""
    h = m.emb(x)
    for b in m.blocks[:depth]:
        h = b(h)
    return (h.float() ** 2).mean()


@pytest.mark.parametrize("accumulation", [1, 2])
def test_backward_through_part_of_the_model(accumulation):
    ref, ropt, model, opt = _pair(bucket_bytes=1 << 13, accumulation_steps=accumulation)
    data = batches(12)

    def run(m, o):
        for i in range(0, len(data), accumulation):
            for j, (x, y) in enumerate(data[i : i + accumulation]):
                step = i // accumulation
                if step % 3 == 1:
                    _partial_loss(m, x, y, depth=1 + j % 2).backward()
                else:
                    m(x, y).backward()
            o.step()
            o.zero_grad()

    _both(ref, ropt, model, opt, run)
    opt.synchronize()
    assert max_diff(ref, model) < TOL
    rsd = ropt.state_dict()["state"]
    assert {k: float(v["step"]) for k, v in opt.state_dict()["state"].items()} == {
        k: float(v["step"]) for k, v in rsd.items()
    }


@pytest.mark.parametrize("eager_updates", [True, False])
def test_step_before_the_last_declared_micro_batch_clips_by_what_was_summed(eager_updates):
    """accumulation_steps=3 and a window one or two micro-batches short (an epoch's end): the
    global norm is that of the gradients summed so far, as clip_grad_norm_ sees them."""
    ref, ropt, model, opt = _pair(
        bucket_bytes=1 << 13, accumulation_steps=3, max_grad_norm=0.3, eager_updates=eager_updates
    )
    data = batches(6)
    norms = {}

    def run(m, o):
        for i, (x, y) in enumerate(data):
            m(x, y).backward()
            if i in (2, 4, 5):  # windows of 3, 2 and 1 micro-batches
                n = torch.nn.utils.clip_grad_norm_(m.parameters(), 0.3) if o is ropt else None
                o.step()
                o.zero_grad()
                norms.setdefault(i, []).append(float(n) if n is not None else o._engine.last_grad_norm)

    _both(ref, ropt, model, opt, run)
    opt.synchronize()
    assert all(a == pytest.approx(b, rel=1e-5) for a, b in norms.values())
    assert max_diff(ref, model) < TOL


def test_parameter_unfrozen_after_wrap_trains_like_torch():
    """A parameter frozen at wrap() has no host state: unfreezing it takes unwrap() and wrap()
    again (the optimizer's state carries over); freezing one after wrap() just stops its
    updates."""
    ref = make_model(0, n_blocks=2)
    model = clone(ref)
    for m in (ref, model):
        m.blocks[1].fc1.requires_grad_(False)
    ropt = torch.optim.AdamW(ref.parameters(), lr=3e-3, foreach=False)
    model, opt = ramstream.wrap(model, torch.optim.AdamW(model.parameters(), lr=3e-3), bucket_bytes=1 << 13)
    data = batches(8)

    def run(m, o):
        for i, (x, y) in enumerate(data):
            if i == 3:
                if isinstance(o, ramstream.OffloadAdamW):
                    m = ramstream.unwrap(m)
                    m.blocks[1].fc1.requires_grad_(True)
                    m, o = ramstream.wrap(m, o, bucket_bytes=1 << 13)
                else:
                    m.blocks[1].fc1.requires_grad_(True)
            if i == 6:
                m.blocks[0].fc2.weight.requires_grad_(False)
            m(x, y).backward()
            o.step()
            o.zero_grad()
        return o

    run(ref, ropt)
    opt = run(model, opt)
    opt.synchronize()
    assert max_diff(ref, model) < TOL
    names = [n for n, _ in model.named_parameters()]
    steps = {names[k]: float(v["step"]) for k, v in opt.state_dict()["state"].items()}
    assert steps["blocks.1.fc1.weight"] == 5.0 and steps["blocks.0.fc2.weight"] == 6.0


def test_parameter_unfrozen_without_rewrap_raises_and_holds_no_state():
    ref = make_model(0, n_blocks=2)
    model = clone(ref)
    model.blocks[1].fc1.requires_grad_(False)
    model, opt = ramstream.wrap(model, torch.optim.AdamW(model.parameters(), lr=3e-3), eager_updates=False)
    frozen = model.blocks[1].fc1.weight.numel() + model.blocks[1].fc1.bias.numel()
    r = ramstream.memory_report(model)
    assert r["params"]["numel"] == sum(p.numel() for p in ref.parameters()) - frozen
    model.blocks[1].fc1.requires_grad_(True)
    x, y = batches(1)[0]
    with pytest.raises(
        RuntimeError,
        match=r"blocks\.1\.fc1\.(weight|bias) got a gradient, but "
        "it had requires_grad=False when wrap",
    ):
        model(x, y).backward()
    opt.zero_grad()  # the failed pass is discarded
    assert max_diff(ref, model) == 0.0


def test_closed_optimizer_refuses_to_step():
    model, opt = ramstream.wrap(make_model(0, n_blocks=1), lr=1e-3)
    x, y = batches(1)[0]
    plain = ramstream.unwrap(model)
    plain(x, y).backward()
    before = [p.detach().clone() for p in plain.parameters()]
    with pytest.raises(RuntimeError, match="closed"):
        opt.step()
    assert all(torch.equal(a, p.detach()) for a, p in zip(before, plain.parameters()))
    sd = opt.state_dict()  # a checkpoint can still be taken
    assert sd["param_groups"][0]["lr"] == 1e-3


def test_memory_report_is_consistent_with_the_layout():
    model, opt = ramstream.wrap(
        make_model(0, n_blocks=2), lr=1e-3, bucket_bytes=1 << 13, accumulation_steps=2, moment_dtype="float32"
    )
    data = batches(2)
    for x, y in data:
        model(x, y).backward()
    opt.step()
    r = ramstream.memory_report(model)
    assert set(r) == {
        "events",
        "params",
        "activations",
        "optimizer",
        "plan",
        "transfers",
        "pinned",
        "gpu",
        "resident",
    }
    params = list(model.parameters())
    e = opt._engine
    assert r["params"]["count"] == len(params)
    assert r["params"]["numel"] == sum(p.numel() for p in params)
    assert r["params"]["buckets"] == len(r["params"]["bucket_numel"]) == len(e.buckets) > 1
    padded = sum(r["params"]["bucket_numel"])
    assert r["params"]["numel"] <= padded
    assert r["params"]["device"] == "cpu"
    o = r["optimizer"]
    # "auto" is the default; the CPU engine updates on the host
    assert o["mode"] == "auto" and o["gpu_updated_numel"] == 0 and o["resident"] is False
    assert o["moment_dtype"] == "float32"
    assert o["host_state_bytes"] == padded * (4 + 4 + 4 + 4)  # master, 2 moments, accumulator
    assert o["landing_bytes"] == padded * 4
    assert o["stats"]["steps"] == 1 and o["stats"]["bytes_d2h"] == 2 * r["params"]["numel"] * 4
    assert r["plan"]["activations"] is None
