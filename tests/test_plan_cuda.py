"""The plan on a GPU (issue 24): under a VRAM cap, wrap()'s defaults apply what plan_for() says, a
model whose dense loss needs most of the cap trains without running out of memory, a step larger
than the plan is refused before it runs (weights untouched) and the planned one then trains, one
that more recomputed blocks fit is re-planned and trains under the cap (re-run only when every
block must recompute), and bf16 moments that host RAM alone forced become fp32 at the resident
switch."""

from __future__ import annotations

import contextlib

import pytest
import torch

import ramstream
from ramstream.runtime.tokens import PlanOutOfMemoryError

from _models import TinyGPT, batches, make_model, train_torch

pytestmark = pytest.mark.cuda
GIB = 2**30
DEV = torch.device("cuda:0")


@contextlib.contextmanager
def _cap(gib: float):
    total = torch.cuda.get_device_properties(DEV).total_memory
    torch.cuda.empty_cache()
    torch.cuda.set_per_process_memory_fraction(min(1.0, gib * GIB / total), DEV)
    torch.cuda.reset_peak_memory_stats(DEV)
    try:
        yield gib * GIB
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0, DEV)
        torch.cuda.empty_cache()


def _model():
    """0.49 GiB of fp32 weights; 4 x 512 tokens of its dense loss need 0.79 GiB of logits."""
    torch.manual_seed(0)
    return TinyGPT(vocab=32000, d=1024, n_blocks=8, tied=False)


def _step(model, opt, b: int, t: int, seed: int = 0, vocab: int = 32000):
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(0, vocab, (b, t), generator=g).to(DEV)
    y = torch.randint(0, vocab, (b, t), generator=g).to(DEV)
    loss = model(x, y)
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return float(loss)


def _in_a_fresh_process(name: str) -> None:
    """t.<name>() in a new Python process: tensors earlier tests of this process leave allocated
    (a failed test's traceback keeps its model) pin segments of the caching allocator, so a 1.5 GiB
    cap here would leave the run less than 1.5 GiB (test_wrap_cuda.py does the same)."""
    import os
    import subprocess
    import sys

    code = f"import test_plan_cuda as t; t.{name}()"
    here = os.path.dirname(os.path.abspath(__file__))
    r = subprocess.run([sys.executable, "-c", code], cwd=here, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]


def test_defaults_apply_plan_for_and_train_the_dense_loss_under_the_cap():
    _in_a_fresh_process("_dense_loss_under_the_cap")


def _dense_loss_under_the_cap():
    with _cap(1.5) as cap:
        model = _model()
        plan = ramstream.plan_for(model, torch.optim.AdamW(model.parameters()))
        model, opt = ramstream.wrap(model, torch.optim.AdamW(model.parameters(), lr=1e-4), device=DEV)
        got = ramstream.memory_report(model)["plan"]["planner"]
        assert got["streamed"] == plan.weights["streamed"]
        assert got["recompute"] == [i for i, m in enumerate(plan.activations) if m == "recompute"]
        b, s = plan.shape["batch"], plan.shape["seq"]
        losses = [_step(model, opt, b, s, seed=i) for i in range(4)]
        assert all(torch.isfinite(torch.tensor(losses)))
        assert torch.cuda.max_memory_allocated(DEV) <= cap
        ramstream.unwrap(model)


def test_a_step_larger_than_the_plan_is_refused_before_it_runs():
    _in_a_fresh_process("_larger_step_refused")


def _larger_step_refused():
    with _cap(1.5):
        model = _model()
        model, opt = ramstream.wrap(
            model, torch.optim.AdamW(model.parameters(), lr=1e-4), device=DEV, batch=2, seq=256
        )
        # the copy goes to the host: under the cap there is no VRAM for a second set of weights
        before = {k: v.detach().to("cpu", copy=True) for k, v in model.state_dict().items()}
        with pytest.raises(PlanOutOfMemoryError, match="batch 64 x seq 512 does not fit") as e:
            _step(model, opt, 64, 512)
        assert isinstance(e.value, torch.OutOfMemoryError)
        after = model.state_dict()
        assert all(torch.equal(before[k], after[k].cpu()) for k in before)
        opt.zero_grad(set_to_none=True)
        assert torch.isfinite(torch.tensor(_step(model, opt, 2, 256)))
        hist = ramstream.memory_report(model)["plan"]
        assert hist["planner"]["batch"] == 2 and hist["planner"]["seq"] == 256
        ramstream.unwrap(model)


