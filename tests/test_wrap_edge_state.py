"""State dicts in corner cases: param groups with their own lr/weight_decay, frozen parameters,
a branch that gets no gradient in some steps, tied weights, accumulation windows, partial
torch checkpoints, exact resume into a fresh wrap()."""

from __future__ import annotations

import copy
import io

import torch
import torch.nn.functional as F

import ramstream

from _models import TinyGPT, batches, clone, max_diff

TOL = 1e-5


class Branchy(TinyGPT):
    """TinyGPT (head tied to the embedding) with an extra layer used only when `use_aux`."""

    def __init__(self) -> None:
        super().__init__(n_blocks=2)
        self.aux = torch.nn.Linear(32, 32)
        self.use_aux = True

    def forward(self, idx, targets):
        x = self.emb(idx)
        for b in self.blocks:
            x = b(x)
        if self.use_aux:
            x = x + self.aux(x)
        logits = self.head(self.ln_f(x))
        return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))


def _model(seed=0):
    torch.manual_seed(seed)
    m = Branchy()
    m.blocks[0].fc1.bias.requires_grad_(False)  # frozen, yet in the optimizer's groups
    return m


def _groups(model):
    decay = [p for n, p in model.named_parameters() if p.ndim == 2]
    other = [p for n, p in model.named_parameters() if p.ndim != 2]
    return [
        {"params": decay, "lr": 3e-3, "weight_decay": 0.1},
        {"params": other, "lr": 1e-3, "weight_decay": 0.0, "betas": (0.8, 0.99)},
    ]


def _adamw(model, **kw):
    return torch.optim.AdamW(_groups(model), eps=1e-7, **kw)


def _run(model, opt, data, start, stop, accumulation=1):
    """Steps start..stop; the aux branch is used in even steps only."""
    for i in range(start, stop):
        model.use_aux = i % 2 == 0
        for x, y in data[i * accumulation : (i + 1) * accumulation]:
            model(x, y).backward()
        opt.step()
        opt.zero_grad()


def _assert_state_close(sd, ref_sd, exact=False):
    assert sorted(sd["state"]) == sorted(ref_sd["state"])
    for k, st in ref_sd["state"].items():
        assert float(sd["state"][k]["step"]) == float(st["step"])
        for key in ("exp_avg", "exp_avg_sq"):
            a, b = sd["state"][k][key], st[key]
            assert a.shape == b.shape
            if exact:
                assert torch.equal(a, b), (k, key)
            else:
                assert (a - b).abs().max() <= TOL * max(1.0, b.abs().max().item()), (k, key)
    for g, rg in zip(sd["param_groups"], ref_sd["param_groups"]):
        for key in ("lr", "betas", "eps", "weight_decay", "params"):
            assert g[key] == rg[key], key


def test_groups_frozen_unused_and_tied_match_torch_state_dict():
    ref = _model()
    model = clone(ref)
    data = batches(7)
    ropt = _adamw(ref, foreach=False)
    model, opt = ramstream.wrap(model, _adamw(model), bucket_bytes=1 << 13)
    _run(ref, ropt, data, 0, 7)
    _run(model, opt, data, 0, 7)
    assert max_diff(ref, model) < TOL
    _assert_state_close(opt.state_dict(), ropt.state_dict())
    frozen = model.blocks[0].fc1.bias
    assert torch.equal(frozen.detach(), ref.blocks[0].fc1.bias.detach())


