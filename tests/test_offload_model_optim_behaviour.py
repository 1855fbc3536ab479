"""OffloadModel's host optimizer, behaviour: each chunk's update is queued during the backward
and loads wait for it; a failed step leaves weights and optimizer state as before it (or, with
eager updates in a failed backward, keeps the updates that ran and says so); zero_grad(); bad
arguments; close() and garbage collection; the traced step; a hand-run backward."""

from __future__ import annotations

import gc
import warnings
import weakref

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import ramstream

from _offload_optim_ref import (
    Fail,
    Reference,
    assert_same_state,
    assert_weights,
    make_chunks,
    make_data,
    run,
    run_ref,
    snapshot,
    two_groups,
)

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)]
KEEPS = [True, False, "checkpoint"]


def test_updates_overlap_the_backward_and_loads_wait_for_them():
    """Each streamed chunk's update is queued during the backward (its gradients complete); the
    next forward's load waits for it; evicting a chunk in backward does not wait for its update."""
    chunks = make_chunks(frozen_bias=False)
    model = ramstream.OffloadModel(chunks, device="cpu", window=2)
    opt = model.optimizer(lr=1e-2)
    e = opt._engine
    queued = []  # buckets with an update queued when chunk 0's backward starts (it runs last)

    def count(module, args, out):
        out.register_hook(lambda g: queued.append(sum(b.pending for b in e.buckets)))

    model.chunks[0].register_forward_hook(count)
    (x, y), (x2, y2) = make_data(2)
    model.step(x, targets=y)
    assert len(e.buckets) == 5 and queued == [4]  # chunks 1-4 were being updated already
    assert opt.stats()["eager_updates"] == len(e.buckets)
    opt.step()
    waits = opt.stats()["waits"]
    model.step(x2, targets=y2)  # every load waited for its chunk's update (Block.ready)
    assert opt.stats()["waits"] == waits + len(e.buckets)
    model.close()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(
    "where, eager",
    [("forward", True), ("loss", True), ("backward", False), ("forward", False)],
)
def test_failed_step_leaves_weights_and_state_as_before(device, where, eager):
    chunks = make_chunks(2, frozen_bias=False) + [Fail()] + make_chunks(2, frozen_bias=False)
    ref = Reference(chunks, device, groups=lambda ps: [{"params": ps}])
    model = ramstream.OffloadModel(chunks, device=device, pin_layers=[3])
    opt = model.optimizer(lr=1e-2, eager_updates=eager)
    data = make_data(3)
    run(model, opt, data[:1])
    run_ref(ref, data[:1])
    before = snapshot(model, opt)
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
    assert_same_state(before, snapshot(model, opt))
    assert model.streamer.loaded_bytes() == 0
    run(model, opt, data[1:])  # training goes on exactly as if the failed step never was
    run_ref(ref, data[1:])
    assert_weights(ref, model, opt)
    model.close()


def test_failed_micro_batch_of_an_accumulation():
    """accumulation_steps=2: a second micro-batch that raises in its forward keeps the first one
    (the step then equals torch's over both); one that raises in its backward drops the
    accumulation window (RuntimeWarning), weights and state unchanged (eager_updates=False)."""
    chunks = make_chunks(2, frozen_bias=False) + [Fail()] + make_chunks(2, frozen_bias=False)
    ref = Reference(chunks, "cpu", groups=lambda ps: [{"params": ps}])
    model = ramstream.OffloadModel(chunks, device="cpu", pin=1)
    opt = model.optimizer(lr=1e-2, accumulation_steps=2, eager_updates=False)
    (x1, y1), (x2, y2), (x3, y3) = make_data(3)
    model.step(x1, targets=y1)
    model.chunks[2].where = "forward"
    with pytest.raises(RuntimeError, match="boom"):
        model.step(x2, targets=y2)
    model.step(x2, targets=y2)
    opt.step()
    opt.zero_grad()
    ref.backward(x1, y1)
    ref.backward(x2, y2)
    ref.step()
    assert_weights(ref, model, opt)
    before = snapshot(model, opt)
    model.step(x3, targets=y3)
    model.chunks[2].where = "backward"
    with (
        pytest.raises(RuntimeError, match="boom"),
        pytest.warns(RuntimeWarning, match="1 earlier micro-batch"),
    ):
        model.step(x1, targets=y1)
    opt.step()  # nothing left to apply
    assert_same_state(before, snapshot(model, opt))
    model.close()


