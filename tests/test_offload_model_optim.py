"""OffloadModel's host optimizer (model.optimizer(), ramstream/offload_optim.py) against
torch.optim.AdamW(fused=True) run on the same chunks resident (fp32 masters on the host, where
the host optimizer keeps them): bit-identical weights over 5 steps with several param groups,
weight decay, a frozen parameter, pinned chunks and every keep_activations mode; accumulation;
an LR scheduler; state dicts in torch's format both ways; a failed step; zero_grad(); close()."""

from __future__ import annotations

import copy
import gc
import weakref

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import ramstream

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)]
KEEPS = [True, False, "checkpoint"]
D = 16


def _chunks(n=5, frozen_bias=True):
    torch.manual_seed(0)
    out = [
        nn.Sequential(nn.Linear(D, 2 * D), nn.GELU(), nn.LayerNorm(2 * D), nn.Linear(2 * D, D))
        for _ in range(n)
    ]
    if frozen_bias:
        out[1][0].bias.requires_grad_(False)  # a frozen parameter inside a streamed chunk
    return out


def _data(n, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(4, D, generator=g), torch.randn(4, D, generator=g)) for _ in range(n)]


def _groups(params):
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

    def __init__(self, chunks, device, lr=1e-2, groups=_groups, clip=None, **hyper):
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


def _assert_weights(ref: Reference, model, opt):
    opt.synchronize()
    mp = list(model.parameters())
    assert len(mp) == len(ref.params)
    for i, (a, b) in enumerate(zip(ref.params, mp)):
        assert torch.equal(a.detach().cpu(), b.detach().cpu()), f"parameter {i} differs"


def _run(model, opt, data, accumulation=1, scheduler=None):
    for i in range(0, len(data), accumulation):
        for x, y in data[i : i + accumulation]:
            model.step(x.to(model.device), targets=y.to(model.device))
        opt.step()
        opt.zero_grad()
        if scheduler is not None:
            scheduler.step()


def _run_ref(ref, data, accumulation=1, scheduler=None):
    for i in range(0, len(data), accumulation):
        for x, y in data[i : i + accumulation]:
            ref.backward(x, y)
        ref.step()
        if scheduler is not None:
            scheduler.step()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("keep", KEEPS)
@pytest.mark.parametrize("pin_layers", [None, [0, 3]], ids=["streamed", "pinned-0-3"])
@pytest.mark.parametrize("eager", [True, False], ids=["eager", "at-step"])
def test_five_steps_bit_identical_to_torch_adamw(device, keep, pin_layers, eager):
    chunks = _chunks()
    ref = Reference(chunks, device)
    model = ramstream.OffloadModel(
        chunks, device=device, window=2, pin_layers=pin_layers, keep_activations=keep
    )
    opt = model.optimizer(_groups(list(model.parameters())), lr=1e-2, eager_updates=eager)
    data = _data(5)
    _run(model, opt, data)
    _run_ref(ref, data)
    _assert_weights(ref, model, opt)
    st = opt.stats()
    assert st["steps"] == 5 and (st["eager_updates"] > 0) == eager
    # the optimizer took every trained gradient: none became .grad; the frozen one has no state
    assert all(p.grad is None for p in model.parameters())
    order = [p for g in opt.param_groups for p in g["params"]]  # state dict keys: this order
    frozen = [i for i, p in enumerate(order) if p is model.chunks[1][0].bias]
    assert len(frozen) == 1 and set(opt.state_dict()["state"]) == set(range(len(order))) - set(frozen)
    assert model.pinned == (pin_layers or [])
    for i, c in enumerate(model.chunks):  # streamed weights at home between steps
        assert all(p.device.type == (device if i in model.pinned else "cpu") for p in c.parameters())
    model.close()


