"""Dtype round trips while wrapped (fp32 -> bf16/fp16 -> fp32, also between micro-batches),
unwrap() then wrap() again, an unsupported dtype. The reference is torch's fused CPU AdamW on
fp32 master copies whose working copy is the master cast to the model's dtype: bit-identical."""

from __future__ import annotations

import pytest
import torch

import ramstream

from _models import batches, clone, make_model


class MasterRef:
    """A plain model trained through fp32 masters (what ramstream promises for any model dtype)."""

    def __init__(self, model, **kw) -> None:
        self.model = model
        self.masters = [p.detach().float().clone().requires_grad_(True) for p in model.parameters()]
        self.opt = torch.optim.AdamW(self.masters, fused=True, **kw)

    def backward(self, x, y) -> None:
        self.model(x, y).backward()
        for m, p in zip(self.masters, self.model.parameters()):
            m.grad = p.grad.float() if m.grad is None else m.grad + p.grad.float()
            p.grad = None

    def step(self) -> None:
        self.opt.step()
        self.opt.zero_grad()
        self._copy_back()

    def convert(self, dtype) -> None:
        self.model.to(dtype)
        self._copy_back()

    @torch.no_grad()
    def _copy_back(self) -> None:
        for m, p in zip(self.masters, self.model.parameters()):
            p.copy_(m)


def _check_exact(ref: MasterRef, model, opt) -> None:
    opt.synchronize()
    for a, b in zip(ref.model.parameters(), model.parameters()):
        assert a.dtype == b.dtype and torch.equal(a.detach(), b.detach())
    for a, b in zip(ref.masters, opt.master_weights()):
        assert torch.equal(a.detach(), b)
    rsd = ref.opt.state_dict()["state"]
    sd = opt.state_dict()["state"]
    assert sorted(sd) == sorted(rsd)
    for k, st in rsd.items():
        assert float(sd[k]["step"]) == float(st["step"])
        assert torch.equal(sd[k]["exp_avg"], st["exp_avg"])
        assert torch.equal(sd[k]["exp_avg_sq"], st["exp_avg_sq"])


def _pair(**options):
    model = make_model(0, n_blocks=2)
    ref = MasterRef(clone(model), lr=3e-3, weight_decay=0.05)
    model, opt = ramstream.wrap(
        model,
        torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.05),
        bucket_bytes=1 << 13,
        **options,
    )
    return ref, model, opt


def _steps(ref, model, opt, data):
    for x, y in data:
        ref.backward(x, y)
        ref.step()
        model(x, y).backward()
        opt.step()
        opt.zero_grad()


@pytest.mark.parametrize("low", [torch.bfloat16, torch.float16])
def test_round_trip_through_low_precision_is_exact(low):
    ref, model, opt = _pair()
    data = batches(9)
    _steps(ref, model, opt, data[:3])
    ref.convert(low)
    model.to(low)
    _steps(ref, model, opt, data[3:6])
    _check_exact(ref, model, opt)
    sd = model.state_dict()
    assert all(v.dtype == low for v in sd.values())
    ref.convert(torch.float32)
    model.float()
    _steps(ref, model, opt, data[6:])
    _check_exact(ref, model, opt)


def test_conversion_between_micro_batches_is_exact():
    ref, model, opt = _pair(accumulation_steps=2)
    data = batches(8)
    for i in range(0, 8, 2):
        for j, (x, y) in enumerate(data[i : i + 2]):
            if i == 2 and j == 1:
                ref.convert(torch.bfloat16)
                model.bfloat16()
            if i == 6 and j == 1:
                ref.convert(torch.float32)
                model.float()
            ref.backward(x, y)
            model(x, y).backward()
        ref.step()
        opt.step()
        opt.zero_grad()
    _check_exact(ref, model, opt)


def test_unwrap_then_wrap_again_continues_exactly():
    ref, model, opt = _pair()
    data = batches(8)
    _steps(ref, model, opt, data[:3])
    plain = ramstream.unwrap(model)
    x, y = data[3]
    ref.backward(x, y)  # one plain torch step in between, the user's own
    ref.step()
    topt = torch.optim.AdamW(plain.parameters(), lr=3e-3, weight_decay=0.05, fused=True)
    topt.load_state_dict(opt.state_dict())
    for g in topt.param_groups:
        assert g["fused"] is None  # as torch.optim.AdamW's defaults save it
        g["fused"] = True
    plain(x, y).backward()
    topt.step()
    topt.zero_grad()
    model, opt2 = ramstream.wrap(plain, topt, bucket_bytes=1 << 12)
    _steps(ref, model, opt2, data[4:6])
    _check_exact(ref, model, opt2)
    ramstream.unwrap(model)
    model, opt3 = ramstream.wrap(model, opt2)  # the closed OffloadAdamW's state migrates
    _steps(ref, model, opt3, data[6:])
    _check_exact(ref, model, opt3)


def test_unsupported_dtype_raises_and_float_recovers():
    ref, model, opt = _pair()
    data = batches(4)
    _steps(ref, model, opt, data[:2])
    with pytest.raises(TypeError, match="float32, bfloat16 or float16"):
        model.double()
    model.float()
    _steps(ref, model, opt, data[2:])
    _check_exact(ref, model, opt)
