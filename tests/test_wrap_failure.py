"""A backward pass that raises part-way: what the engine keeps, what it discards, and that
training goes on exactly as if the failed batch had never been seen (where updates wait for
step()), compared bit for bit with the same run without the failure."""

from __future__ import annotations

import warnings

import pytest
import torch

import ramstream

from _models import Boom as _Boom
from _models import batches, make_model


def _wrapped(device="cpu", **options):
    model = make_model(0, n_blocks=3).to(device)
    # block 0's output: its backward runs after the head's and blocks 1-2's gradients landed
    model.blocks[0].register_forward_hook(lambda m, i, out: _Boom.apply(out))
    return ramstream.wrap(
        model,
        torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.05),
        device=device,
        bucket_bytes=1 << 14,
        **options,
    )


def _snapshot(opt):
    sd = opt.state_dict()["state"]
    return (
        [m.clone() for m in opt.master_weights()],
        {k: (v["exp_avg"].clone(), v["exp_avg_sq"].clone(), float(v["step"])) for k, v in sd.items()},
    )


def _train(model, opt, data, accumulation):
    for i in range(0, len(data), accumulation):
        for x, y in data[i : i + accumulation]:
            model(x, y).backward()
        opt.step()
        opt.zero_grad()


def _fail_once(model, opt, micro_ok, bad):
    """micro-batches that succeed, then one whose backward raises; the user skips the step."""
    for x, y in micro_ok:
        model(x, y).backward()
    _Boom.armed = True
    try:
        with pytest.raises(RuntimeError, match="injected failure"):
            model(*bad).backward()
    finally:
        _Boom.armed = False
    opt.zero_grad()


@pytest.mark.parametrize(
    "options, ok_micro",
    [
        (dict(max_grad_norm=0.5), 0),
        (dict(accumulation_steps=2), 0),  # not the last micro-batch: no update yet
        (dict(accumulation_steps=2, max_grad_norm=0.5), 1),
        (dict(eager_updates=False), 0),
        (dict(accumulation_steps=2, eager_updates=False), 1),
    ],
    ids=["clip", "accumulate-first", "accumulate-last+clip", "deferred", "accumulate-last+deferred"],
)
def test_failed_backward_leaves_weights_and_state_untouched(options, ok_micro):
    _check_untouched_and_resumes("cpu", options, ok_micro)


@pytest.mark.cuda
@pytest.mark.parametrize("mode", ["cpu", "gpu"])
@pytest.mark.parametrize(
    "options, ok_micro",
    [(dict(max_grad_norm=0.5), 0), (dict(accumulation_steps=2, eager_updates=False), 1)],
    ids=["clip", "accumulate-last+deferred"],
)
def test_failed_backward_on_the_gpu(options, ok_micro, mode):
    torch.use_deterministic_algorithms(True, warn_only=True)  # embedding backward: atomics
    try:
        _check_untouched_and_resumes("cuda", dict(options, optimizer_mode=mode, offload=True), ok_micro)
    finally:
        torch.use_deterministic_algorithms(False)


def _check_untouched_and_resumes(device, options, ok_micro):
    k = options.get("accumulation_steps", 1)
    data = batches(4 * k + ok_micro + 1, b=4, device=device)
    before_fail, bad = data[: 2 * k], data[2 * k : 2 * k + ok_micro + 1]
    after = data[2 * k + ok_micro + 1 :]
    model, opt = _wrapped(device, **options)
    _train(model, opt, before_fail, k)
    snap = _snapshot(opt)
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # nothing had been updated: no warning
        _fail_once(model, opt, bad[:-1], bad[-1])  # the micro-batches before it go too
    now = _snapshot(opt)
    assert all(torch.equal(a, b) for a, b in zip(snap[0], now[0]))
    assert snap[1].keys() == now[1].keys()
    for key in snap[1]:
        assert all(torch.equal(a, b) for a, b in zip(snap[1][key][:2], now[1][key][:2]))
        assert snap[1][key][2] == now[1][key][2]
    _train(model, opt, after, k)

    ref_model, ref_opt = _wrapped(device, **options)  # the same run without the failed batch
    _train(ref_model, ref_opt, before_fail + after, k)
    for a, b in zip(opt.master_weights(), ref_opt.master_weights()):
        assert torch.equal(a, b)
    for a, b in zip(model.parameters(), ref_model.parameters()):
        assert torch.equal(a, b)
    assert "raised before its end" in "\n".join(ramstream.memory_report(model)["events"])


def test_eager_updates_that_ran_stay_and_are_reported():
    model, opt = _wrapped()
    data = batches(4, b=4)
    _train(model, opt, data[:2], 1)
    snap = _snapshot(opt)
    with pytest.warns(RuntimeWarning, match="already taken their update"):
        _fail_once(model, opt, [], data[2])
    now = _snapshot(opt)
    changed = [not torch.equal(a, b) for a, b in zip(snap[0], now[0])]
    names = [n for n, _ in model.named_parameters()]
    by_name = dict(zip(names, changed))
    # the gradients that never arrived (block 0, the tied embedding) changed nothing
    assert not any(v for n, v in by_name.items() if n.startswith(("blocks.0.", "emb.")))
    assert by_name["blocks.2.fc2.weight"]  # its bucket completed and stepped
    steps = {key: v[2] for key, v in now[1].items()}
    assert set(steps.values()) <= {2.0, 3.0} and 3.0 in steps.values() and 2.0 in steps.values()
    _train(model, opt, data[3:], 1)  # training goes on
    assert all(torch.isfinite(p).all() for p in model.parameters())
    assert {v[2] for v in _snapshot(opt)[1].values()} <= {3.0, 4.0}