def test_updates_overlap_the_backward_and_loads_wait_for_them():
    """Each streamed chunk's update is queued during the backward (its gradients complete); the
    next forward's load waits for it; evicting a chunk in backward does not wait for its update."""
    chunks = _chunks(frozen_bias=False)
    model = ramstream.OffloadModel(chunks, device="cpu", window=2)
    opt = model.optimizer(lr=1e-2)
    e = opt._engine
    queued = []  # buckets with an update queued when chunk 0's backward starts (it runs last)

    def count(module, args, out):
        out.register_hook(lambda g: queued.append(sum(b.pending for b in e.buckets)))

    model.chunks[0].register_forward_hook(count)
    (x, y), (x2, y2) = _data(2)
    model.step(x, targets=y)
    assert len(e.buckets) == 5 and queued == [4]  # chunks 1-4 were being updated already
    assert opt.stats()["eager_updates"] == len(e.buckets)
    opt.step()
    waits = opt.stats()["waits"]
    model.step(x2, targets=y2)  # every load waited for its chunk's update (Block.ready)
    assert opt.stats()["waits"] == waits + len(e.buckets)
    model.close()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("eager", [True, False], ids=["eager", "at-step"])
def test_accumulation_equals_torchs_summed_gradients(device, eager):
    chunks = _chunks()
    ref = Reference(chunks, device)
    model = ramstream.OffloadModel(chunks, device=device, pin=1, keep_activations="checkpoint")
    opt = model.optimizer(
        _groups(list(model.parameters())), lr=1e-2, accumulation_steps=3, eager_updates=eager
    )
    data = _data(9)
    _run(model, opt, data, accumulation=3)
    _run_ref(ref, data, accumulation=3)
    _assert_weights(ref, model, opt)
    # opt.step() after fewer micro-batches than declared (an epoch's end) is exact too
    model.step(*(t.to(device) for t in data[0]))
    opt.step()
    ref.backward(*data[0])
    ref.step()
    _assert_weights(ref, model, opt)
    # one model.step() more than declared before opt.step(): refused, naming the option; the
    # micro-batches before it stay gathered
    for x, y in data[:3]:
        model.step(x.to(device), targets=y.to(device))
        ref.backward(x, y)
    with pytest.raises(RuntimeError, match="accumulation_steps=3"):
        model.step(*(t.to(device) for t in data[3]))
    opt.step()
    ref.step()
    _assert_weights(ref, model, opt)
    model.close()


def test_lr_scheduler_and_param_group_changes():
    chunks = _chunks()
    ref = Reference(chunks, "cpu")
    model = ramstream.OffloadModel(chunks, device="cpu", pin=1)
    opt = model.optimizer(_groups(list(model.parameters())), lr=1e-2)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))
    ref_sched = torch.optim.lr_scheduler.LambdaLR(ref.opt, lambda s: 1.0 / (1 + s))
    data = _data(5)
    _run(model, opt, data[:3], scheduler=sched)
    _run_ref(ref, data[:3], scheduler=ref_sched)
    assert [g["lr"] for g in opt.param_groups] == [g["lr"] for g in ref.opt.param_groups]
    for g, rg in zip(opt.param_groups, ref.opt.param_groups):  # a change between steps
        g["weight_decay"] = rg["weight_decay"] = 0.3
    _run(model, opt, data[3:], scheduler=sched)
    _run_ref(ref, data[3:], scheduler=ref_sched)
    _assert_weights(ref, model, opt)
    model.close()