def test_failed_backward_with_eager_updates_keeps_the_updates_that_ran_and_says_so():
    chunks = make_chunks(2, frozen_bias=False) + [Fail()] + make_chunks(2, frozen_bias=False)
    model = ramstream.OffloadModel(chunks, device="cpu")
    opt = model.optimizer(lr=1e-2)
    before = snapshot(model, opt)
    model.chunks[2].where = "backward"
    with pytest.raises(RuntimeError, match="boom"), pytest.warns(RuntimeWarning, match="keep it"):
        model.step(*make_data(1)[0])
    after = snapshot(model, opt)
    # the chunks after the failing one (their backward ran first) were updated, the others not
    changed = iter([not torch.equal(a, b) for a, b in zip(before[0], after[0])])
    per_chunk = [any([next(changed) for _ in c.parameters()]) for c in model.chunks]
    assert per_chunk[3:] == [True, True] and per_chunk[:3] == [False, False, False]
    run(model, opt, make_data(2))  # and the next steps run
    model.close()


@pytest.mark.parametrize("device", DEVICES)
def test_zero_grad_between_step_and_opt_step_drops_the_gradients(device):
    """With updates at opt.step() (eager_updates=False), zero_grad() drops what model.step()
    gathered, as torch: the next opt.step() changes nothing."""
    chunks = make_chunks()
    model = ramstream.OffloadModel(chunks, device=device, pin=2)
    opt = model.optimizer(lr=1e-2, eager_updates=False)
    data = make_data(3)
    run(model, opt, data[:1])
    before = snapshot(model, opt)
    model.step(*(t.to(device) for t in data[1]))
    opt.zero_grad()
    opt.step()
    assert_same_state(before, snapshot(model, opt))
    # with eager updates the update already ran: zero_grad() warns that it stays
    model2 = ramstream.OffloadModel(make_chunks(), device=device)
    opt2 = model2.optimizer(lr=1e-2)
    model2.step(*(t.to(device) for t in data[1]))
    with pytest.warns(RuntimeWarning, match="keep it"):
        opt2.zero_grad()
    model.close()
    model2.close()


def test_bad_arguments_name_what_is_accepted():
    model = ramstream.OffloadModel(make_chunks(), device="cpu")
    model.step(*make_data(1)[0])  # gradients at home, which a refused optimizer must not touch
    grads = [None if p.grad is None else p.grad.clone() for p in model.parameters()]
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
    # a refused optimizer leaves the model as it was: its gradients, and a torch optimizer trains it
    for p, g in zip(model.parameters(), grads):
        assert (p.grad is None) == (g is None) and (g is None or torch.equal(p.grad, g))
    torch_opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    torch_opt.step()
    model.step(*make_data(1)[0])
    opt = model.optimizer()
    assert all(p.grad is None for p in model.parameters())  # it starts with nothing gathered
    with pytest.raises(ValueError, match="already has a host optimizer"):
        model.optimizer()
    with pytest.raises(ValueError, match="set_pinned"):
        model.set_pinned([0])
    opt.close()
    model.close()


def test_close_gives_the_model_back_to_torch_optimizers():
    chunks = make_chunks()
    ref = Reference(chunks, "cpu")
    model = ramstream.OffloadModel(chunks, device="cpu", pin=1)
    opt = model.optimizer(two_groups(list(model.parameters())), lr=1e-2)
    data = make_data(4)
    run(model, opt, data[:2])
    sd = opt.state_dict()
    opt.close()
    with pytest.raises(RuntimeError, match="closed"):
        opt.step()
    # the model streams with its own slabs again: .grad at home, a torch AdamW steps it
    torch_opt = torch.optim.AdamW(two_groups(list(model.parameters())), lr=1e-2, fused=True)
    torch_opt.load_state_dict(sd)
    for g in torch_opt.param_groups:  # (the saved groups say fused=None)
        g["fused"] = True
    run(model, torch_opt, data[2:])
    run_ref(ref, data)
    for a, b in zip(ref.params, model.parameters()):
        assert torch.equal(a.detach(), b.detach())
    model.close()


