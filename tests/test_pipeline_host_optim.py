"""Pipeline.optimizer() (pipeline/host_optim.py): the host AdamW over a pipeline's streamed chunks,
each chunk updated during the backward once its gradient of the step is complete. Against torch:
the unsplit chunks over the same microbatches, torch.optim.AdamW(fused=True) on fp32 masters on
the host (_offload_optim_ref.Reference): bit-identical weights over several steps, with two param
groups, a frozen parameter, kept or recomputed activations, eager or at opt.step(). Then: what it
refuses (naming the way out), a failing step, close() handing the stages back."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from ramstream import Pipeline

from _offload_optim_ref import Reference, make_chunks, make_data, two_groups
from _pipeline_helpers import Boom, run_with_timeout

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)]
N = 4  # microbatches per step


def _pipe(chunks, device, **kw):
    opts = dict(offload_window=2, offload_pin=0)
    opts.update(kw)
    return Pipeline(stage_modules=[chunks[:3], chunks[3:]], devices=[device] * 2, **opts)


def _ref_step(ref: Reference, x, y) -> None:
    """The unsplit chunks over the pipeline's microbatches (loss / N each), then torch's AdamW."""
    for xm, ym in zip(x.tensor_split(N), y.tensor_split(N)):
        (F.mse_loss(ref.model(xm.to(ref.device)), ym.to(ref.device)) / N).backward()
    ref.step()


def _step(pipe, opt, x, y, **kw):
    dev = pipe.devices[0]
    res = run_with_timeout(
        lambda: pipe.step(
            x.to(dev), targets=y.to(dev), loss_fn=F.mse_loss, n_microbatches=N, schedule="gpipe", **kw
        )
    )
    opt.step()
    opt.zero_grad()
    return res


def _assert_equal(ref: Reference, chunks, opt) -> None:
    opt.synchronize()
    mine = [p for c in chunks for p in c.parameters()]
    for i, (a, b) in enumerate(zip(ref.params, mine)):
        assert torch.equal(a.detach().cpu(), b.detach().cpu()), f"parameter {i} differs"


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("keep", [True, "checkpoint"])
@pytest.mark.parametrize("eager", [True, False], ids=["eager", "at-step"])
def test_steps_bit_identical_to_torch_adamw(device, keep, eager):
    chunks = make_chunks()
    ref = Reference(chunks, device)
    pipe = _pipe(chunks, device, offload_keep_activations=keep)
    opt = pipe.optimizer(two_groups(list(pipe.parameters())), lr=1e-2, eager_updates=eager)
    for x, y in make_data(4, seed=3):
        x, y = torch.cat([x, x.flip(0)]), torch.cat([y, -y])  # 8 rows: 2 per microbatch
        _step(pipe, opt, x, y)
        _ref_step(ref, x, y)
    _assert_equal(ref, chunks, opt)
    st = opt.stats()
    assert st["steps"] == 4 and (st["eager_updates"] > 0) == eager
    assert all(p.grad is None for p in pipe.parameters())  # the engine took every gradient
    frozen = chunks[1][0].bias
    order = [p for g in opt.param_groups for p in g["params"]]
    assert set(opt.state_dict()["state"]) == {i for i, p in enumerate(order) if p is not frozen}
    assert all(p.device.type == "cpu" for p in pipe.parameters())  # at home between steps
    pipe.close()


def test_one_microbatch_runs_any_schedule_and_close_hands_the_stages_back():
    chunks = make_chunks()
    ref = Reference(chunks, "cpu")
    pipe = _pipe(chunks, "cpu")
    opt = pipe.optimizer(two_groups(list(pipe.parameters())), lr=1e-2)
    for x, y in make_data(2, seed=5):
        run_with_timeout(lambda: pipe.step(x, targets=y, loss_fn=F.mse_loss, n_microbatches=1))  # 1f1b
        opt.step()
        ref.backward(x, y)
        ref.step()
    _assert_equal(ref, chunks, opt)
    opt.close()
    assert pipe._host_opt is None
    # a torch optimizer over the same parameters takes over from the same weights
    torch_opt = torch.optim.AdamW(two_groups(list(pipe.parameters())), lr=1e-2, fused=True)
    x, y = make_data(1, seed=9)[0]
    run_with_timeout(lambda: pipe.step(x, targets=y, loss_fn=F.mse_loss, n_microbatches=1))
    assert all(p.grad is not None for p in pipe.parameters() if p.requires_grad)
    torch_opt.step()
    pipe.close()


def test_what_it_refuses_names_the_way_out():
    chunks = make_chunks()
    pipe = _pipe(chunks, "cpu")
    with pytest.raises(ValueError, match="unknown option.*bogus"):
        pipe.optimizer(bogus=1)
    with pytest.raises(TypeError, match="Pipeline.optimizer: params must be"):
        pipe.optimizer(torch.zeros(3))
    stream = pipe.infer_open()  # holds the pipeline: the stages are not rebuilt under it
    with pytest.raises(RuntimeError, match="between steps"):
        pipe.optimizer()
    stream.close()
    opt = pipe.optimizer(lr=1e-2)
    with pytest.raises(ValueError, match="already has a host optimizer"):
        pipe.optimizer()
    x, y = make_data(1)[0]
    before = [p.detach().clone() for p in pipe.parameters()]
    with pytest.raises(ValueError, match="schedule='gpipe'"):
        pipe.step(x, targets=y, loss_fn=F.mse_loss, n_microbatches=2, schedule="1f1b")
    with pytest.raises(ValueError, match="takes the gradients"):
        pipe.flush_grads(0.5)
    with pytest.raises(ValueError, match="host optimizer"):
        pipe.set_offload_pinned({0: [0]})
    assert all(torch.equal(a, b) for a, b in zip(before, pipe.parameters()))
    run_with_timeout(lambda: pipe.step(x, targets=y, loss_fn=F.mse_loss, n_microbatches=2, schedule="gpipe"))
    opt.step()
    pipe.close()
    assert opt._closed
    # outside its scope: a pinned chunk, a resident stage
    for kw in (dict(offload_pin=1), dict(offload=False)):
        other = _pipe(make_chunks(), "cpu", **kw)
        with pytest.raises(ValueError, match="not in a streamed chunk"):
            other.optimizer()
        other.close()


@pytest.mark.parametrize("where", ["forward", "backward"])
def test_a_failing_step_leaves_weights_and_state_and_the_next_is_exact(where):
    """eager_updates=False: nothing is updated before opt.step(), so a step that raises in a
    stage's forward or backward leaves every weight and the optimizer's state as they were."""
    chunks = make_chunks()
    boom = Boom()
    chunks[4].append(boom)  # in the second stage's last chunk
    ref = Reference(chunks, "cpu")
    pipe = _pipe(chunks, "cpu")
    opt = pipe.optimizer(two_groups(list(pipe.parameters())), lr=1e-2, eager_updates=False)
    data = [(torch.cat([x, x]), torch.cat([y, y])) for x, y in make_data(3, seed=7)]
    _step(pipe, opt, *data[0])
    _ref_step(ref, *data[0])
    weights = [p.detach().clone() for p in pipe.parameters()]
    state = opt.state_dict()
    boom.calls = 0
    boom.forward_at = 2 if where == "forward" else None
    boom.backward_armed = where == "backward"
    with pytest.raises(RuntimeError, match=f"boom in {where}"):
        _step(pipe, opt, *data[1])
    assert all(torch.equal(a, b) for a, b in zip(weights, pipe.parameters()))
    after = opt.state_dict()
    for k, v in state["state"].items():
        assert all(torch.equal(v[n], after["state"][k][n]) for n in ("exp_avg", "exp_avg_sq", "step"))
    boom.forward_at, boom.backward_armed = None, False
    _step(pipe, opt, *data[2])  # the failed step is as if it never ran
    _ref_step(ref, *data[2])
    _assert_equal(ref, chunks, opt)
    pipe.close()


def test_eager_updates_that_ran_before_a_backward_raised_are_kept_and_said():
    """Default eager_updates: the second stage's chunks are updated during the backward before the
    first stage's backward raises; those updates stay (the engine cannot undo them), a
    RuntimeWarning says so, the rest is dropped and the next step runs."""
    chunks = make_chunks()
    boom = Boom()
    chunks[0].append(boom)  # the first stage's first chunk: its backward runs last
    pipe = _pipe(chunks, "cpu")
    opt = pipe.optimizer(lr=1e-2)
    x, y = (torch.cat([t, t]) for t in make_data(1, seed=11)[0])
    first = [p.detach().clone() for p in chunks[0].parameters()]
    last = [p.detach().clone() for p in chunks[4].parameters()]
    boom.backward_armed = True
    with pytest.warns(RuntimeWarning, match="already taken their update"):
        with pytest.raises(RuntimeError, match="boom in backward"):
            _step(pipe, opt, x, y)
    opt.synchronize()
    assert all(torch.equal(a, b) for a, b in zip(first, chunks[0].parameters()))  # dropped
    assert not all(torch.equal(a, b) for a, b in zip(last, chunks[4].parameters()))  # kept
    boom.backward_armed = False
    _step(pipe, opt, x, y)
    assert opt.stats()["steps"] == 1
    pipe.close()


def test_accumulation_and_clipping_as_torch():
    """accumulation_steps=2: two pipe.step()s per opt.step(), each step's gradient (the sum over its
    microbatches) added on the host in fp32, as torch adds the two steps' sums: bit-identical.
    max_grad_norm: the updates wait for the global norm, as torch's clip_grad_norm_ scales them
    (the norm summed in another order: within 1e-6). The state dict goes back in."""
    data = [(torch.cat([x, x.flip(0)]), torch.cat([y, -y])) for x, y in make_data(4, seed=3)]
    chunks = make_chunks()
    ref = Reference(chunks, "cpu")
    pipe = _pipe(chunks, "cpu")
    opt = pipe.optimizer(two_groups(list(pipe.parameters())), lr=1e-2, accumulation_steps=2)
    for pair in (data[:2], data[2:]):
        sums = []
        for x, y in pair:
            run_with_timeout(
                lambda: pipe.step(x, targets=y, loss_fn=F.mse_loss, n_microbatches=N, schedule="gpipe")
            )
            for xm, ym in zip(x.tensor_split(N), y.tensor_split(N)):
                (F.mse_loss(ref.model(xm), ym) / N).backward()
            sums.append([p.grad for p in ref.params])
            for p in ref.params:
                p.grad = None
        for p, a, b in zip(ref.params, *sums):
            p.grad = None if a is None else a.add_(b)
        opt.step()
        ref.step()
    _assert_equal(ref, chunks, opt)
    pipe.close()

    chunks = make_chunks()
    ref = Reference(chunks, "cpu", clip=0.05)
    pipe = _pipe(chunks, "cpu")
    opt = pipe.optimizer(two_groups(list(pipe.parameters())), lr=1e-2, max_grad_norm=0.05)
    for x, y in data[:3]:
        _step(pipe, opt, x, y)
        _ref_step(ref, x, y)
    opt.synchronize()
    assert opt.stats()["eager_updates"] == 0 and opt._engine.last_grad_norm > 0.05
    for a, b in zip(ref.params, (p for c in chunks for p in c.parameters())):
        torch.testing.assert_close(a.detach(), b.detach(), rtol=0, atol=1e-6)
    state = opt.state_dict()
    opt.load_state_dict(state)
    again = opt.state_dict()
    assert state["state"].keys() == again["state"].keys()
    for k, v in state["state"].items():
        assert all(torch.equal(v[n], again["state"][k][n]) for n in ("exp_avg", "exp_avg_sq", "step"))
    pipe.close()