def test_step_right_after_a_failed_backward_updates_nothing():
    model, opt = _wrapped(max_grad_norm=1.0)
    data = batches(3, b=4)
    _train(model, opt, data[:1], 1)
    snap = _snapshot(opt)
    _Boom.armed = True
    try:
        with pytest.raises(RuntimeError, match="injected failure"):
            model(*data[1]).backward()
    finally:
        _Boom.armed = False
    opt.step()  # the user steps anyway: nothing to apply
    now = _snapshot(opt)
    assert all(torch.equal(a, b) for a, b in zip(snap[0], now[0]))
    _train(model, opt, data[2:], 1)


def test_eager_updates_option_is_validated():
    with pytest.raises(ValueError, match="eager_updates"):
        ramstream.wrap(make_model(0), device="cpu", eager_updates="yes")
    with pytest.raises(ValueError, match="eager_updates"):
        ramstream.OffloadAdamW(make_model(0).parameters(), eager_updates=1)


def _checkpointed_forward(model, use_reentrant: bool):
    """model(x, y) with every block under torch.utils.checkpoint."""
    import torch.nn.functional as F
    from torch.utils.checkpoint import checkpoint

    def forward(idx, targets):
        x = model.emb(idx)
        for b in model.blocks:
            x = checkpoint(b, x, use_reentrant=use_reentrant)
        logits = model.head(model.ln_f(x))
        return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))

    return forward


@pytest.mark.parametrize("head_trains", [True, False])
def test_reentrant_checkpoint_raises_naming_the_fix_and_non_reentrant_trains(head_trains):
    """A reentrant checkpoint runs each block's backward as a nested backward pass; the engine
    says so (whether or not a gradient reached it before the first nested pass), the failed pass
    leaves nothing behind, and use_reentrant=False then trains exactly like torch."""
    model = make_model(0, n_blocks=2, tied=False)
    ref = make_model(0, n_blocks=2, tied=False)
    for m in (ref, model):
        m.head.weight.requires_grad_(head_trains)
        m.ln_f.requires_grad_(head_trains)
    model, opt = ramstream.wrap(model, torch.optim.AdamW(model.parameters(), lr=3e-3), eager_updates=False)
    before = [p.detach().clone() for p in model.parameters()]
    data = batches(4)
    x, y = data[0]
    with pytest.raises(RuntimeError, match="use_reentrant=False"):
        _checkpointed_forward(model, True)(x, y).backward()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        opt.zero_grad()
    assert all(torch.equal(a, p.detach()) for a, p in zip(before, model.parameters()))
    ropt = torch.optim.AdamW([p for p in ref.parameters() if p.requires_grad], lr=3e-3, foreach=False)
    for m, o in ((ref, ropt), (model, opt)):
        fwd = _checkpointed_forward(m, False)
        for x, y in data:
            fwd(x, y).backward()
            o.step()
            o.zero_grad()
    opt.synchronize()
    assert (
        max(
            float((a.detach() - b.detach()).abs().max()) for a, b in zip(ref.parameters(), model.parameters())
        )
        < 1e-5
    )


@pytest.mark.parametrize(
    "options",
    [dict(max_grad_norm=0.5), dict(eager_updates=False), dict(accumulation_steps=2)],
    ids=["clip", "deferred", "accumulate"],
)
def test_zero_grad_between_backward_and_step_skips_the_batch_like_torch(options):
    """The skip-this-batch pattern (a non-finite loss, say): backward, then zero_grad() and no
    step() drops that batch's gradients, in torch and here alike."""
    k = options.get("accumulation_steps", 1)
    data = batches(5 * k, b=4)
    skip = 2 * k  # the third window's first micro-batch

    def loop(model, opt):
        for i in range(0, len(data), k):
            for j in range(i, i + k):
                model(*data[j]).backward()
                if j == skip:
                    opt.zero_grad()
                    break
            else:
                opt.step()
                opt.zero_grad()

    model, opt = _wrapped(**options)
    ref = make_model(0, n_blocks=3)
    ropt = torch.optim.AdamW(ref.parameters(), lr=3e-3, weight_decay=0.05, foreach=False)
    loop(model, opt)
    clip = options.get("max_grad_norm")
    if clip is not None:  # torch's loop clips before its step
        ropt.step = _clipping(ropt, ref, clip)
    loop(ref, ropt)
    for a, b in zip(model.parameters(), ref.parameters()):
        assert (a.detach() - b.detach()).abs().max() < 1e-5


def _clipping(opt, model, clip):
    step = opt.step

    def clipped_step():
        torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        return step()

    return clipped_step


def test_zero_grad_after_eager_updates_warns_and_keeps_them():
    model, opt = _wrapped()
    x, y = batches(1, b=4)[0]
    model(x, y).backward()
    with pytest.warns(RuntimeWarning, match="zero_grad.*already taken their update"):
        opt.zero_grad()
    assert {float(v["step"]) for v in opt.state_dict()["state"].values()} == {1.0}
