"""Helpers of the Pipeline tests on CPU stages: a stack of blocks and its cuts, batches, the unsplit
reference over the same microbatches, exact comparison, a timeout, a module that fails on demand
and a two-part model with tuple outputs."""

from __future__ import annotations

import threading

import torch
import torch.nn as nn
import torch.nn.functional as F

WIDTH = 12
CPU2 = ["cpu", "cpu"]


def blocks(n=8, seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(*[nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Tanh()) for _ in range(n)])


def groups(model, k):
    """The model's blocks cut into k consecutive nn.Sequential pieces (sharing the modules)."""
    kids = list(model)
    per = len(kids) // k
    return [nn.Sequential(*kids[i * per : (i + 1) * per]) for i in range(k)]


def batch(rows=10, seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(rows, WIDTH, generator=g), torch.randn(rows, WIDTH, generator=g)


def reference_grads(model, x, y, n, loss_fn=F.mse_loss):
    """The unsplit model over the same microbatches, loss/n backward in microbatch order."""
    losses = []
    for xm, ym in zip(x.tensor_split(n), y.tensor_split(n)):
        loss = loss_fn(model(xm), ym)
        (loss / n).backward()
        losses.append(loss.detach())
    return losses


def assert_same(a, b):
    for (name, p), q in zip(a.named_parameters(), b.parameters()):
        assert torch.equal(p, q), name
        assert (p.grad is None) == (q.grad is None), name
        if p.grad is not None:
            assert torch.equal(p.grad, q.grad), name


def next_step_is_exact(pipe, mine, ref, x, y, n=4, **step_kw):
    """After a failed step: flush_grads(), one step of `pipe` (over `mine`'s modules) and the same
    microbatches through the unsplit `ref`; every weight and .grad equal bit for bit."""
    pipe.flush_grads()  # the next step starts a new sum
    run_with_timeout(lambda: pipe.step(x, targets=y, loss_fn=F.mse_loss, n_microbatches=n, **step_kw))
    ref.zero_grad()
    reference_grads(ref, x, y, n)
    assert_same(mine, ref)


def run_with_timeout(fn, seconds=60):
    """fn() on a thread; fails the test (instead of hanging) if it has not returned in time."""
    box = {}

    def target():
        try:
            box["value"] = fn()
        except BaseException as e:  # noqa: BLE001 - handed to the test
            box["error"] = e

    t = threading.Thread(target=target, daemon=True)
    t.start()
    t.join(seconds)
    assert not t.is_alive(), f"hung for {seconds} s"
    if "error" in box:
        raise box["error"]
    return box.get("value")


class Boom(nn.Module):
    """Tanh that raises in forward (when armed for a microbatch count) or in backward."""

    def __init__(self) -> None:
        super().__init__()
        self.forward_at = None
        self.backward_armed = False
        self.calls = 0

    def forward(self, x):
        self.calls += 1
        if self.forward_at is not None and self.calls == self.forward_at:
            raise RuntimeError("boom in forward")
        return _Fail.apply(x, self) if self.backward_armed else torch.tanh(x)


class _Fail(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, mod):
        return torch.tanh(x)

    @staticmethod
    def backward(ctx, g):
        raise RuntimeError("boom in backward")


class Head(nn.Module):
    """Returns (h, aux, ids): aux requires grad and is used later, ids is an int tensor."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(WIDTH, WIDTH), nn.Linear(WIDTH, 3)

    def forward(self, x):
        h = torch.tanh(self.a(x))
        return h, self.b(h), (x[:, 0] > 0).long()


class Tail(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.c = nn.Linear(WIDTH, WIDTH)

    def forward(self, h, aux, ids):
        out = self.c(h) * aux.sum(1, keepdim=True) + ids.unsqueeze(1)
        return out, ids  # a tuple output with an element that needs no gradient


class Whole(nn.Module):
    def __init__(self, head, tail) -> None:
        super().__init__()
        self.head, self.tail = head, tail

    def forward(self, x):
        return self.tail(*self.head(x))


def tuple_loss(out, y):
    return F.mse_loss(out[0], y)
