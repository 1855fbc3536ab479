"""RamTorch 1.11 OffloadModel scripts, written as its README and docstrings show them, with
ramstream imported in its place (`from ramstream import OffloadModel`): options, methods, stats
keys, the step result and errors; weights checked bit for bit against torch (the chunks run
resident, torch.optim.AdamW(fused=True) on the CPU). docs/compat.md lists what differs."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from ramstream import OffloadModel, OffloadStepResult

D = 16
RAMTORCH_STATS = (
    "loads",
    "nvme_loads",
    "acquire_wait_s",
    "acc_loads",
    "acc_evictions",
    "act_offloads",
    "act_reloads",
    "act_bytes_offloaded",
    "retiers",
)


def make_chunks(n=5, d=D):
    """RamTorch's README dicing: nn.Sequential(Linear, GELU, Linear) per chunk."""
    torch.manual_seed(0)
    return [nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d)) for _ in range(n)]


def make_data(n, rows=8, d=D, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(rows, d, generator=g), torch.randint(0, d, (rows,), generator=g)) for _ in range(n)]


def reference(chunks, lr=1e-3):
    ref = nn.Sequential(*copy.deepcopy(chunks))
    return ref, torch.optim.AdamW(ref.parameters(), lr=lr, fused=True)


def assert_same_weights(ref, model):
    rp, mp = list(ref.parameters()), list(model.parameters())
    assert len(rp) == len(mp)
    for i, (a, b) in enumerate(zip(rp, mp)):
        assert torch.equal(a.detach(), b.detach()), f"parameter {i} differs"


# ---- the README's quick start ------------------------------------------------------------------
@pytest.mark.parametrize("keep", [False, True, "checkpoint"])
def test_readme_loop_matches_torch(keep):
    chunks = make_chunks()
    ref, ref_opt = reference(chunks)
    data = make_data(3)
    model = OffloadModel(chunks, device="cpu", window=2, pin=2, keep_activations=keep)
    out = model(data[0][0])  # streamed forward
    assert torch.equal(out, ref(data[0][0]).detach())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    for x, y in data:
        res = model.step(x, targets=y, loss_fn=F.cross_entropy)
        model.flush_grads()
        opt.step()
        opt.zero_grad()
        loss = F.cross_entropy(ref(x), y)
        loss.backward()
        ref_opt.step()
        ref_opt.zero_grad()
        assert torch.equal(res.loss, loss.detach())
    assert_same_weights(ref, model)
    model.close()


# ---- flush_grads(scale) -------------------------------------------------------------------------
def test_flush_grads_scale_is_the_mean_and_resets_the_sum():
    """k step() calls accumulate; flush_grads(scale=1/k) gives their mean in .grad and the next
    step starts a new sum (no opt.zero_grad() needed, as in RamTorch)."""
    chunks = make_chunks()
    ref, ref_opt = reference(chunks)
    model = OffloadModel(chunks, device="cpu", window=2, pin=1)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    data = make_data(6)
    k = 3
    for i in range(0, len(data), k):
        for x, y in data[i : i + k]:
            model.step(x, targets=y, loss_fn=F.cross_entropy)
            F.cross_entropy(ref(x), y).backward()
        model.flush_grads(scale=1 / k)
        for p in ref.parameters():
            p.grad.mul_(1 / k)
        for a, b in zip(ref.parameters(), model.parameters()):
            assert torch.equal(a.grad, b.grad)
        opt.step()  # no zero_grad: the flush reset the sum
        ref_opt.step()
        ref_opt.zero_grad()
    assert_same_weights(ref, model)
    grads = [p.grad.clone() for p in model.parameters()]
    model.flush_grads(scale=0.5)  # a second flush with no step between changes nothing
    assert all(torch.equal(g, p.grad) for g, p in zip(grads, model.parameters()))
    with pytest.raises(TypeError, match="scale"):
        model.flush_grads(scale="half")
    model.close()


def test_zero_grad_acc_drops_the_unflushed_sum():
    chunks = make_chunks()
    ref, ref_opt = reference(chunks)
    model = OffloadModel(chunks, device="cpu")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    (x1, y1), (x2, y2) = make_data(2)
    model.step(x1, targets=y1, loss_fn=F.cross_entropy)
    model.zero_grad_acc()  # x1's gradient is gone
    model.step(x2, targets=y2, loss_fn=F.cross_entropy)
    model.flush_grads()
    model.zero_grad_acc()  # after a flush: the flushed .grad stays for the optimizer
    opt.step()
    F.cross_entropy(ref(x2), y2).backward()
    ref_opt.step()
    assert_same_weights(ref, model)
    model.close()


def test_invalidate_residency_after_a_manual_update():
    chunks = make_chunks()
    ref, _ = reference(chunks)
    model = OffloadModel(chunks, device="cpu", window=2)
    x = make_data(1)[0][0]
    model(x)
    with torch.no_grad():
        for a, b in zip(ref.parameters(), model.parameters()):
            a.mul_(0.5)
            b.mul_(0.5)
    model.invalidate_residency()
    assert torch.equal(model(x), ref(x).detach())
    model.close()


