"""State dicts while wrapped: torch's AdamW format both ways, exact resume, model.state_dict()."""

from __future__ import annotations

import io

import torch

import ramstream

from _models import batches, clone, make_model, max_diff, train_torch


def _wrapped(model, lr=2e-3, **kw):
    return ramstream.wrap(model, torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.02), **kw)


def test_state_dict_loads_into_torch_adamw_and_continues_identically():
    ref, model = make_model(0), None
    model = clone(ref)
    data = batches(12)
    ropt = torch.optim.AdamW(ref.parameters(), lr=2e-3, weight_decay=0.02, foreach=False)
    train_torch(ref, ropt, data[:6])
    model, opt = _wrapped(model)
    train_torch(model, opt, data[:6])
    sd = opt.state_dict()
    assert set(sd["state"][0]) == {"step", "exp_avg", "exp_avg_sq", "master"}  # master: issue 9
    assert torch.equal(sd["state"][0]["master"], next(model.parameters()).detach())
    assert sd["state"][0]["exp_avg"].dtype == torch.float32
    assert float(sd["state"][0]["step"]) == 6.0
    # a plain model + torch AdamW from our checkpoint
    plain = make_model(0)
    plain.load_state_dict(model.state_dict())
    topt = torch.optim.AdamW(plain.parameters(), lr=2e-3, weight_decay=0.02, foreach=False)
    buf = io.BytesIO()
    torch.save(sd, buf)
    buf.seek(0)
    topt.load_state_dict(torch.load(buf))
    train_torch(plain, topt, data[6:])
    train_torch(ref, ropt, data[6:])
    assert max_diff(ref, plain) < 1e-5


def test_torch_state_dict_migrates_into_wrap():
    ref = make_model(0)
    data = batches(12)
    ropt = torch.optim.AdamW(ref.parameters(), lr=2e-3, weight_decay=0.02, foreach=False)
    train_torch(ref, ropt, data[:5])
    model = clone(ref)
    topt = torch.optim.AdamW(model.parameters(), lr=2e-3, weight_decay=0.02)
    topt.load_state_dict(ropt.state_dict())
    model, opt = ramstream.wrap(model, topt)  # state migrated at wrap()
    assert float(opt.state_dict()["state"][0]["step"]) == 5.0
    train_torch(model, opt, data[5:])
    train_torch(ref, ropt, data[5:])
    opt.synchronize()
    assert max_diff(ref, model) < 1e-5


def test_load_state_dict_of_torch_into_offload_adamw():
    ref = make_model(0)
    data = batches(10)
    ropt = torch.optim.AdamW(ref.parameters(), lr=2e-3, weight_decay=0.02, foreach=False)
    train_torch(ref, ropt, data[:4])
    model = clone(ref)
    model, opt = _wrapped(model)
    opt.load_state_dict(ropt.state_dict())
    train_torch(model, opt, data[4:])
    train_torch(ref, ropt, data[4:])
    opt.synchronize()
    assert max_diff(ref, model) < 1e-5


def test_resume_is_bit_exact():
    data = batches(10)
    a = make_model(0)
    a, aopt = _wrapped(a, max_grad_norm=0.5)
    train_torch(a, aopt, data)
    aopt.synchronize()

    b = make_model(0)
    b, bopt = _wrapped(b, max_grad_norm=0.5)
    train_torch(b, bopt, data[:4])
    buf = io.BytesIO()
    torch.save({"model": b.state_dict(), "opt": bopt.state_dict()}, buf)
    ramstream.unwrap(b)
    buf.seek(0)
    ck = torch.load(buf)
    c = make_model(5)  # different initial weights, overwritten by the load
    c, copt = _wrapped(c, max_grad_norm=0.5)
    c.load_state_dict(ck["model"])  # masters follow the loaded weights
    copt.load_state_dict(ck["opt"])
    train_torch(c, copt, data[4:])
    copt.synchronize()
    for pa, pc in zip(a.parameters(), c.parameters()):
        assert torch.equal(pa.detach(), pc.detach())


def test_model_state_dict_waits_for_pending_updates():
    model = make_model(0)
    ref = clone(model)
    data = batches(3)
    train_torch(ref, torch.optim.AdamW(ref.parameters(), lr=1e-3, foreach=False), data)
    model, opt = ramstream.wrap(model, torch.optim.AdamW(model.parameters(), lr=1e-3))
    train_torch(model, opt, data)
    sd = model.state_dict()  # no explicit synchronize
    for k, v in ref.state_dict().items():
        assert (sd[k] - v).abs().max() < 1e-5


def test_load_state_dict_rejects_mismatch():
    model, opt = _wrapped(make_model(0))
    sd = opt.state_dict()
    sd["param_groups"] = sd["param_groups"] * 2
    import pytest

    with pytest.raises(ValueError, match="param groups"):
        opt.load_state_dict(sd)