def test_state_dict_round_trip_in_torchs_format():
    chunks = _chunks()
    data = _data(5)
    ref = Reference(chunks, "cpu")
    _run_ref(ref, data)  # 5 uninterrupted steps
    # 3 steps with ramstream, resumed in torch's AdamW for 2
    model = ramstream.OffloadModel(copy.deepcopy(chunks), device="cpu", pin=1)
    opt = model.optimizer(_groups(list(model.parameters())), lr=1e-2)
    _run(model, opt, data[:3])
    sd = opt.state_dict()
    assert set(sd) == {"state", "param_groups"}
    st = next(iter(sd["state"].values()))
    assert st["step"].dtype == torch.float32 and float(st["step"]) == 3.0
    assert st["exp_avg"].dtype == st["exp_avg_sq"].dtype == torch.float32
    mid = Reference(chunks, "cpu")
    with torch.no_grad():
        for p, m, q in zip(mid.params, mid.masters, model.parameters()):
            p.copy_(q)
            m.copy_(q)
    mid.opt.load_state_dict(sd)
    for g in mid.opt.param_groups:  # torch takes the saved group's flags: ours says fused=None
        g["fused"] = True
    _run_ref(mid, data[3:])
    for a, b in zip(ref.params, mid.params):
        assert torch.equal(a, b)
    # torch's state dict (3 steps) into a fresh host optimizer, 2 more steps there
    part = Reference(chunks, "cpu")
    _run_ref(part, data[:3])
    model2 = ramstream.OffloadModel(copy.deepcopy(chunks), device="cpu", window=1)
    model2.chunks.load_state_dict(part.model.state_dict())
    opt2 = model2.optimizer(_groups(list(model2.parameters())), lr=1e-2)
    opt2.load_state_dict(part.opt.state_dict())
    _run(model2, opt2, data[3:])
    _assert_weights(ref, model2, opt2)
    # a checkpoint loaded into a model whose host optimizer trained on: the masters follow
    model3 = ramstream.OffloadModel(copy.deepcopy(chunks), device="cpu", pin=2)
    opt3 = model3.optimizer(_groups(list(model3.parameters())), lr=1e-2)
    _run(model3, opt3, data[4:])
    model3.load_state_dict({"chunks." + k: v for k, v in part.model.state_dict().items()})
    opt3.load_state_dict(part.opt.state_dict())
    _run(model3, opt3, data[3:])
    _assert_weights(ref, model3, opt3)
    for m in (model, model2, model3):
        m.close()


def _state(model, opt):
    opt.synchronize()
    sd = opt.state_dict()
    weights = [p.detach().cpu().clone() for p in model.parameters()]
    moments = {
        k: (v["exp_avg"].clone(), v["exp_avg_sq"].clone(), float(v["step"])) for k, v in sd["state"].items()
    }
    return weights, moments


def _same_state(a, b):
    assert len(a[0]) == len(b[0]) and all(torch.equal(x, y) for x, y in zip(a[0], b[0]))
    assert a[1].keys() == b[1].keys()
    for k in a[1]:
        assert torch.equal(a[1][k][0], b[1][k][0]) and torch.equal(a[1][k][1], b[1][k][1])
        assert a[1][k][2] == b[1][k][2]


class _Fail(nn.Module):
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
        return _Boom.apply(y) if where == "backward" else y