# ---- the default loss, loss_fn without targets, grad_outputs -------------------------------------
def test_default_loss_without_targets_is_output_sum():
    chunks = make_chunks()
    ref, _ = reference(chunks)
    model = OffloadModel(chunks, device="cpu")
    x = make_data(1)[0][0]
    res = model.step(x)
    loss = ref(x).sum()
    loss.backward()
    assert torch.equal(res.loss, loss.detach())
    res = model.step(x, loss_fn=lambda out, _: out.pow(2).mean())  # targets=None reaches loss_fn
    loss = ref(x).pow(2).mean()
    loss.backward()
    assert torch.equal(res.loss, loss.detach())
    for a, b in zip(ref.parameters(), model.parameters()):
        assert torch.equal(a.grad, b.grad)
    model.close()


def test_grad_outputs_callable_gets_output_and_targets():
    chunks = make_chunks()
    ref, _ = reference(chunks)
    model = OffloadModel(chunks, device="cpu", keep_activations=True)
    x = make_data(1)[0][0]
    t = torch.randn(x.shape[0], D)
    res = model.step(x, targets=t, grad_outputs=lambda out, targets: 2 * (out - targets))
    out = ref(x)
    out.backward(2 * (out.detach() - t))
    for a, b in zip(ref.parameters(), model.parameters()):
        assert torch.equal(a.grad, b.grad)
    assert isinstance(res, OffloadStepResult) and res.grad_bypassed
    assert torch.equal(res.output, out.detach())
    with pytest.raises(RuntimeError, match="grad_outputs"):  # RamTorch's error type
        _ = res.loss
    with pytest.raises(ValueError, match="loss_fn"):
        model.step(x, loss_fn=F.mse_loss, grad_outputs=torch.ones_like(t))
    model.close()


