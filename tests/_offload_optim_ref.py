"""Shared by the tests of OffloadModel's host optimizer: the chunks, the data, two param groups,
and the torch reference (the chunks resident, torch.optim.AdamW(fused=True) on fp32 masters on the
host, where the host optimizer keeps them)."""

from __future__ import annotations

import copy

import torch
import torch.nn as nn
import torch.nn.functional as F

D = 16


def make_chunks(n=5, frozen_bias=True):
    torch.manual_seed(0)
    out = [
        nn.Sequential(nn.Linear(D, 2 * D), nn.GELU(), nn.LayerNorm(2 * D), nn.Linear(2 * D, D))
        for _ in range(n)
    ]
    if frozen_bias:
        out[1][0].bias.requires_grad_(False)  # a frozen parameter inside a streamed chunk
    return out


def make_data(n, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(4, D, generator=g), torch.randn(4, D, generator=g)) for _ in range(n)]


def two_groups(params):
    """Two groups with their own lr and weight decay (the frozen parameter is in the first)."""
    return [
        {"params": params[0::2], "weight_decay": 0.1},
        {"params": params[1::2], "lr": 5e-3, "weight_decay": 0.0},
    ]


class Reference:
    """The chunks resident on `device` (nn.Sequential of a deep copy); torch.optim.AdamW(fused=True)
    steps fp32 masters on the host (where the host optimizer keeps them; gradients cast exactly)
    and the weights take their values (a bf16 model: their rounding), so the update is torch's
    CPU kernel on the same gradients."""

    def __init__(self, chunks, device, lr=1e-2, groups=two_groups, clip=None, **hyper):
        self.device, self.clip = device, clip
        self.model = nn.Sequential(*copy.deepcopy(chunks)).to(device)
        self.params = list(self.model.parameters())
        self.masters = [p.detach().cpu().float().clone().requires_grad_(p.requires_grad) for p in self.params]
        self.opt = torch.optim.AdamW(groups(self.masters), lr=lr, fused=True, **hyper)

    def backward(self, x, y):
        F.mse_loss(self.model(x.to(self.device)), y.to(self.device)).backward()

    def step(self):
        for p, m in zip(self.params, self.masters):
            m.grad = None if p.grad is None else p.grad.detach().cpu().float().clone()
            p.grad = None
        if self.clip is not None:
            torch.nn.utils.clip_grad_norm_([m for m in self.masters if m.grad is not None], self.clip)
        self.opt.step()
        self.opt.zero_grad()
        with torch.no_grad():
            for p, m in zip(self.params, self.masters):
                p.copy_(m)


def assert_weights(ref: Reference, model, opt):
    opt.synchronize()
    mp = list(model.parameters())
    assert len(mp) == len(ref.params)
    for i, (a, b) in enumerate(zip(ref.params, mp)):
        assert torch.equal(a.detach().cpu(), b.detach().cpu()), f"parameter {i} differs"


def run(model, opt, data, accumulation=1, scheduler=None):
    for i in range(0, len(data), accumulation):
        for x, y in data[i : i + accumulation]:
            model.step(x.to(model.device), targets=y.to(model.device))
        opt.step()
        opt.zero_grad()
        if scheduler is not None:
            scheduler.step()


def run_ref(ref, data, accumulation=1, scheduler=None):
    for i in range(0, len(data), accumulation):
        for x, y in data[i : i + accumulation]:
            ref.backward(x, y)
        ref.step()
        if scheduler is not None:
            scheduler.step()


def snapshot(model, opt):
    opt.synchronize()
    sd = opt.state_dict()
    weights = [p.detach().cpu().clone() for p in model.parameters()]
    moments = {
        k: (v["exp_avg"].clone(), v["exp_avg_sq"].clone(), float(v["step"])) for k, v in sd["state"].items()
    }
    return weights, moments


def assert_same_state(a, b):
    assert len(a[0]) == len(b[0]) and all(torch.equal(x, y) for x, y in zip(a[0], b[0]))
    assert a[1].keys() == b[1].keys()
    for k in a[1]:
        assert torch.equal(a[1][k][0], b[1][k][0]) and torch.equal(a[1][k][1], b[1][k][1])
        assert a[1][k][2] == b[1][k][2]


class Fail(nn.Module):
    """Raises once when armed: in forward, or in its backward."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(D, D)
        self.where = None

    def forward(self, x):
        where, self.where = self.where, None
        if where == "forward":
            raise RuntimeError("boom in forward")
        y = self.lin(x)
        return Boom.apply(y) if where == "backward" else y


class Boom(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        raise RuntimeError("boom in backward")
