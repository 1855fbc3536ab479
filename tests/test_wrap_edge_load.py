"""Loading into a wrapped model and optimizer: load_state_dict(assign=True), fp32 weights into a
bf16 model, optimizer state dicts that ramstream's AdamW cannot honour."""

from __future__ import annotations

import copy

import pytest
import torch

import ramstream

from _models import batches, clone, make_model, max_diff, train_torch

TOL = 1e-5


def test_assign_true_load_trains_the_loaded_parameters():
    ref = make_model(0, n_blocks=1, tied=False)
    model = clone(ref)
    donor = make_model(3, n_blocks=1, tied=False)
    data = batches(6)
    ref.load_state_dict(donor.state_dict())
    ropt = torch.optim.AdamW(ref.parameters(), lr=3e-3, foreach=False)
    model, opt = ramstream.wrap(model, torch.optim.AdamW(model.parameters(), lr=3e-3), bucket_bytes=1 << 13)
    before = list(model.parameters())
    model.load_state_dict(copy.deepcopy(donor.state_dict()), assign=True)
    assert all(a is not b for a, b in zip(before, model.parameters()))
    assert all(p._ramstream_slot.param is p for p in model.parameters())
    train_torch(ref, ropt, data)
    train_torch(model, opt, data)
    opt.synchronize()
    assert max_diff(ref, model) < TOL


def test_assign_true_that_unties_weights_raises():
    model, opt = ramstream.wrap(make_model(0, n_blocks=1), lr=1e-3)
    sd = copy.deepcopy(make_model(3, n_blocks=1).state_dict())
    with pytest.raises(RuntimeError, match="untied emb.weight, head.weight"):
        model.load_state_dict(sd, assign=True)


@pytest.mark.parametrize("assign", [False, True])
def test_fp32_weights_loaded_into_a_bf16_model(assign):
    """The loaded fp32 values become the masters exactly, also where their bf16 rounding equals
    that of the current masters (the LayerNorm weights here)."""
    model, opt = ramstream.wrap(make_model(0, n_blocks=1, dtype=torch.bfloat16, tied=False), lr=1e-3)
    train_torch(model, opt, batches(2))
    sd = make_model(3, n_blocks=1, tied=False).state_dict()
    model.load_state_dict(copy.deepcopy(sd), assign=assign)
    for (name, p), m in zip(model.named_parameters(), opt.master_weights()):
        assert p.dtype == torch.bfloat16
        assert torch.equal(p.detach(), sd[name].bfloat16())
        assert torch.equal(m, sd[name])


@pytest.mark.parametrize(
    "change",
    [dict(amsgrad=True), dict(maximize=True), dict(decoupled_weight_decay=False, weight_decay=0.1)],
    ids=["amsgrad", "maximize", "adam-l2"],
)
def test_state_dict_with_unsupported_variant_is_refused_untouched(change):
    model, opt = ramstream.wrap(make_model(0, n_blocks=1), lr=1e-3)
    train_torch(model, opt, batches(2))
    sd = copy.deepcopy(opt.state_dict())
    before = copy.deepcopy(opt.state_dict())
    bad = copy.deepcopy(sd)
    bad["param_groups"][0].update(change)
    for st in bad["state"].values():
        st["exp_avg"].zero_()
    with pytest.raises(ValueError, match="amsgrad, maximize or Adam's L2"):
        opt.load_state_dict(bad)
    after = opt.state_dict()
    assert after["param_groups"] == before["param_groups"]
    for k, st in before["state"].items():
        assert torch.equal(after["state"][k]["exp_avg"], st["exp_avg"])


def test_state_dict_groups_are_torch_adamw_groups():
    ref = make_model(0, n_blocks=1)
    model = clone(ref)
    ropt = torch.optim.AdamW(ref.parameters(), lr=1e-3)
    model, opt = ramstream.wrap(model, torch.optim.AdamW(model.parameters(), lr=1e-3))
    data = batches(2)
    train_torch(ref, ropt, data)
    train_torch(model, opt, data)
    assert opt.state_dict()["param_groups"] == ropt.state_dict()["param_groups"]
    adam = torch.optim.Adam(ref.parameters(), lr=1e-3)  # Adam takes ramstream's as AdamW
    adam.load_state_dict(opt.state_dict())
    assert adam.param_groups[0]["decoupled_weight_decay"] is True
