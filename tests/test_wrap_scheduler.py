"""LR schedulers created on the torch optimizer before wrap() keep driving the returned one."""

from __future__ import annotations

import warnings

import torch

import ramstream

from _models import batches, clone, make_model, max_diff, train_torch


def _lambda(step: int) -> float:
    return 1.0 / (1 + step) + 0.1 * (step % 2)


def test_scheduler_created_before_wrap_matches_torch():
    ref = make_model(0)
    model = clone(ref)
    data = batches(8)
    ropt = torch.optim.AdamW(ref.parameters(), lr=3e-3, foreach=False)
    train_torch(ref, ropt, data, scheduler=torch.optim.lr_scheduler.LambdaLR(ropt, _lambda))

    given = torch.optim.AdamW(model.parameters(), lr=3e-3)
    sched = torch.optim.lr_scheduler.LambdaLR(given, _lambda)  # before wrap()
    model, opt = ramstream.wrap(model, given, device="cpu")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no "lr_scheduler.step() before optimizer.step()"
        train_torch(model, opt, data, scheduler=sched)
    assert max_diff(ref, model) < 1e-5
    assert opt.param_groups[0]["lr"] == ropt.param_groups[0]["lr"] != 3e-3


def test_given_optimizer_state_moves_and_is_dropped():
    model = make_model(0)
    given = torch.optim.AdamW(model.parameters(), lr=3e-3)
    train_torch(model, given, batches(2))
    moments = {id(p): given.state[p]["exp_avg"].clone() for p in model.parameters()}
    model, opt = ramstream.wrap(model, given, device="cpu")
    assert len(given.state) == 0  # nothing left holding device memory
    sd = opt.state_dict()["state"]
    for i, p in enumerate(model.parameters()):
        assert torch.equal(sd[i]["exp_avg"], moments[id(p)])