def test_model_collected_without_close_closes_its_optimizer():
    chunks = make_chunks()
    model = ramstream.OffloadModel(chunks, device="cpu")
    opt = model.optimizer(lr=1e-2)
    run(model, opt, make_data(2))
    ref = weakref.ref(model)
    del model
    gc.collect()
    assert ref() is None
    with pytest.raises(RuntimeError, match="closed"):
        opt.step()
    assert all(len(c._forward_pre_hooks) == 0 for c in chunks)
    # and the optimizer dropped first: the model (holding it) trains on
    model = ramstream.OffloadModel(make_chunks(), device="cpu")
    opt = model.optimizer(lr=1e-2)
    oref = weakref.ref(opt)
    del opt
    gc.collect()
    assert oref() is not None
    model.step(*make_data(1)[0])
    opt = oref()
    opt.step()
    model.close()
    assert opt._closed


def test_traced_step_shows_the_host_updates(tmp_path):
    model = ramstream.OffloadModel(make_chunks(), device="cpu", pin=1)
    opt = model.optimizer(lr=1e-2)
    path = tmp_path / "step.json"
    x, y = make_data(1)[0]
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
    chunks = make_chunks()
    ref = Reference(chunks, device)
    model = ramstream.OffloadModel(chunks, device=device, pin=1, keep_activations=keep)
    opt = model.optimizer(two_groups(list(model.parameters())), lr=1e-2)
    for x, y in make_data(3):
        F.mse_loss(model(x.to(device)), y.to(device)).backward()
        opt.step()
        opt.zero_grad()
    run_ref(ref, make_data(3))
    assert_weights(ref, model, opt)
    model.close()


def test_parameters_outside_the_optimizer_keep_their_grad_at_home():
    """Trained parameters the host optimizer does not hold get `.grad` at home (GradWriteback),
    as without it; the optimizer's own never do."""
    chunks = make_chunks(frozen_bias=False)
    ref = Reference(chunks, "cpu")
    model = ramstream.OffloadModel(chunks, device="cpu", pin=1)
    left_out = list(model.chunks[2].parameters())
    held = [p for p in model.parameters() if all(p is not q for q in left_out)]
    opt = model.optimizer(held, lr=1e-2)
    x, y = make_data(1)[0]
    model.step(x, targets=y)
    opt.step()
    ref.backward(x, y)
    ref_grads = [p.grad.clone() for p in ref.model[2].parameters()]
    for p, g in zip(left_out, ref_grads):
        assert p.device.type == "cpu" and torch.equal(p.grad, g)
    assert all(p.grad is None for p in held)
    model.close()


@pytest.mark.parametrize("device", DEVICES)
def test_memory_flat_over_many_steps(device):
    """No tensor, pinned byte or RSS growth over 60 steps with the host optimizer (pinned chunk
    included), and nothing of a streamed chunk left on the device between steps."""

    def tensors() -> int:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return sum(1 for o in gc.get_objects() if isinstance(o, torch.Tensor))

    def rss() -> int:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * 4096

    model = ramstream.OffloadModel(make_chunks(), device=device, pin=1, keep_activations="checkpoint")
    opt = model.optimizer(two_groups(list(model.parameters())), lr=1e-3)
    data = [(x.to(device), y.to(device)) for x, y in make_data(2)]
    run(model, opt, data * 5)
    opt.synchronize()
    gc.collect()
    n, r, pinned = tensors(), rss(), ramstream.memory_stats()["bytes_in_use"]
    run(model, opt, data * 30)
    opt.synchronize()
    gc.collect()
    assert tensors() == n and ramstream.memory_stats()["bytes_in_use"] == pinned
    assert rss() - r < 16 << 20, (r, rss())
    assert model.streamer.loaded_bytes() == 0
    model.close()
