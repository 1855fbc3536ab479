"""TrainStream's public names (issue 9): OffloadAdamW.attach, stats(), memory_report, master state."""

from __future__ import annotations

import copy

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
    assert opt.attach(attached) is opt  # TrainStream's chaining: the model is hooked in place
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
        if device == "cuda":  # every step uploads each fp32 weight once (with the alignment
            # padding between parameters inside one copied range: at most the buckets' sizes)
            numel = opt.stats()["numel"]
            padded = sum(b.numel for b in opt._engine.buckets)
            assert 8 * numel * 4 <= opt.stats()["param_bytes_uploaded"] <= 8 * padded * 4
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
        assert (
            r0["params"]["loads"] == 0 and r0["params"]["quantize"] is None
        )  # auto: never on the CPU engine
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
        assert r["activations"]["paged_blocks"] and r["activations"]["packed_bytes"] == stats["bytes_d2h"] > 0
    finally:
        ramstream.unwrap(model)


def _bf16_run(steps_before: int, steps_after: int, *, sd=None, drop_master=False):
    """A bf16 model trained by an attached OffloadAdamW; with `sd` (model, optimizer state
    dicts) it resumes from them first. Returns (model, opt, checkpoint taken after
    steps_before)."""
    model = make_model(0, dtype=torch.bfloat16)
    opt = ramstream.OffloadAdamW(model.parameters(), **HP)
    opt.attach(model)
    data = batches(steps_before + steps_after)
    ckpt = None
    if sd is None:
        train_torch(model, opt, data[:steps_before])
        ckpt = (
            {k: v.clone() for k, v in model.state_dict().items()},
            copy.deepcopy(opt.state_dict()),
        )
    else:
        model_sd, opt_sd = copy.deepcopy(sd)
        if drop_master:
            for st in opt_sd["state"].values():
                del st["master"]
        model.load_state_dict(model_sd)
        opt.load_state_dict(opt_sd)
    train_torch(model, opt, data[steps_before:])
    opt.synchronize()
    return model, opt, ckpt


def test_state_dict_master_resumes_bf16_bit_exactly():
    straight, s_opt, ckpt = _bf16_run(3, 3)
    resumed, r_opt, _ = _bf16_run(3, 3, sd=ckpt)
    lossy, l_opt, _ = _bf16_run(3, 3, sd=ckpt, drop_master=True)
    try:
        masters = s_opt.master_weights()
        for st, p in zip(ckpt[1]["state"].values(), straight.parameters()):
            assert st["master"].dtype == torch.float32 and st["master"].shape == p.shape
        assert any(
            not torch.equal(st["master"].bfloat16().float(), st["master"]) for st in ckpt[1]["state"].values()
        )
        assert _exact(straight, resumed)
        assert all(torch.equal(a, b) for a, b in zip(masters, r_opt.master_weights()))
        # without the masters the resumed run starts from bf16-rounded ones: not the same run
        assert not all(torch.equal(a, b) for a, b in zip(masters, l_opt.master_weights()))
    finally:
        for m in (straight, resumed, lossy):
            ramstream.unwrap(m)


def test_state_dict_master_loads_exactly_and_checks():
    model = make_model(0, dtype=torch.bfloat16)
    opt = ramstream.OffloadAdamW(model.parameters(), **HP)
    opt.attach(model)
    try:
        train_torch(model, opt, batches(2))
        sd = opt.state_dict()
        g = torch.Generator().manual_seed(3)
        for st in sd["state"].values():
            st["master"] = torch.randn(st["master"].shape, generator=g)
        before = opt.master_weights()
        opt.load_state_dict(sd)  # the weights are not the masters' rounding: stale masters
        n = len(sd["state"])
        assert any(
            f"'master' of {n} parameters is ignored" in e for e in ramstream.memory_report(model)["events"]
        )
        assert all(torch.equal(a, b) for a, b in zip(before, opt.master_weights()))
        with torch.no_grad():  # the model's weights from the same checkpoint
            for st, p in zip(sd["state"].values(), model.parameters()):
                p.copy_(st["master"])
        opt.load_state_dict(sd)
        for st, m, p in zip(sd["state"].values(), opt.master_weights(), model.parameters()):
            assert torch.equal(m, st["master"])
            assert torch.equal(p.detach(), st["master"].bfloat16())  # the weight is its rounding
        bad = copy.deepcopy(sd)
        bad["state"][0]["master"] = torch.zeros(3)
        with pytest.raises(ValueError, match="'master' of parameter 0 has 3 elements"):
            opt.load_state_dict(bad)
        assert torch.equal(opt.master_weights()[0], sd["state"][0]["master"])  # nothing changed
    finally:
        ramstream.unwrap(model)


def test_state_dict_with_master_loads_into_torch_adamw_and_back():
    ref = make_model(0)
    model = clone(ref)
    data = batches(6)
    opt = ramstream.OffloadAdamW(model.parameters(), **HP)
    opt.attach(model)
    train_torch(model, opt, data[:3])
    sd = opt.state_dict()
    assert all("master" in st for st in sd["state"].values())
    ramstream.unwrap(model)
    # torch's AdamW loads it and never reads "master": the same steps as from the state without it
    plain = {
        **sd,
        "state": {i: {k: v for k, v in st.items() if k != "master"} for i, st in sd["state"].items()},
    }
    runs = []
    for state in (sd, plain):
        m = clone(model)
        t_opt = torch.optim.AdamW(m.parameters(), foreach=False, **HP)
        t_opt.load_state_dict(copy.deepcopy(state))
        train_torch(m, t_opt, data[3:])
        runs.append((m, t_opt))
    assert _exact(runs[0][0], runs[1][0])
    # and torch's state dict (master kept as an extra key, or none) loads back into OffloadAdamW
    train_torch(ref, torch.optim.AdamW(ref.parameters(), foreach=False, **HP), data)
    for k, (m, t_opt) in enumerate(runs):
        back = clone(m)
        o = ramstream.OffloadAdamW(back.parameters(), **HP)
        o.attach(back)
        o.load_state_dict(t_opt.state_dict())
        ignored = any("is ignored" in e for e in ramstream.memory_report(back)["events"])
        assert ignored == (k == 0)  # torch kept the 3-step master while training on: stale
        train_torch(back, o, data[3:])  # three more steps on top of torch's six-step state
        o.synchronize()
        t_more = clone(m)
        t_opt2 = torch.optim.AdamW(t_more.parameters(), foreach=False, **HP)
        t_opt2.load_state_dict(t_opt.state_dict())
        train_torch(t_more, t_opt2, data[3:])
        assert max_diff(t_more, back) < 1e-5
        ramstream.unwrap(back)
    assert max_diff(ref, runs[1][0]) < 1e-5