def test_a_larger_step_is_re_planned_and_trains_under_the_cap():
    """The re-plan path on the GPU, on the plan test_step_replan.py checks on the CPU engine (the
    GPU run of 2026-12-05 found no batch that only a re-plan fits under a real 1.5 GiB cap): the
    plan and the step check are made on an injected profile (32 MiB free: the plan for 2 x 8
    tokens keeps every activation; 64 x 8 needs blocks from the back recomputed), the step runs on
    cuda:0, goes on under the revised plan (no error: block 0 keeps its activations), recomputes
    those blocks, and trains as torch's AdamW does."""
    from ramstream.runtime.apply import check_steps
    from ramstream.runtime.inspect import model_shape, plan_for
    from test_step_replan import LR, _profile

    ref = make_model(0, n_blocks=8, d=128)
    prof = _profile(32)
    plan = plan_for(ref, profile=prof, batch=2, seq=8)
    shape = model_shape(ref, list(ref.blocks), batch=2, seq=8, loss="dense")
    model = make_model(0, n_blocks=8, d=128)
    model, opt = ramstream.wrap(
        model, torch.optim.AdamW(model.parameters(), lr=LR), device=DEV, plan=plan, optimizer_mode="cpu"
    )
    w = model._ramstream
    check_steps(model, w, plan, shape, prof, w.options, w.log)
    big = batches(2, b=64, t=8, seed=2, device=DEV)
    ref = ref.to(DEV)
    want = train_torch(ref, torch.optim.AdamW(ref.parameters(), lr=LR), big)
    got = train_torch(model, opt, big)  # no PlanOutOfMemoryError: the step goes on
    opt.synchronize()
    rep = ramstream.memory_report(model)["plan"]
    revised = [h for h in rep["history"] if h["change"].startswith("re-planned: now recomputing blocks")]
    assert len(revised) == 1 and revised[0]["step_tokens"] == 64 * 8, rep["history"]
    rc = revised[0]["recompute"]
    assert rc and 0 not in rc and rep["recompute"] == rc == rep["planner"]["recompute"]
    assert got == pytest.approx(want, rel=1e-5)
    for a, b in zip(ref.parameters(), model.parameters()):
        assert torch.allclose(a, b, rtol=1e-4, atol=1e-6)
    ramstream.unwrap(model)


def test_a_larger_step_streams_more_blocks_on_the_gpu_and_trains_as_torch():
    """The stream lever on the GPU (test_step_replan.py checks it bit for bit on the CPU engine):
    every block recomputing already, a 128 x 8 step fits the injected 48 MiB profile only with more
    blocks streaming; before any block ran they start streaming from the back (their weights to
    pinned homes, the device buffers released), the step goes on, and the run trains as torch does."""
    from ramstream.runtime.apply import check_steps
    from ramstream.runtime.inspect import model_shape, plan_for
    from test_step_replan import LR, _profile

    ref = make_model(0, n_blocks=8, d=256)
    prof = _profile(48)
    plan = plan_for(ref, profile=prof, batch=2, seq=8)
    assert plan.activations == ["recompute"] * 8 and not plan.weights["streamed"]
    shape = model_shape(ref, list(ref.blocks), batch=2, seq=8, loss="dense")
    model = make_model(0, n_blocks=8, d=256)
    model, opt = ramstream.wrap(
        model, torch.optim.AdamW(model.parameters(), lr=LR), device=DEV, plan=plan, optimizer_mode="cpu"
    )
    w = model._ramstream
    check_steps(model, w, plan, shape, prof, w.options, w.log)
    data = batches(1, b=2, t=8, seed=1, device=DEV) + batches(3, b=128, t=8, seed=5, device=DEV)
    ref = ref.to(DEV)
    want = train_torch(ref, torch.optim.AdamW(ref.parameters(), lr=LR), data)
    got = train_torch(model, opt, data)
    opt.synchronize()
    streamed = ramstream.memory_report(model)["plan"]["weights"]["streamed"]
    assert streamed and streamed[-1] == 7 and 0 not in streamed
    for i, blk in enumerate(model.blocks):  # between steps: streamed weights at home in pinned RAM
        where = {p.device.type for p in blk.parameters()}
        assert where == ({"cpu"} if i in streamed else {"cuda"}), (i, where)
    assert got == pytest.approx(want, rel=1e-5)
    for a, b in zip(ref.parameters(), model.parameters()):
        assert torch.allclose(a, b.to(a.device), rtol=1e-4, atol=1e-6)
    ramstream.unwrap(model)


def test_ram_forced_bf16_moments_are_fp32_once_resident(monkeypatch):
    """The state starting on the host (as without ramstream's CUDA kernels): RAM forces bf16 moments
    for the first steps, fp32 once resident. The state starting in VRAM: test_state_on_device.py."""
    import importlib

    import ramstream.planner.profile as profile_mod

    wrap_mod = importlib.import_module("ramstream.wrap")  # the module (ramstream.wrap is the function)
    monkeypatch.setattr(wrap_mod, "state_starts_on_device", lambda *a: (False, "test: the host start"))
    model = make_model(0, n_blocks=2)
    host = sum(p.numel() * p.element_size() for p in model.parameters())
    # fp32 host state does not fit in this RAM, bf16 state does (the model's own bytes leave for the GPU)
    monkeypatch.setattr(profile_mod, "available_ram", lambda *a: {"total": 1 << 30, "available": 200_000})
    model, opt = ramstream.wrap(model, torch.optim.AdamW(model.parameters(), lr=1e-3), device=DEV)
    assert host < 200_000
    assert opt._moment_dtype == torch.bfloat16
    train_torch(model, opt, batches(4, device=DEV))
    assert opt.resident and opt._moment_dtype == torch.float32
    assert all(st["exp_avg"].dtype == torch.float32 for st in opt._resident.state.values())
    assert ramstream.memory_report(model)["plan"]["planner"]["moment_dtype"] == "float32"
    ramstream.unwrap(model)
    monkeypatch.undo()
    # the same RAM, the state starting in VRAM (the plan is resident): fp32 moments from wrap() on
    monkeypatch.setattr(profile_mod, "available_ram", lambda *a: {"total": 1 << 30, "available": 200_000})
    model = make_model(0, n_blocks=2)
    model, opt = ramstream.wrap(model, torch.optim.AdamW(model.parameters(), lr=1e-3), device=DEV)
    assert opt._moment_dtype == torch.float32
    assert ramstream.memory_report(model)["optimizer"]["host_state_bytes"] == 0
    train_torch(model, opt, batches(4, device=DEV))
    assert opt.resident
    ramstream.unwrap(model)