class _Boom(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        raise RuntimeError("boom in backward")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(
    "where, eager",
    [("forward", True), ("loss", True), ("backward", False), ("forward", False)],
)
def test_failed_step_leaves_weights_and_state_as_before(device, where, eager):
    chunks = _chunks(2, frozen_bias=False) + [_Fail()] + _chunks(2, frozen_bias=False)
    ref = Reference(chunks, device, groups=lambda ps: [{"params": ps}])
    model = ramstream.OffloadModel(chunks, device=device, pin_layers=[3])
    opt = model.optimizer(lr=1e-2, eager_updates=eager)
    data = _data(3)
    _run(model, opt, data[:1])
    _run_ref(ref, data[:1])
    before = _state(model, opt)
    x, y = (t.to(device) for t in data[1])
    with pytest.raises(RuntimeError, match="boom"):
        if where == "loss":
            model.step(
                x, targets=y, loss_fn=lambda out, t: (_ for _ in ()).throw(RuntimeError("boom in loss"))
            )
        else:
            model.chunks[2].where = where
            model.step(x, targets=y)
    opt.step()  # nothing gathered: nothing updated (torch skips parameters without .grad)
    _same_state(before, _state(model, opt))
    assert model.streamer.loaded_bytes() == 0
    _run(model, opt, data[1:])  # training goes on exactly as if the failed step never was
    _run_ref(ref, data[1:])
    _assert_weights(ref, model, opt)
    model.close()


def test_failed_backward_with_eager_updates_keeps_the_updates_that_ran_and_says_so():
    chunks = _chunks(2, frozen_bias=False) + [_Fail()] + _chunks(2, frozen_bias=False)
    model = ramstream.OffloadModel(chunks, device="cpu")
    opt = model.optimizer(lr=1e-2)
    before = _state(model, opt)
    model.chunks[2].where = "backward"
    with pytest.raises(RuntimeError, match="boom"), pytest.warns(RuntimeWarning, match="keep it"):
        model.step(*_data(1)[0])
    after = _state(model, opt)
    # the chunks after the failing one (their backward ran first) were updated, the others not
    changed = iter([not torch.equal(a, b) for a, b in zip(before[0], after[0])])
    per_chunk = [any([next(changed) for _ in c.parameters()]) for c in model.chunks]
    assert per_chunk[3:] == [True, True] and per_chunk[:3] == [False, False, False]
    _run(model, opt, _data(2))  # and the next steps run
    model.close()


@pytest.mark.parametrize("device", DEVICES)
def test_zero_grad_between_step_and_opt_step_drops_the_gradients(device):
    """With updates at opt.step() (eager_updates=False), zero_grad() drops what model.step()
    gathered, as torch: the next opt.step() changes nothing."""
    chunks = _chunks()
    model = ramstream.OffloadModel(chunks, device=device, pin=2)
    opt = model.optimizer(lr=1e-2, eager_updates=False)
    data = _data(3)
    _run(model, opt, data[:1])
    before = _state(model, opt)
    model.step(*(t.to(device) for t in data[1]))
    opt.zero_grad()
    opt.step()
    _same_state(before, _state(model, opt))
    # with eager updates the update already ran: zero_grad() warns that it stays
    model2 = ramstream.OffloadModel(_chunks(), device=device)
    opt2 = model2.optimizer(lr=1e-2)
    model2.step(*(t.to(device) for t in data[1]))
    with pytest.warns(RuntimeWarning, match="keep it"):
        opt2.zero_grad()
    model.close()
    model2.close()


def test_max_grad_norm_equals_torchs_clipping():
    chunks = _chunks()
    ref = Reference(chunks, "cpu", clip=0.5)
    model = ramstream.OffloadModel(chunks, device="cpu", pin=1)
    opt = model.optimizer(_groups(list(model.parameters())), lr=1e-2, max_grad_norm=0.5)
    data = _data(4)
    _run(model, opt, data)
    _run_ref(ref, data)
    opt.synchronize()
    assert opt.stats()["eager_updates"] == 0  # the updates waited for the global norm
    for a, b in zip(ref.params, model.parameters()):
        torch.testing.assert_close(a.detach(), b.detach(), rtol=0, atol=1e-6)
    assert opt.last_grad_norm if hasattr(opt, "last_grad_norm") else True
    model.close()


def test_bfloat16_moments_train_close_to_fp32():
    chunks = _chunks()
    ref = Reference(chunks, "cpu")
    model = ramstream.OffloadModel(chunks, device="cpu")
    opt = model.optimizer(_groups(list(model.parameters())), lr=1e-2, moment_dtype="bfloat16")
    data = _data(5)
    _run(model, opt, data)
    _run_ref(ref, data)
    opt.synchronize()
    diff = max((a.detach() - b.detach()).abs().max().item() for a, b in zip(ref.params, model.parameters()))
    assert 0 < diff < 1e-2  # not the fp32 result, but close to it


def test_bad_arguments_name_what_is_accepted():
    model = ramstream.OffloadModel(_chunks(), device="cpu")
    with pytest.raises(ValueError, match="unknown option.*fused.*accepted: moment_dtype"):
        model.optimizer(fused=True)
    with pytest.raises(ValueError, match="moment_dtype"):
        model.optimizer(moment_dtype="float16")
    with pytest.raises(ValueError, match="not one of this model's"):
        model.optimizer([nn.Parameter(torch.zeros(2))])
    with pytest.raises(TypeError, match="iterable of parameters"):
        model.optimizer(next(model.parameters()))
    with pytest.raises(ValueError, match="lr"):
        model.optimizer(lr=-1.0)
    # a refused optimizer leaves the model as it was: a torch optimizer still trains it
    torch_opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model.step(*_data(1)[0])
    assert all(p.grad is not None for p in model.parameters() if p.requires_grad)
    torch_opt.step()
    opt = model.optimizer()
    with pytest.raises(ValueError, match="already has a host optimizer"):
        model.optimizer()
    with pytest.raises(ValueError, match="set_pinned"):
        model.set_pinned([0])
    opt.close()
    model.close()


def test_close_gives_the_model_back_to_torch_optimizers():
    chunks = _chunks()
    ref = Reference(chunks, "cpu")
    model = ramstream.OffloadModel(chunks, device="cpu", pin=1)
    opt = model.optimizer(_groups(list(model.parameters())), lr=1e-2)
    data = _data(4)
    _run(model, opt, data[:2])
    sd = opt.state_dict()
    opt.close()
    with pytest.raises(RuntimeError, match="closed"):
        opt.step()
    # the model streams with its own slabs again: .grad at home, a torch AdamW steps it
    torch_opt = torch.optim.AdamW(_groups(list(model.parameters())), lr=1e-2, fused=True)
    torch_opt.load_state_dict(sd)
    for g in torch_opt.param_groups:  # (the saved groups say fused=None)
        g["fused"] = True
    _run(model, torch_opt, data[2:])
    _run_ref(ref, data)
    for a, b in zip(ref.params, model.parameters()):
        assert torch.equal(a.detach(), b.detach())
    model.close()


def test_model_collected_without_close_closes_its_optimizer():
    chunks = _chunks()
    model = ramstream.OffloadModel(chunks, device="cpu")
    opt = model.optimizer(lr=1e-2)
    _run(model, opt, _data(2))
    ref = weakref.ref(model)
    del model
    gc.collect()
    assert ref() is None
    with pytest.raises(RuntimeError, match="closed"):
        opt.step()
    assert all(len(c._forward_pre_hooks) == 0 for c in chunks)
    # and the optimizer dropped first: the model (holding it) trains on
    model = ramstream.OffloadModel(_chunks(), device="cpu")
    opt = model.optimizer(lr=1e-2)
    oref = weakref.ref(opt)
    del opt
    gc.collect()
    assert oref() is not None
    model.step(*_data(1)[0])
    opt = oref()
    opt.step()
    model.close()
    assert opt._closed


def test_fp32_home_is_its_own_master_and_bf16_weights_round_the_fp32_master():
    """A streamed fp32 bucket's pinned home is the master the host AdamW updates in place (one
    copy in RAM); a bf16 model keeps fp32 masters and its weights are their rounding, as torch's
    AdamW on fp32 master copies with the bf16 gradients gives."""
    model = ramstream.OffloadModel(_chunks(), device="cpu", pin=1)
    opt = model.optimizer(lr=1e-2)
    streamed = [b for b in opt._engine.buckets if b.streamed]
    assert streamed and all(b.master.data_ptr() == b.slab.home.data_ptr() for b in streamed)
    resident = [b for b in opt._engine.buckets if not b.streamed]
    assert resident and all(b.master.data_ptr() != b.device_flat.data_ptr() for b in resident)
    model.close()

    chunks = [c.to(torch.bfloat16) for c in _chunks(frozen_bias=False)]
    ref = Reference(chunks, "cpu", groups=lambda ps: [{"params": ps}])
    model = ramstream.OffloadModel(chunks, device="cpu", pin=1)
    opt = model.optimizer(lr=1e-2)
    data = [(x.bfloat16(), y.bfloat16()) for x, y in _data(4)]
    _run(model, opt, data)
    _run_ref(ref, data)  # (Reference: fp32 masters, grads cast exactly, weights = masters' rounding)
    _assert_weights(ref, model, opt)
    masters = opt.master_weights()
    for m, r in zip(masters, ref.masters):
        assert m.dtype == torch.float32 and torch.equal(m, r.detach())
    model.close()


def test_wrap_of_an_offload_model_and_a_torch_adamw_gives_its_host_optimizer():
    """ramstream.wrap(offload_model, torch.optim.AdamW(...)) returns (the model, its host
    optimizer) over the torch optimizer's groups (an LR scheduler made on it before keeps
    working) and state (here: one step taken with torch's AdamW first)."""
    chunks = _chunks()
    data = _data(5)
    ref = Reference(chunks, "cpu")
    ref_sched = torch.optim.lr_scheduler.StepLR(ref.opt, step_size=2, gamma=0.5)
    _run_ref(ref, data, scheduler=ref_sched)
    model = ramstream.OffloadModel(chunks, device="cpu", pin=1)
    torch_opt = torch.optim.AdamW(_groups(list(model.parameters())), lr=1e-2, fused=True)
    sched = torch.optim.lr_scheduler.StepLR(torch_opt, step_size=2, gamma=0.5)
    _run(model, torch_opt, data[:1], scheduler=sched)  # a step with torch's AdamW over the homes
    same, opt = ramstream.wrap(model, torch_opt, accumulation_steps=1)
    assert same is model and opt is model._hooks.host_opt and not torch_opt.state
    _run(model, opt, data[1:], scheduler=sched)
    _assert_weights(ref, model, opt)
    assert opt.param_groups[1]["lr"] == ref.opt.param_groups[1]["lr"] == 5e-3 * 0.25
    with pytest.raises(
        ValueError, match="do not apply to an OffloadModel.*accepted with an OffloadModel: lr"
    ):
        ramstream.wrap(ramstream.OffloadModel(_chunks(), device="cpu"), param_offload=True)
    with pytest.raises(ValueError, match="already an OffloadModel's host optimizer"):
        ramstream.wrap(model, opt)
    model.close()


@pytest.mark.parametrize("device", DEVICES)
def test_bf16_autocast_with_kept_activations(device):
    chunks = _chunks()
    ref = Reference(chunks, device)
    model = ramstream.OffloadModel(chunks, device=device, keep_activations=True)
    opt = model.optimizer(_groups(list(model.parameters())), lr=1e-2)
    for x, y in _data(3):
        with torch.autocast(torch.device(device).type, dtype=torch.bfloat16):
            model.step(x.to(device), targets=y.to(device), loss_fn=lambda o, t: F.mse_loss(o.float(), t))
            F.mse_loss(ref.model(x.to(device)).float(), y.to(device)).backward()
        opt.step()
        opt.zero_grad()
        ref.step()
    _assert_weights(ref, model, opt)
    assert model.stats["casts_dropped"] > 0  # the kept graph held no weight casts
    model.close()


def test_traced_step_shows_the_host_updates(tmp_path):
    model = ramstream.OffloadModel(_chunks(), device="cpu", pin=1)
    opt = model.optimizer(lr=1e-2)
    path = tmp_path / "step.json"
    x, y = _data(1)[0]
    model.step(x, targets=y, profile_path=str(path))
    opt.step()
    import json

    spans = [e for e in json.loads(path.read_text())["traceEvents"] if e["ph"] == "X"]
    adamw = {
        s["args"]["bucket"] for s in spans if s["cat"] == "host optimizer" and s["name"].startswith("adamw")
    }
    assert adamw == set(range(len(opt._engine.buckets)))  # every chunk's update, in the step's trace
    assert {s["name"] for s in spans if s["cat"] == "h2d"} >= {f"load {i}" for i in range(1, 5)}
    model.close()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("keep", KEEPS)
def test_a_hand_run_backward_goes_to_the_host_optimizer_too(device, keep):
    """loss.backward() on model(x) (not model.step()): the engine's hooks take the gradients."""
    chunks = _chunks()
    ref = Reference(chunks, device)
    model = ramstream.OffloadModel(chunks, device=device, pin=1, keep_activations=keep)
    opt = model.optimizer(_groups(list(model.parameters())), lr=1e-2)
    for x, y in _data(3):
        F.mse_loss(model(x.to(device)), y.to(device)).backward()
        opt.step()
        opt.zero_grad()
    _run_ref(ref, _data(3))
    _assert_weights(ref, model, opt)
    model.close()
