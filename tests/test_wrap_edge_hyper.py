"""Hyper-parameters that change or come in unusual forms: schedulers that set betas and
weight_decay, tensor lr/betas (torch accepts them), torch.optim.Adam with decoupled decay."""

from __future__ import annotations

import pytest
import torch

import ramstream

from _models import batches, clone, make_model, max_diff

TOL = 1e-5


def _groups(model, lr=3e-3):
    decay = [p for p in model.parameters() if p.ndim == 2]
    other = [p for p in model.parameters() if p.ndim != 2]
    return [
        {"params": decay, "weight_decay": 0.1, "lr": lr},
        {"params": other, "weight_decay": 0.0, "lr": lr},
    ]


def _train(model, opt, data, schedule=None, accumulation=1):
    for i in range(0, len(data), accumulation):
        for x, y in data[i : i + accumulation]:
            model(x, y).backward()
        opt.step()
        opt.zero_grad()
        if schedule is not None:
            schedule(opt, i // accumulation + 1)


def _betas_and_decay(opt, step):
    for k, g in enumerate(opt.param_groups):
        g["betas"] = (0.9 - 0.05 * (step % 3), 0.999 - 0.01 * step)
        g["weight_decay"] = 0.1 * (step % 2) + 0.01 * k
        g["eps"] = 1e-8 * (1 + step)


@pytest.mark.parametrize(
    "options",
    [dict(), dict(max_grad_norm=0.3), dict(accumulation_steps=2), dict(eager_updates=False)],
    ids=["eager", "clip", "accumulate", "deferred"],
)
def test_schedule_of_betas_weight_decay_and_eps_matches_torch(options):
    ref = make_model(0, n_blocks=2)
    model = clone(ref)
    data = batches(12)
    acc = options.get("accumulation_steps", 1)
    ropt = torch.optim.AdamW(_groups(ref), foreach=False)
    model, opt = ramstream.wrap(model, torch.optim.AdamW(_groups(model)), bucket_bytes=1 << 13, **options)
    clip = options.get("max_grad_norm")
    for m, o in ((ref, ropt), (model, opt)):
        for i in range(0, len(data), acc):
            for x, y in data[i : i + acc]:
                m(x, y).backward()
            if clip is not None and o is ropt:
                torch.nn.utils.clip_grad_norm_(m.parameters(), clip)
            o.step()
            o.zero_grad()
            _betas_and_decay(o, i // acc + 1)
    opt.synchronize()
    assert max_diff(ref, model) < TOL


def test_lambda_lr_per_group_after_wrap_matches_torch():
    ref = make_model(0, n_blocks=2)
    model = clone(ref)
    data = batches(8)
    lambdas = [lambda s: 1.0 / (1 + s), lambda s: 0.5**s]
    ropt = torch.optim.AdamW(_groups(ref), foreach=False)
    rs = torch.optim.lr_scheduler.LambdaLR(ropt, lambdas)
    model, opt = ramstream.wrap(model, torch.optim.AdamW(_groups(model)))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambdas)
    _train(ref, ropt, data, lambda o, s: rs.step())
    _train(model, opt, data, lambda o, s: sched.step())
    opt.synchronize()
    assert max_diff(ref, model) < TOL
    assert [g["lr"] for g in opt.param_groups] == [g["lr"] for g in ropt.param_groups]


def test_tensor_lr_and_betas_in_torch_adamw_and_in_param_groups():
    ref = make_model(0, n_blocks=2)
    model = clone(ref)
    data = batches(8)
    betas = (torch.tensor(0.9), torch.tensor(0.99))
    ropt = torch.optim.AdamW(_groups(ref, lr=torch.tensor(3e-3)), betas=betas, foreach=False)
    model, opt = ramstream.wrap(model, torch.optim.AdamW(_groups(model, lr=torch.tensor(3e-3)), betas=betas))

    def halve(o, step):
        for g in o.param_groups:
            g["lr"] = torch.tensor(3e-3 * 0.5**step)  # a tensor again, set by the user

    _train(ref, ropt, data, halve)
    _train(model, opt, data, halve)
    opt.synchronize()
    assert max_diff(ref, model) < TOL


def test_offload_adamw_accepts_tensor_lr_and_betas_like_torch():
    ref = make_model(0, n_blocks=1)
    model = clone(ref)
    data = batches(5)
    kw = dict(lr=torch.tensor(2e-3), betas=(torch.tensor(0.85), torch.tensor(0.99)), weight_decay=0.05)
    ropt = torch.optim.AdamW(ref.parameters(), foreach=False, **kw)
    opt = ramstream.OffloadAdamW(model.parameters(), **kw)
    _train(ref, ropt, data)
    _train(model, opt, data)
    opt.synchronize()
    assert max_diff(ref, model) < TOL
    with pytest.raises(ValueError, match="lr"):
        ramstream.OffloadAdamW(model.parameters(), lr=torch.tensor([1e-3, 2e-3]))


def test_adam_with_decoupled_weight_decay_is_adamw():
    ref = make_model(0, n_blocks=1)
    model = clone(ref)
    data = batches(6)
    ropt = torch.optim.AdamW(ref.parameters(), lr=2e-3, weight_decay=0.1, foreach=False)
    adam = torch.optim.Adam(model.parameters(), lr=2e-3, weight_decay=0.1, decoupled_weight_decay=True)
    model, opt = ramstream.wrap(model, adam)
    _train(ref, ropt, data)
    _train(model, opt, data)
    opt.synchronize()
    assert max_diff(ref, model) < TOL
