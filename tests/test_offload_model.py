"""OffloadModel: the same chunks run resident with torch (nn.Sequential of a deep copy) give
bit-identical outputs, gradients and weights; bad arguments raise ValueError naming them; a
failed call leaves the model usable; the streamer never holds every chunk (CPU copier here; the
`cuda` variants run on a GPU)."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import ramstream

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)]
KEEPS = [True, False, "checkpoint"]


def _chunks(n=5, d=16, frozen=()):
    torch.manual_seed(0)
    out = []
    for i in range(n):
        c = nn.Sequential(nn.Linear(d, 2 * d), nn.GELU(), nn.LayerNorm(2 * d), nn.Linear(2 * d, d))
        if i in frozen:
            c.requires_grad_(False)
        out.append(c)
    return out


def _data(steps=3, d=16):
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(4, d, generator=g), torch.randn(4, d, generator=g)) for _ in range(steps)]


def _reference(chunks, device, steps, lr=1e-2, grad_outputs=None, pinned=()):
    """The chunks resident on `device`; AdamW steps on master copies where OffloadModel keeps
    each parameter at rest (the device for pinned chunks, the host for streamed ones), so the
    update runs the same kernels as an optimizer over model.parameters()."""
    ref = nn.Sequential(*copy.deepcopy(chunks)).to(device)
    pairs = []
    for i, c in enumerate(ref):
        home = device if i in pinned else "cpu"
        pairs += [
            (p, p.detach().to(home).clone().requires_grad_()) for p in c.parameters() if p.requires_grad
        ]
    opt = torch.optim.AdamW([m for _, m in pairs], lr=lr)
    outs = []
    for x, y in _data(steps):
        out = ref(x.to(device))
        if grad_outputs is None:
            F.mse_loss(out, y.to(device)).backward()
        else:
            out.backward(grad_outputs.to(device))
        outs.append(out.detach())
        for p, m in pairs:
            m.grad = p.grad.to(m.device)
        opt.step()
        with torch.no_grad():
            for p, m in pairs:
                p.copy_(m)
    return ref, outs


def _offload(chunks, device, steps, lr=1e-2, grad_outputs=None, **kw):
    model = ramstream.OffloadModel(chunks, device=device, **kw)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=lr)
    outs = []
    for x, y in _data(steps):
        if grad_outputs is None:
            res = model.step(x.to(device), targets=y.to(device))
        else:
            res = model.step(x.to(device), grad_outputs=grad_outputs.to(device))
        # gradients add into .grad step after step, as the reference's (no flush_grads(): after it
        # the next step starts a new sum, RamTorch's reset; tests/compat/test_ramtorch_offload_model.py)
        outs.append(res.output)
        opt.step()
    return model, outs


def _assert_same(ref, model, outs_ref, outs):
    for a, b in zip(outs_ref, outs):
        assert torch.equal(a.cpu(), b.cpu())
    rp, mp = list(ref.parameters()), list(model.parameters())
    assert len(rp) == len(mp)
    for a, b in zip(rp, mp):
        assert torch.equal(a.detach().cpu(), b.detach().cpu())
        assert (a.grad is None) == (b.grad is None)
        if a.grad is not None:
            assert torch.equal(a.grad.cpu(), b.grad.cpu())


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("keep", KEEPS)
def test_training_bit_identical_to_resident(device, keep):
    chunks = _chunks()
    ref, outs_ref = _reference(chunks, device, 3)
    calls = []
    chunks[2][0].register_forward_hook(lambda *a: calls.append(1))  # inside the chunk
    model, outs = _offload(chunks, device, 3, keep_activations=keep)
    _assert_same(ref, model, outs_ref, outs)
    assert len(calls) == 3 * (1 if keep is True else 2)  # recomputed in backward
    n = len(model.streamer.blocks)
    assert n == 5 and model.stats["loads"] > 3 * n  # every chunk streamed, reloaded for backward
    # streamed gradients live where the parameters live at rest (the home copy)
    for p in model.parameters():
        assert p.grad is None or p.grad.device == p.device
    model.close()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("keep", KEEPS)
def test_grad_outputs_and_frozen_chunk(device, keep):
    chunks = _chunks(frozen=(1, 3))
    g = torch.randn(4, 16, generator=torch.Generator().manual_seed(5))
    ref, outs_ref = _reference(chunks, device, 2, grad_outputs=g)
    model, outs = _offload(chunks, device, 2, grad_outputs=g, keep_activations=keep)
    _assert_same(ref, model, outs_ref, outs)
    for i in (1, 3):
        assert all(p.grad is None for p in model.chunks[i].parameters())
    res = model.step(_data(1)[0][0].to(device), grad_outputs=lambda out: torch.ones_like(out))
    with pytest.raises(ValueError, match="grad_outputs"):
        _ = res.loss
    model.close()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("window", [1, 2])
@pytest.mark.parametrize(
    "kw, pinned", [(dict(pin=2), [0, 2]), (dict(pin_layers=[1, 4]), [1, 4]), (dict(pin=5), [0, 1, 2, 3, 4])]
)
def test_pinned_chunks_bit_identical(device, window, kw, pinned):
    chunks = _chunks()
    ref, outs_ref = _reference(chunks, device, 3, pinned=set(pinned))
    model, outs = _offload(chunks, device, 3, window=window, **kw)
    assert model.pinned == pinned  # pin=2 of 5 chunks: evenly spaced, chunks 0 and 2
    for i, c in enumerate(model.chunks):
        assert all(p.device.type == (device if i in pinned else "cpu") for p in c.parameters())
    _assert_same(ref, model, outs_ref, outs)
    model.close()


@pytest.mark.parametrize(
    "n, pin, expected",
    [
        (12, 6, [0, 2, 4, 6, 8, 10]),  # RamTorch's README example
        (5, 2, [0, 2]),
        (10, 3, [0, 3, 6]),
        (7, 1, [0]),
        (4, 4, [0, 1, 2, 3]),
        (6, 0, []),
    ],
)
def test_pin_is_evenly_spaced(n, pin, expected):
    model = ramstream.OffloadModel(_chunks(n=n, d=4), device="cpu", pin=pin)
    assert model.pinned == expected
    assert [b.index for b in model.streamer.blocks] == [i for i in range(n) if i not in expected]
    # the rule the docstring states, against exact rational arithmetic: chunk floor(i * n / pin)
    from fractions import Fraction

    assert expected == [int(Fraction(i * n, pin)) for i in range(pin)]
    gaps = {b - a for a, b in zip(expected, expected[1:])}
    assert not gaps or max(gaps) - min(gaps) <= 1  # strides differ by at most one chunk
    model.close()


def test_fused_adamw_on_model_parameters():
    chunks = _chunks()
    ref = nn.Sequential(*copy.deepcopy(chunks))
    ropt = torch.optim.AdamW(ref.parameters(), lr=1e-2, fused=True)
    with ramstream.OffloadModel(chunks, device="cpu", window=2, keep_activations=True) as model:
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
        for x, y in _data(4):
            loss = F.mse_loss(ref(x), y)
            loss.backward()
            ropt.step()
            ropt.zero_grad()
            res = model.step(x, targets=y)
            assert torch.equal(res.loss, loss.detach())
            opt.step()
            opt.zero_grad()
        for a, b in zip(ref.parameters(), model.parameters()):
            assert torch.equal(a.detach(), b.detach())
        # inference after training: the updated home weights
        x = _data(1)[0][0]
        with torch.no_grad():
            assert torch.equal(model(x), ref(x))


def test_gradients_accumulate_across_steps_without_zero_grad():
    chunks = _chunks()
    ref = nn.Sequential(*copy.deepcopy(chunks))
    model = ramstream.OffloadModel(chunks, device="cpu", keep_activations="checkpoint")
    for x, y in _data(3):
        F.mse_loss(ref(x), y).backward()
        model.step(x, targets=y, loss_fn=F.mse_loss)
    for a, b in zip(ref.parameters(), model.parameters()):
        assert torch.equal(a.grad, b.grad)
    model.close()


def test_peak_loaded_bytes_is_the_window_not_all_chunks():
    chunks = _chunks(n=8)
    model = ramstream.OffloadModel(chunks, device="cpu", window=2, keep_activations=True)
    for x, y in _data(2):
        model.step(x, targets=y)
    per_chunk = max(b.nbytes for b in model.streamer.blocks)
    total = sum(b.nbytes for b in model.streamer.blocks)
    peak = model.stats["peak_loaded_bytes"]
    assert 0 < peak <= 2 * per_chunk < total  # window 2: the running chunk and one ahead
    assert model.streamer.loaded_bytes() == 0  # nothing on the device between steps
    model.close()


@pytest.mark.parametrize("keep", KEEPS)
@pytest.mark.parametrize("pin", [0, 2])
@pytest.mark.parametrize("window", [1, 2, 3, 4, 7])
def test_window_counts_the_running_chunk(keep, pin, window):
    """RamTorch's window: at most `window` streamed chunks are loaded at once, in forward and in
    backward (no extra slot: the forward keeps its last `window` streamed chunks for the backward,
    which starts with them); window=1 loads every chunk on demand at its own hook; weights on
    the device <= (window + pin) chunks; bit-identical to the chunks run resident."""
    chunks = _chunks(n=6)
    ref, outs_ref = _reference(chunks, "cpu", 2)
    model = ramstream.OffloadModel(chunks, device="cpu", window=window, pin=pin, keep_activations=keep)
    seen = []
    for i, c in enumerate(model.chunks):  # inside the chunk: in forward and in a recompute
        c[0].register_forward_pre_hook(
            lambda m, a, i=i: seen.append(
                (
                    i,
                    torch._C._current_graph_task_id() != -1,
                    {b.index for b in model.streamer.blocks if b.loaded},
                )
            )
        )
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    outs = []
    for x, y in _data(2):
        outs.append(model.step(x, targets=y).output)
        opt.step()
    _assert_same(ref, model, outs_ref, outs)
    streamed = [b.index for b in model.streamer.blocks]
    s, per_chunk = len(streamed), model.streamer.blocks[0].nbytes
    assert all(b.nbytes == per_chunk for b in model.streamer.blocks)
    assert model.stats["peak_loaded_bytes"] == min(window, s) * per_chunk
    assert len(model.pinned) + model.stats["peak_loaded_bytes"] / per_chunk <= window + pin
    # forward: every streamed chunk once; backward: all but the last min(window, s) again
    assert model.stats["loads"] == 2 * (2 * s - min(window, s))
    recomputed = [i for i, in_backward, _ in seen if in_backward]
    assert recomputed == ([5, 4, 3, 2, 1, 0] * 2 if keep is not True else [])
    for i, in_backward, loaded in seen:
        assert len(loaded) <= window
        if i in streamed:
            k = streamed.index(i)
            # forward: the running chunk and those ahead; a recompute in backward: the running
            # chunk and those before it (the backward's next ones)
            ahead = streamed[max(0, k - window + 1) : k + 1] if in_backward else streamed[k : k + window]
            assert set(ahead) <= loaded
            if window == 1:
                assert loaded == {i}  # on demand: nothing else
    assert model.streamer.loaded_bytes() == 0
    model.close()


class RaisesOnce(nn.Module):
    def __init__(self, d=16):
        super().__init__()
        self.lin = nn.Linear(d, d)
        self.armed = False

    def forward(self, x):
        if self.armed:
            self.armed = False
            raise RuntimeError("boom")
        return self.lin(x)


@pytest.mark.parametrize("keep", KEEPS)
def test_exception_leaves_the_model_usable(keep):
    chunks = _chunks(n=3) + [RaisesOnce()] + _chunks(n=2)
    ref = nn.Sequential(*copy.deepcopy(chunks))
    model = ramstream.OffloadModel(chunks, device="cpu", window=2, keep_activations=keep)
    (x, y), (x2, y2) = _data(2)
    model.chunks[3].armed = True
    with pytest.raises(RuntimeError, match="boom"):
        model.step(x, targets=y)
    assert model.streamer.loaded_bytes() == 0
    assert all(p.grad is None for p in model.parameters())
    model.chunks[3].armed = True
    with pytest.raises(RuntimeError, match="boom"):
        model(x)

    def bad_loss(out, t):
        raise KeyError("loss")

    with pytest.raises(KeyError):
        model.step(x, targets=y, loss_fn=bad_loss)
    res = model.step(x2, targets=y2)
    loss = F.mse_loss(ref(x2), y2)
    loss.backward()
    assert torch.equal(res.loss, loss.detach())
    for a, b in zip(ref.parameters(), model.parameters()):
        assert torch.equal(a.grad, b.grad)
    model.close()


def test_set_pinned_keeps_weights_and_grads():
    chunks = _chunks()
    ref = nn.Sequential(*copy.deepcopy(chunks))
    model = ramstream.OffloadModel(chunks, device="cpu", pin=1)
    (x, y), (x2, y2) = _data(2)
    F.mse_loss(ref(x), y).backward()
    model.step(x, targets=y)
    model.set_pinned([2, 3])
    assert model.pinned == [2, 3] and [b.index for b in model.streamer.blocks] == [0, 1, 4]
    F.mse_loss(ref(x2), y2).backward()
    model.step(x2, targets=y2)
    for a, b in zip(ref.parameters(), model.parameters()):
        assert torch.equal(a.detach(), b.detach())
        assert torch.equal(a.grad, b.grad)
    model.set_pinned(2)  # a count: evenly spaced, as pin=2
    assert model.pinned == [0, 2] and [b.index for b in model.streamer.blocks] == [1, 3, 4]
    F.mse_loss(ref(x), y).backward()
    model.step(x, targets=y)
    for a, b in zip(ref.parameters(), model.parameters()):
        assert torch.equal(a.grad, b.grad)
    with pytest.raises(ValueError, match="pin"):
        model.set_pinned(6)
    model.close()


def test_tuple_outputs_pass_between_chunks():
    class Split(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(16, 16)

        def forward(self, x):
            return self.lin(x), x.sum(-1) > 0

    class Join(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(16, 16)

        def forward(self, h, mask):
            return self.lin(h) * mask[:, None]

    torch.manual_seed(0)
    chunks = [Split(), Join()]
    ref = copy.deepcopy(chunks)
    x, y = _data(1)[0]
    F.mse_loss(ref[1](*ref[0](x)), y).backward()
    model = ramstream.OffloadModel(chunks, device="cpu", window=2, keep_activations="checkpoint")
    model.step(x, targets=y)
    for a, b in zip([p for c in ref for p in c.parameters()], model.parameters()):
        assert torch.equal(a.grad, b.grad)
    model.close()


@pytest.mark.parametrize(
    "kw, name",
    [
        (dict(window=0), "window"),
        (dict(window=1.5), "window"),
        (dict(pin=6), "pin"),
        (dict(pin=-1), "pin"),
        (dict(pin_layers=[1, 1]), "pin_layers"),
        (dict(pin_layers=[5]), "pin_layers"),
        (dict(pin_layers=[-1]), "pin_layers"),
        (dict(keep_activations="yes"), "keep_activations"),
        (dict(activation_offload=True), "activation_offload"),  # needs keep_activations=True
        (dict(activation_offload=True, keep_activations="checkpoint"), "activation_offload"),
        (dict(activation_offload="yes", keep_activations=True), "activation_offload"),
        (dict(device="nope"), "device"),
        (dict(device="cuda:99"), "device"),
        (dict(device="meta"), "device"),
    ],
)
def test_bad_arguments_raise_value_error(kw, name):
    with pytest.raises(ValueError, match=name):
        ramstream.OffloadModel(_chunks(), **{"device": "cpu", **kw})


def test_weight_streamer_accepts_zero_ahead():
    from ramstream.weights import WeightStreamer, make_copier

    copier = make_copier(torch.device("cpu"))
    assert WeightStreamer([], copier=copier, ahead=0).ahead == 0
    for bad in (-1, 1.0, True, None):
        with pytest.raises(ValueError, match="ahead"):
            WeightStreamer([], copier=copier, ahead=bad)


def test_bad_chunks_and_step_arguments():
    with pytest.raises(ValueError, match="chunks"):
        ramstream.OffloadModel([nn.Linear(2, 2), "not a module"], device="cpu")
    with pytest.raises(ValueError, match="chunks"):
        ramstream.OffloadModel([], device="cpu")
    lin = nn.Linear(4, 4)
    with pytest.raises(ValueError, match="share"):
        ramstream.OffloadModel([lin, nn.Sequential(lin)], device="cpu")
    model = ramstream.OffloadModel(_chunks(), device="cpu")
    x, y = _data(1)[0]
    with pytest.raises(ValueError, match="loss_fn"):
        model.step(x, targets=y, loss_fn=F.mse_loss, grad_outputs=torch.ones(4, 16))
    with pytest.raises(ValueError, match="grad_outputs"):
        model.step(x, grad_outputs=torch.ones(3, 16))  # (step(x) alone: loss output.sum(), RamTorch's)
    with pytest.raises(ValueError, match="pin_layers"):
        model.set_pinned([7])
    assert model.step(x, targets=y).loss.ndim == 0  # still usable
    model.close()
    with pytest.raises(ValueError, match="closed"):
        model(x)


def test_readme_example_runs():
    import os
    import re

    with open(os.path.join(os.path.dirname(__file__), os.pardir, "docs", "guide", "offload_model.md")) as f:
        section = f.read().split("# `OffloadModel`", 1)[1]
    code = re.search(r"```python\n(.*?)```", section, re.DOTALL).group(1)
    scope: dict = {}
    exec(compile(code, "docs/guide/offload_model.md", "exec"), scope)  # noqa: S102 - our docs
    assert scope["res"].loss.ndim == 0 and scope["model"].streamer is None  # closed by `with`


@pytest.mark.parametrize("keep", KEEPS)
def test_hand_run_backward_on_cpu(keep):
    chunks = _chunks()
    ref = nn.Sequential(*copy.deepcopy(chunks))
    model = ramstream.OffloadModel(chunks, device="cpu", keep_activations=keep)
    x, y = _data(1)[0]
    F.mse_loss(ref(x), y).backward()
    F.mse_loss(model(x), y).backward()
    for a, b in zip(ref.parameters(), model.parameters()):
        assert torch.equal(a.grad, b.grad)
    assert model.streamer.loaded_bytes() == 0
    model.close()
