"""OffloadModel's host optimizer (model.optimizer(), ramstream/frontends/offload_model/optim.py) against
torch.optim.AdamW(fused=True) run on the same chunks resident (fp32 masters on the host, where
the host optimizer keeps them): bit-identical weights over 5 steps with several param groups,
weight decay, a frozen parameter, pinned chunks and every keep_activations mode, eager or at
opt.step(); accumulation; an LR scheduler; state dicts in torch's format both ways; clipping;
bf16 moments and a bf16 model; bf16 autocast; ramstream.wrap(offload_model, torch AdamW)."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

import ramstream

from _offload_optim_ref import (
    Reference,
    assert_weights,
    make_chunks,
    make_data,
    run,
    run_ref,
    two_groups,
)

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)]
KEEPS = [True, False, "checkpoint"]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("keep", KEEPS)
@pytest.mark.parametrize("pin_layers", [None, [0, 3]], ids=["streamed", "pinned-0-3"])
@pytest.mark.parametrize("eager", [True, False], ids=["eager", "at-step"])
def test_five_steps_bit_identical_to_torch_adamw(device, keep, pin_layers, eager):
    chunks = make_chunks()
    ref = Reference(chunks, device)
    model = ramstream.OffloadModel(
        chunks, device=device, window=2, pin_layers=pin_layers, keep_activations=keep
    )
    opt = model.optimizer(two_groups(list(model.parameters())), lr=1e-2, eager_updates=eager)
    data = make_data(5)
    run(model, opt, data)
    run_ref(ref, data)
    assert_weights(ref, model, opt)
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


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("eager", [True, False], ids=["eager", "at-step"])
def test_accumulation_equals_torchs_summed_gradients(device, eager):
    chunks = make_chunks()
    ref = Reference(chunks, device)
    model = ramstream.OffloadModel(chunks, device=device, pin=1, keep_activations="checkpoint")
    opt = model.optimizer(
        two_groups(list(model.parameters())), lr=1e-2, accumulation_steps=3, eager_updates=eager
    )
    data = make_data(9)
    run(model, opt, data, accumulation=3)
    run_ref(ref, data, accumulation=3)
    assert_weights(ref, model, opt)
    # opt.step() after fewer micro-batches than declared (an epoch's end) is exact too
    model.step(*(t.to(device) for t in data[0]))
    opt.step()
    ref.backward(*data[0])
    ref.step()
    assert_weights(ref, model, opt)
    # one model.step() more than declared before opt.step(): refused, naming the option; the
    # micro-batches before it stay gathered
    for x, y in data[:3]:
        model.step(x.to(device), targets=y.to(device))
        ref.backward(x, y)
    with pytest.raises(RuntimeError, match="accumulation_steps=3"):
        model.step(*(t.to(device) for t in data[3]))
    opt.step()
    ref.step()
    assert_weights(ref, model, opt)
    model.close()


def test_lr_scheduler_and_param_group_changes():
    chunks = make_chunks()
    ref = Reference(chunks, "cpu")
    model = ramstream.OffloadModel(chunks, device="cpu", pin=1)
    opt = model.optimizer(two_groups(list(model.parameters())), lr=1e-2)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))
    ref_sched = torch.optim.lr_scheduler.LambdaLR(ref.opt, lambda s: 1.0 / (1 + s))
    data = make_data(5)
    run(model, opt, data[:3], scheduler=sched)
    run_ref(ref, data[:3], scheduler=ref_sched)
    assert [g["lr"] for g in opt.param_groups] == [g["lr"] for g in ref.opt.param_groups]
    for g, rg in zip(opt.param_groups, ref.opt.param_groups):  # a change between steps
        g["weight_decay"] = rg["weight_decay"] = 0.3
    run(model, opt, data[3:], scheduler=sched)
    run_ref(ref, data[3:], scheduler=ref_sched)
    assert_weights(ref, model, opt)
    model.close()


def test_state_dict_round_trip_in_torchs_format():
    chunks = make_chunks()
    data = make_data(5)
    ref = Reference(chunks, "cpu")
    run_ref(ref, data)  # 5 uninterrupted steps
    # 3 steps with ramstream, resumed in torch's AdamW for 2
    model = ramstream.OffloadModel(copy.deepcopy(chunks), device="cpu", pin=1)
    opt = model.optimizer(two_groups(list(model.parameters())), lr=1e-2)
    run(model, opt, data[:3])
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
    run_ref(mid, data[3:])
    for a, b in zip(ref.params, mid.params):
        assert torch.equal(a, b)
    # torch's state dict (3 steps) into a fresh host optimizer, 2 more steps there
    part = Reference(chunks, "cpu")
    run_ref(part, data[:3])
    model2 = ramstream.OffloadModel(copy.deepcopy(chunks), device="cpu", window=1)
    model2.chunks.load_state_dict(part.model.state_dict())
    opt2 = model2.optimizer(two_groups(list(model2.parameters())), lr=1e-2)
    opt2.load_state_dict(part.opt.state_dict())
    run(model2, opt2, data[3:])
    assert_weights(ref, model2, opt2)
    # a checkpoint loaded into a model whose host optimizer trained on: the masters follow
    model3 = ramstream.OffloadModel(copy.deepcopy(chunks), device="cpu", pin=2)
    opt3 = model3.optimizer(two_groups(list(model3.parameters())), lr=1e-2)
    run(model3, opt3, data[4:])
    model3.load_state_dict({"chunks." + k: v for k, v in part.model.state_dict().items()})
    opt3.load_state_dict(part.opt.state_dict())
    run(model3, opt3, data[3:])
    assert_weights(ref, model3, opt3)
    for m in (model, model2, model3):
        m.close()


def test_max_grad_norm_equals_torchs_clipping():
    chunks = make_chunks()
    ref = Reference(chunks, "cpu", clip=0.5)
    model = ramstream.OffloadModel(chunks, device="cpu", pin=1)
    opt = model.optimizer(two_groups(list(model.parameters())), lr=1e-2, max_grad_norm=0.5)
    data = make_data(4)
    run(model, opt, data)
    run_ref(ref, data)
    opt.synchronize()
    assert opt.stats()["eager_updates"] == 0  # the updates waited for the global norm
    for a, b in zip(ref.params, model.parameters()):
        torch.testing.assert_close(a.detach(), b.detach(), rtol=0, atol=1e-6)
    assert opt._engine.last_grad_norm > 0.5  # the last step was clipped
    model.close()


def test_torchs_clip_grad_norm_between_step_and_opt_step():
    """torch.nn.utils.clip_grad_norm_(model.parameters(), n) after model.step() clips by the true
    global norm when the updates wait for opt.step() (eager_updates=False); with eager updates
    (they ran in the backward) it raises, naming the options."""
    chunks = make_chunks()
    ref = Reference(chunks, "cpu", clip=0.5)
    model = ramstream.OffloadModel(chunks, device="cpu", pin=1)
    opt = model.optimizer(two_groups(list(model.parameters())), lr=1e-2, eager_updates=False)
    for x, y in make_data(3):
        model.step(x, targets=y)
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
        opt.step()
        opt.zero_grad()
        ref.backward(x, y)
        ref_norm = torch.linalg.vector_norm(
            torch.stack([p.grad.norm() for p in ref.params if p.grad is not None])
        )
        ref.step()
        assert float(norm) == pytest.approx(float(ref_norm), rel=1e-5) and float(ref_norm) > 0.5
    opt.synchronize()
    for a, b in zip(ref.params, model.parameters()):
        torch.testing.assert_close(a.detach(), b.detach(), rtol=0, atol=1e-6)
    eager = ramstream.OffloadModel(make_chunks(), device="cpu")
    eager_opt = eager.optimizer(lr=1e-2)
    eager.step(*make_data(1)[0])
    with pytest.raises(RuntimeError, match="max_grad_norm=.*eager_updates=False"):
        torch.nn.utils.clip_grad_norm_(eager.parameters(), 0.5)
    eager_opt.step()
    model.close()
    eager.close()


def test_bfloat16_moments_train_close_to_fp32():
    chunks = make_chunks()
    ref = Reference(chunks, "cpu")
    model = ramstream.OffloadModel(chunks, device="cpu")
    opt = model.optimizer(two_groups(list(model.parameters())), lr=1e-2, moment_dtype="bfloat16")
    data = make_data(5)
    run(model, opt, data)
    run_ref(ref, data)
    opt.synchronize()
    diff = max((a.detach() - b.detach()).abs().max().item() for a, b in zip(ref.params, model.parameters()))
    assert 0 < diff < 1e-2  # not the fp32 result, but close to it


def test_fp32_home_is_its_own_master_and_bf16_weights_round_the_fp32_master():
    """A streamed fp32 bucket's pinned home is the master the host AdamW updates in place (one
    copy in RAM); a bf16 model keeps fp32 masters and its weights are their rounding, as torch's
    AdamW on fp32 master copies with the bf16 gradients gives."""
    model = ramstream.OffloadModel(make_chunks(), device="cpu", pin=1)
    opt = model.optimizer(lr=1e-2)
    streamed = [b for b in opt._engine.buckets if b.streamed]
    assert streamed and all(b.master.data_ptr() == b.slab.home.data_ptr() for b in streamed)
    resident = [b for b in opt._engine.buckets if not b.streamed]
    assert resident and all(b.master.data_ptr() != b.device_flat.data_ptr() for b in resident)
    model.close()

    chunks = [c.to(torch.bfloat16) for c in make_chunks(frozen_bias=False)]
    ref = Reference(chunks, "cpu", groups=lambda ps: [{"params": ps}])
    model = ramstream.OffloadModel(chunks, device="cpu", pin=1)
    opt = model.optimizer(lr=1e-2)
    data = [(x.bfloat16(), y.bfloat16()) for x, y in make_data(4)]
    run(model, opt, data)
    run_ref(ref, data)  # (Reference: fp32 masters, grads cast exactly, weights = masters' rounding)
    assert_weights(ref, model, opt)
    masters = opt.master_weights()
    for m, r in zip(masters, ref.masters):
        assert m.dtype == torch.float32 and torch.equal(m, r.detach())
    model.close()


def test_wrap_of_an_offload_model_and_a_torch_adamw_gives_its_host_optimizer():
    """ramstream.wrap(offload_model, torch.optim.AdamW(...)) returns (the model, its host
    optimizer) over the torch optimizer's groups (an LR scheduler made on it before keeps
    working) and state (here: one step taken with torch's AdamW first)."""
    chunks = make_chunks()
    data = make_data(5)
    ref = Reference(chunks, "cpu")
    ref_sched = torch.optim.lr_scheduler.StepLR(ref.opt, step_size=2, gamma=0.5)
    run_ref(ref, data, scheduler=ref_sched)
    model = ramstream.OffloadModel(chunks, device="cpu", pin=1)
    torch_opt = torch.optim.AdamW(two_groups(list(model.parameters())), lr=1e-2, fused=True)
    sched = torch.optim.lr_scheduler.StepLR(torch_opt, step_size=2, gamma=0.5)
    run(model, torch_opt, data[:1], scheduler=sched)  # a step with torch's AdamW over the homes
    same, opt = ramstream.wrap(model, torch_opt, accumulation_steps=1)
    assert same is model and opt is model._hooks.host_opt and not torch_opt.state
    run(model, opt, data[1:], scheduler=sched)
    assert_weights(ref, model, opt)
    assert opt.param_groups[1]["lr"] == ref.opt.param_groups[1]["lr"] == 5e-3 * 0.25
    with pytest.raises(
        ValueError, match="do not apply to an OffloadModel.*accepted with an OffloadModel: lr"
    ):
        ramstream.wrap(ramstream.OffloadModel(make_chunks(), device="cpu"), param_offload=True)
    with pytest.raises(ValueError, match="already an OffloadModel's host optimizer"):
        ramstream.wrap(model, opt)
    model.close()


@pytest.mark.parametrize("device", DEVICES)
def test_bf16_autocast_with_kept_activations(device):
    chunks = make_chunks()
    ref = Reference(chunks, device)
    model = ramstream.OffloadModel(chunks, device=device, keep_activations=True)
    opt = model.optimizer(two_groups(list(model.parameters())), lr=1e-2)
    for x, y in make_data(3):
        with torch.autocast(torch.device(device).type, dtype=torch.bfloat16):
            model.step(x.to(device), targets=y.to(device), loss_fn=lambda o, t: F.mse_loss(o.float(), t))
            F.mse_loss(ref.model(x.to(device)).float(), y.to(device)).backward()
        opt.step()
        opt.zero_grad()
        ref.step()
    assert_weights(ref, model, opt)
    assert model.stats["casts_dropped"] > 0  # the kept graph held no weight casts
    model.close()