def test_state_dict_mid_accumulation_is_the_last_step_and_resume_is_exact():
    data = batches(16)
    a = _model()
    a, aopt = ramstream.wrap(a, _adamw(a), accumulation_steps=2, bucket_bytes=1 << 13)
    _run(a, aopt, data, 0, 3, accumulation=2)
    a.use_aux = False
    a(*data[6]).backward()  # micro-batch 1 of 2 of step 3
    buf = io.BytesIO()
    torch.save({"model": a.state_dict(), "opt": aopt.state_dict()}, buf)
    a(*data[7]).backward()
    aopt.step()
    aopt.zero_grad()
    _run(a, aopt, data, 4, 8, accumulation=2)

    ref = _model()  # torch: the same three steps
    ropt = _adamw(ref, foreach=False)
    _run(ref, ropt, data, 0, 3, accumulation=2)
    buf.seek(0)
    ck = torch.load(buf)
    _assert_state_close(ck["opt"], ropt.state_dict())

    c = _model(7)  # fresh weights, replaced by the checkpoint's
    c, copt = ramstream.wrap(c, _adamw(c), accumulation_steps=2, bucket_bytes=1 << 13)
    c.load_state_dict(ck["model"])
    copt.load_state_dict(ck["opt"])
    _run(c, copt, data, 3, 8, accumulation=2)
    aopt.synchronize()
    copt.synchronize()
    for pa, pc in zip(a.parameters(), c.parameters()):
        assert torch.equal(pa.detach(), pc.detach())
    _assert_state_close(copt.state_dict(), aopt.state_dict(), exact=True)


def test_load_state_dict_between_micro_batches_matches_torch():
    data = batches(12)
    donor = _model(3)
    dopt = _adamw(donor, foreach=False)
    _run(donor, dopt, data[6:], 0, 3)
    other = dopt.state_dict()

    ref = _model()
    model = clone(ref)
    ropt = _adamw(ref, foreach=False)
    model, opt = ramstream.wrap(model, _adamw(model), accumulation_steps=2)
    for m, o in ((ref, ropt), (model, opt)):
        _run(m, o, data, 0, 2, accumulation=2)
        m.use_aux = True
        m(*data[4]).backward()  # this micro-batch's gradients are kept
        o.load_state_dict(copy.deepcopy(other))  # torch steps the loaded tensors in place
        m(*data[5]).backward()
        o.step()
        o.zero_grad()
        _run(m, o, data, 3, 6, accumulation=2)
    opt.synchronize()
    assert max_diff(ref, model) < TOL
    _assert_state_close(opt.state_dict(), ropt.state_dict())


def test_torch_checkpoint_without_state_for_some_params_loads_and_continues():
    data = batches(10)
    ref = _model()
    ropt = _adamw(ref, foreach=False)
    ref.use_aux = False  # aux never used: torch has no state for it
    for x, y in data[:3]:
        ref(x, y).backward()
        ropt.step()
        ropt.zero_grad()
    sd = ropt.state_dict()
    aux_ids = {
        i
        for i, p in enumerate(p for g in ropt.param_groups for p in g["params"])
        if p is ref.aux.weight or p is ref.aux.bias
    }
    assert aux_ids and not aux_ids & set(sd["state"])

    model = clone(ref)
    model, opt = ramstream.wrap(model, _adamw(model))
    _run(model, opt, data, 0, 2)  # aux now has state that the load must clear
    opt.load_state_dict(sd)
    model.load_state_dict(ref.state_dict())
    _assert_state_close(opt.state_dict(), sd, exact=True)
    _run(ref, ropt, data, 3, 10)
    _run(model, opt, data, 3, 10)
    opt.synchronize()
    assert max_diff(ref, model) < TOL
    _assert_state_close(opt.state_dict(), ropt.state_dict())


def test_wrap_migrates_partial_torch_state_with_groups():
    data = batches(9)
    ref = _model()
    ropt = _adamw(ref, foreach=False)
    _run(ref, ropt, data, 1, 4)  # odd first: aux has fewer steps than the rest
    model = clone(ref)
    topt = _adamw(model)
    topt.load_state_dict(ropt.state_dict())
    model, opt = ramstream.wrap(model, topt, bucket_bytes=1 << 13)
    _assert_state_close(opt.state_dict(), ropt.state_dict(), exact=True)
    _run(ref, ropt, data, 4, 9)
    _run(model, opt, data, 4, 9)
    opt.synchronize()
    assert max_diff(ref, model) < TOL
    _assert_state_close(opt.state_dict(), ropt.state_dict())
