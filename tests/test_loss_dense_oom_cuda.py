"""tests/test_loss_dense_oom.py on the GPU with real out-of-memory errors: the plan and the step
check are made on an injected profile (64 MiB free: 256 x 8 tokens fit only with the chunked loss,
tests/test_loss_assumed.py), the step runs on cuda:0, and a memory cap set just before the dense
loss makes CUDA's allocator refuse its logits."""

from __future__ import annotations

import pytest
import torch

import ramstream
from ramstream.runtime.apply import check_steps
from ramstream.runtime.inspect import model_shape, plan_for
from ramstream.runtime.tokens import PlanOutOfMemoryError
from test_loss_dense_oom import LR, VOCAB, LossGPT, dense_loss

from _models import batches, clone, gpu_profile, no_runtime_warning, train_torch

pytestmark = pytest.mark.cuda
DEV = torch.device("cuda:0")


def _cap_now(margin: int = 1 << 20) -> None:
    """The process may hold what its allocator holds now and `margin` bytes more."""
    torch.cuda.synchronize(DEV)
    torch.cuda.empty_cache()  # no cached free block may serve the refused allocation
    total = torch.cuda.get_device_properties(DEV).total_memory
    torch.cuda.set_per_process_memory_fraction((torch.cuda.memory_reserved(DEV) + margin) / total, DEV)


def _uncap() -> None:
    torch.cuda.set_per_process_memory_fraction(1.0, DEV)


class CappedGPT(LossGPT):
    """LossGPT whose dense loss runs under a cap set when the blocks are done (`cap`)."""

    cap = False

    def dense(self, h, targets):
        if self.cap:
            _cap_now()  # the [2048, 2048] fp32 logits (16 MiB) are refused
        return dense_loss(self.head(h), targets, 1 << 30)


def _wrapped(ref):
    prof = gpu_profile(64)
    plan = plan_for(ref, profile=prof, batch=2, seq=8)
    model = clone(ref).to(DEV)
    model, opt = ramstream.wrap(
        model, torch.optim.AdamW(model.parameters(), lr=LR), device=DEV, plan=plan, optimizer_mode="cpu"
    )
    w = model._ramstream
    shape = model_shape(ref, list(ref.blocks), batch=2, seq=8, loss="dense")
    check_steps(model, w, plan, shape, prof, w.options, w.log)
    return model, opt


def _ref():
    torch.manual_seed(0)
    return CappedGPT(vocab=VOCAB, d=64, n_blocks=4)


def test_a_real_dense_loss_oom_in_the_model_is_a_plan_oom_and_the_chunked_loss_then_trains():
    torch.use_deterministic_algorithms(True, warn_only=True)  # embedding backward: atomics
    ref = _ref()
    model, opt = _wrapped(ref)
    small = batches(2, vocab=VOCAB, b=2, t=8, device=DEV)
    big = batches(1, vocab=VOCAB, b=256, t=8, seed=2, device=DEV)
    ref = ref.to(DEV)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=LR)
    want = train_torch(ref, ref_opt, small)
    got = train_torch(model, opt, small)
    opt.synchronize()
    before = {k: v.detach().to("cpu", copy=True) for k, v in model.state_dict().items()}
    ooms = torch.cuda.memory_stats(DEV)["num_ooms"]
    model.cap = True
    try:
        with pytest.raises(PlanOutOfMemoryError) as e:
            model(*big[0])
    finally:
        _uncap()
        model.cap = False
    err = e.value
    assert isinstance(err, torch.OutOfMemoryError) and type(err.__cause__) is torch.OutOfMemoryError
    assert "injected" not in str(err.__cause__)  # the allocator's own
    assert torch.cuda.memory_stats(DEV)["num_ooms"] > ooms
    dense = 2048 * VOCAB * 12
    assert err.assumed["dense_logits_bytes"] == dense and f"= {dense} bytes" in str(err)
    del e, err
    opt.zero_grad(set_to_none=True)
    opt.synchronize()
    after = model.state_dict()
    assert all(torch.equal(before[k], after[k].cpu()) for k in before)
    # the chunked loss: the step trains as torch does; no second report of the same error
    model.chunked = ref.chunked = True
    with no_runtime_warning():
        got += train_torch(model, opt, big)
    want += train_torch(ref, ref_opt, big)
    opt.synchronize()
    torch.use_deterministic_algorithms(False)
    assert got == pytest.approx(want, rel=1e-5)
    for a, b in zip(ref.parameters(), model.parameters()):
        assert torch.allclose(a, b, rtol=1e-4, atol=1e-6)
    hist = ramstream.memory_report(model)["plan"]["history"]
    assert [h["where"] for h in hist if h["change"].startswith("out of memory")] == ["model call"]
    ramstream.unwrap(model)


def test_a_real_dense_loss_oom_outside_the_model_is_noticed_at_the_next_forward():
    ref = _ref()
    model, opt = _wrapped(ref)
    (x, y) = batches(1, vocab=VOCAB, b=2, t=8, device=DEV)[0]
    (bx, by) = batches(1, vocab=VOCAB, b=256, t=8, seed=2, device=DEV)[0]
    dense_loss(model(x), y, 1 << 30).backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    h = model.hidden(bx)  # the check runs in the first block: planned as if the loss were chunked
    logits = model.head(h)
    _cap_now()
    try:
        with pytest.raises(torch.OutOfMemoryError) as e:
            torch.log_softmax(logits.float(), -1) * 2.0  # the dense loss's fp32 copies
    finally:
        _uncap()
    assert type(e.value) is torch.OutOfMemoryError
    del e, logits, h
    opt.zero_grad(set_to_none=True)
    with pytest.warns(RuntimeWarning, match="in the previous step, outside ramstream"):
        model.hidden(x)
    hist = ramstream.memory_report(model)["plan"]["history"]
    assert [h["where"] for h in hist if h["change"].startswith("out of memory")] == ["outside the model call"]
    ramstream.unwrap(model)
