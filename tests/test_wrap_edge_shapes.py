"""Parameter shapes and bucket layouts the GPT models do not have: empty, one-element and 0-dim
parameters, non-contiguous ones, a single parameter, many tiny ones, buckets smaller than one
parameter. Each host update is bit-identical to torch's fused CPU AdamW."""

from __future__ import annotations

import copy

import pytest
import torch

import ramstream


class Odd(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.empty = torch.nn.Parameter(torch.randn(0, 4))
        self.scalar = torch.nn.Parameter(torch.randn(()))
        self.one = torch.nn.Parameter(torch.randn(1))
        self.t = torch.nn.Parameter(torch.randn(12, 8).t())  # non-contiguous
        self.tiny = torch.nn.ParameterList(torch.nn.Parameter(torch.randn(3)) for _ in range(40))
        self.big = torch.nn.Parameter(torch.randn(8, 300) / 10)  # 9600 bytes

    def forward(self, x, y):
        h = (x @ self.t) * self.scalar + self.one
        tiny = torch.stack(list(self.tiny)).mean(0).expand(x.shape[0], 3)
        h = torch.cat([h, tiny], 1)
        z = (x @ self.big).mean(1) * h.mean(1) + self.empty.sum()
        return ((z - y) ** 2).mean()


def _data(n, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(4, 8, generator=g), torch.randn(4, generator=g)) for _ in range(n)]


def _contiguous_copy(model):
    """wrap() makes every parameter a contiguous view of its bucket: the reference does the same
    (a matmul with another layout rounds its gradient differently)."""
    ref = copy.deepcopy(model)
    ref.t = torch.nn.Parameter(ref.t.detach().contiguous())
    return ref


def _train(model, opt, data):
    for x, y in data:
        model(x, y).backward()
        opt.step()
        opt.zero_grad()


@pytest.mark.parametrize("bucket_bytes", [4096, 1 << 14, 32 << 20])
@pytest.mark.parametrize("accumulation", [1, 2])
def test_odd_shapes_are_bit_identical_to_fused_torch(bucket_bytes, accumulation):
    torch.manual_seed(0)
    model = Odd()
    assert not model.t.is_contiguous()
    ref = _contiguous_copy(model)
    data = _data(8)
    ropt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.1, fused=True)
    model, opt = ramstream.wrap(
        model,
        torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1),
        bucket_bytes=bucket_bytes,
        accumulation_steps=accumulation,
    )
    if bucket_bytes == 4096:
        assert len(opt._engine.buckets) > 2
    for m, o in ((ref, ropt), (model, opt)):
        for i in range(0, len(data), accumulation):
            for x, y in data[i : i + accumulation]:
                (m(x, y) / accumulation).backward()
            o.step()
            o.zero_grad()
    opt.synchronize()
    assert model.t.is_contiguous()
    for (name, a), b in zip(ref.named_parameters(), model.parameters()):
        assert a.shape == b.shape, name
        assert torch.equal(a.detach(), b.detach()), name
    sd, rsd = opt.state_dict(), ropt.state_dict()
    for k, st in sd["state"].items():
        assert float(st["step"]) == float(rsd["state"][k]["step"])
        for key in ("exp_avg", "exp_avg_sq"):
            assert st[key].shape == rsd["state"][k][key].shape
            assert torch.equal(st[key], rsd["state"][k][key])
    masters = opt.master_weights()
    assert [m.shape for m in masters] == [p.shape for p in ref.parameters()]


def test_state_dict_round_trip_through_torch_with_odd_shapes():
    torch.manual_seed(0)
    model = Odd()
    ref = _contiguous_copy(model)
    data = _data(8)
    ropt = torch.optim.AdamW(ref.parameters(), lr=1e-2, fused=True)
    model, opt = ramstream.wrap(model, torch.optim.AdamW(model.parameters(), lr=1e-2), bucket_bytes=4096)
    _train(ref, ropt, data[:4])
    opt.load_state_dict(copy.deepcopy(ropt.state_dict()))  # torch's, into ramstream
    model.load_state_dict(ref.state_dict())
    _train(ref, ropt, data[4:6])
    _train(model, opt, data[4:6])
    plain = copy.deepcopy(ref)  # and ramstream's back into torch
    plain.load_state_dict(model.state_dict())
    popt = torch.optim.AdamW(plain.parameters(), lr=1e-2, fused=True)
    popt.load_state_dict(copy.deepcopy(opt.state_dict()))
    _train(ref, ropt, data[6:])
    _train(plain, popt, data[6:])
    for a, b in zip(ref.parameters(), plain.parameters()):
        assert torch.equal(a.detach(), b.detach())


def test_single_parameter_model():
    torch.manual_seed(0)
    ref = torch.nn.Linear(8, 1, bias=False)
    model = copy.deepcopy(ref)
    data = _data(6)
    ropt = torch.optim.AdamW(ref.parameters(), lr=1e-2, fused=True)
    model, opt = ramstream.wrap(model, torch.optim.AdamW(model.parameters(), lr=1e-2))
    for m, o in ((ref, ropt), (model, opt)):
        for x, y in data:
            ((m(x).squeeze(1) - y) ** 2).mean().backward()
            o.step()
            o.zero_grad()
    opt.synchronize()
    assert torch.equal(ref.weight.detach(), model.weight.detach())
    assert ramstream.memory_report(model)["params"]["count"] == 1


def test_model_whose_only_trainable_parameter_is_empty():
    model = torch.nn.Module()
    model.weight = torch.nn.Parameter(torch.empty(3, 0))
    model, opt = ramstream.wrap(model, lr=1e-3)
    (torch.randn(2, 0) @ model.weight.t()).sum().backward()
    opt.step()
    opt.zero_grad()
    assert opt.state_dict()["state"] == {}
    assert model.weight.shape == (3, 0)