def test_tuple_or_list_input_is_the_first_chunks_arguments():
    class Masked(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(D, D)

        def forward(self, h, mask):
            return self.lin(h) * mask[:, None]

    torch.manual_seed(0)
    chunks = [Masked(), nn.Linear(D, D)]
    ref = copy.deepcopy(chunks)
    x, mask = torch.randn(4, D), torch.tensor([1.0, 0.0, 1.0, 1.0])
    model = OffloadModel(chunks, device="cpu")
    res = model.step([x, mask])
    ref[1](ref[0](x, mask)).sum().backward()
    assert torch.equal(res.output, model((x, mask)))
    for a, b in zip([p for c in ref for p in c.parameters()], model.parameters()):
        assert torch.equal(a.grad, b.grad)
    model.close()


# ---- constructor options -----------------------------------------------------------------------
@pytest.mark.parametrize("grad_accum", ["stream", "cpu"])
def test_ramtorch_options_train_as_torch(grad_accum):
    """RamTorch's options as its docstring spells them; offload_activations pages the kept
    graph's activations (ramstream's activation_offload), the numbers are torch's."""
    rows = 4096  # activations of 1 MiB and more are paged
    chunks = make_chunks(n=4)
    ref, ref_opt = reference(chunks)
    model = OffloadModel(
        chunks,
        device="cpu",
        window=2,
        pin=1,
        nvme=0,
        nvme_layers=None,
        nvme_path=None,
        keep_activations=True,
        grad_accum=grad_accum,
        acc_slots=3,
        offload_activations=True,
        act_slots=2,
    )
    assert (model.grad_accum, model.acc_slots, model.act_slots, model.offload_activations) == (
        grad_accum,
        3,
        2,
        True,
    )
    assert model.nvme_layers == frozenset() and model.n == 4
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    for x, y in make_data(2, rows=rows):
        model.step(x, targets=y, loss_fn=F.cross_entropy)
        model.flush_grads()
        opt.step()
        opt.zero_grad()
        F.cross_entropy(ref(x), y).backward()
        ref_opt.step()
        ref_opt.zero_grad()
    assert_same_weights(ref, model)
    st = model.stats
    assert all(k in st for k in RAMTORCH_STATS)
    assert st["act_offloads"] > 0 and st["act_reloads"] > 0 and st["act_bytes_offloaded"] >= 2 * rows * D * 4
    assert st["nvme_loads"] == st["acc_loads"] == st["acc_evictions"] == st["retiers"] == 0
    assert st["loads"] > 0 and st["acquire_wait_s"] >= 0.0
    for k in ("bytes_h2d", "evictions", "peak_loaded_bytes", "bytes_d2h", "activation_bytes_paged"):
        assert k in st  # ramstream's keys are still there
    model.close()


def test_default_device_is_cuda_else_cpu():
    model = OffloadModel(make_chunks(n=2))
    assert model.device.type == ("cuda" if torch.cuda.is_available() else "cpu")
    model.close()


@pytest.mark.parametrize(
    "kw",
    [
        dict(nvme=2, nvme_path="/var/tmp/ramstream-weights.bin"),
        dict(nvme_layers=[1], nvme_path="weights.bin"),
    ],
)
def test_nvme_on_trained_chunks_is_named_not_implemented(kw):
    # only frozen chunk weights go to disk (tests/test_offload_model_nvme.py runs them)
    with pytest.raises(NotImplementedError, match=r"nvme=.*only frozen chunk weights"):
        OffloadModel(make_chunks(), device="cpu", **kw)


def test_nvme_without_a_folder_names_nvme_path(monkeypatch):
    monkeypatch.delenv("RAMSTREAM_NVME_DIR", raising=False)
    with pytest.raises(ValueError, match="nvme_path"):
        OffloadModel(make_chunks(), device="cpu", nvme=5)


def test_nvme_options_at_rest_or_on_pinned_chunks_are_no_ops():
    model = OffloadModel(make_chunks(), device="cpu", pin_layers=[0], nvme_layers=[0], nvme_path="w.bin")
    assert model.nvme_layers == frozenset()  # pinned wins, as in RamTorch
    model.close()


@pytest.mark.parametrize(
    "kw, name, err",
    [
        (dict(grad_accum="gpu"), "grad_accum", ValueError),
        (dict(acc_slots=0), "acc_slots", ValueError),
        (dict(act_slots=0), "act_slots", ValueError),
        (dict(nvme=-1), "nvme", ValueError),
        (dict(nvme_layers=[9]), "nvme_layers", ValueError),
        (dict(nvme_path=3), "nvme_path must be", TypeError),
        (dict(offload_activations=True), "offload_activations", ValueError),  # needs kept graphs
        (
            dict(offload_activations=True, activation_offload=False, keep_activations=True),
            "differ",
            ValueError,
        ),
    ],
)
def test_bad_ramtorch_options(kw, name, err):
    with pytest.raises(err, match=name):
        OffloadModel(make_chunks(), device="cpu", **kw)


def test_offload_activations_with_checkpoint_warns_and_trains():
    with pytest.warns(UserWarning, match="checkpoint"):
        model = OffloadModel(
            make_chunks(), device="cpu", keep_activations="checkpoint", offload_activations=True
        )
    assert model.step(make_data(1)[0][0]).loss.ndim == 0
    model.close()


# ---- tiers ---------------------------------------------------------------------------------------
def test_tier_changes_return_ramtorchs_summary_and_train_as_torch():
    chunks = make_chunks()
    ref, ref_opt = reference(chunks)
    model = OffloadModel(chunks, device="cpu", pin=2)
    assert model.pinned_layers == frozenset({0, 2}) and model.streamed_layers == frozenset({1, 3, 4})
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    per_chunk = sum(p.nbytes for p in chunks[0].parameters())
    moves = [
        (lambda: model.set_pinned([1, 3], optimizers=[opt]), [1, 3], [0, 2]),
        (lambda: model.pin_chunks(4, optimizers=opt), [4], []),
        (lambda: model.unpin_chunks([1, 4, 0], optimizers=(opt,)), [], [1, 4]),
        (lambda: model.set_pinned(1, force=True), [0], [3]),  # a count, as pin=1
    ]
    for (x, y), (move, pinned, unpinned) in zip(make_data(len(moves)), moves):
        model.step(x, targets=y, loss_fn=F.cross_entropy)
        model.flush_grads()
        opt.step()
        opt.zero_grad()
        F.cross_entropy(ref(x), y).backward()
        ref_opt.step()
        ref_opt.zero_grad()
        summary = move()
        assert summary == {
            "pinned": pinned,
            "unpinned": unpinned,
            "bytes_moved": per_chunk * (len(pinned) + len(unpinned)),
            "grads_discarded": False,
        }
    assert model.pinned_layers == frozenset({0}) and model.pinned == [0]
    assert model.stats["retiers"] == 4
    assert model.set_pinned([0]) == {"pinned": [], "unpinned": [], "bytes_moved": 0, "grads_discarded": False}
    assert model.stats["retiers"] == 4  # nothing moved
    x, y = make_data(1, seed=7)[0]
    model.step(x, targets=y, loss_fn=F.cross_entropy)
    model.flush_grads()
    opt.step()
    F.cross_entropy(ref(x), y).backward()
    ref_opt.step()
    assert_same_weights(ref, model)
    model.close()


def test_tier_change_errors():
    model = OffloadModel(make_chunks(), device="cpu")
    with pytest.raises(TypeError, match="pinned"):
        model.set_pinned(True)
    with pytest.raises(ValueError, match=r"\[0, 5\)"):
        model.pin_chunks([9])
    with pytest.raises(TypeError, match="ints"):
        model.unpin_chunks([0.5])
    with pytest.raises(TypeError, match="optimizers"):
        model.pin_chunks(0, optimizers=[object()])
    model.close()
    with pytest.raises(RuntimeError, match="closed"):  # RamTorch's error type
        model.set_pinned(2)


def test_flush_grads_scale_with_the_host_optimizer_is_refused():
    model = OffloadModel(make_chunks(), device="cpu")
    opt = model.optimizer(lr=1e-3)
    model.step(make_data(1)[0][0])
    with pytest.raises(ValueError, match="scale"):
        model.flush_grads(scale=0.5)
    model.flush_grads()  # scale 1: accepted
    opt.step()
    model.close()
