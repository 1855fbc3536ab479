"""A dense loss that runs out of memory in a step the plan fit only by assuming a chunked loss
(issue 24, point 3; runtime/loss_oom.py): raised in the model's call it reaches the user as
PlanOutOfMemoryError with the dense logits' arithmetic, weights and optimizer state as torch's
without that step, and the next step with the chunked loss trains as torch does; raised outside
the model, the next forward logs, records and warns. A given or seen loss changes nothing. On the
CPU engine with injected GPU profiles and an injected out-of-memory error in the dense loss (the
allocator's count of such errors stood in for), as tests/test_loss_assumed.py."""

from __future__ import annotations

import pickle

import pytest
import torch
import torch.nn.functional as F

import ramstream
import ramstream.runtime.measure as measure_mod
from ramstream.runtime.apply import check_steps
from ramstream.runtime.inspect import model_shape, plan_for
from ramstream.runtime.tokens import PlanOutOfMemoryError, StepCheck

from _models import TinyGPT, batches, clone, gpu_profile, no_runtime_warning, train_torch

LR = 3e-3
VOCAB = 2048
GIB = 2**30


class LossGPT(TinyGPT):
    """TinyGPT whose loss is dense (TinyGPT's) or chunked (ramstream.chunked_cross_entropy); the
    dense loss runs out of memory (an injected torch.OutOfMemoryError, as the allocator raises)
    when its logits have more than `limit` tokens."""

    chunked = False
    limit = 1 << 30

    def hidden(self, idx):
        x = self.emb(idx)
        for b in self.blocks:
            x = b(x)
        return self.ln_f(x)

    def forward(self, idx, targets=None):
        h = self.hidden(idx)
        if targets is None:
            return self.head(h)
        if self.chunked:
            return ramstream.chunked_cross_entropy(h, self.head.weight, targets)
        return self.dense(h, targets)

    def dense(self, h, targets):
        return dense_loss(self.head(h), targets, self.limit)


def dense_loss(logits, targets, limit):
    if logits.shape[0] * logits.shape[1] > limit:
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 48.00 MiB (injected)")
    return F.cross_entropy(logits.float().view(-1, logits.size(-1)), targets.view(-1))


def _ref():
    torch.manual_seed(0)
    return LossGPT(vocab=VOCAB, d=64, n_blocks=4)


def _wrapped(ref, **options):
    """A clone of `ref` on the CPU engine with the plan for 2 x 8 tokens on a 64 MiB GPU profile and
    the step check wrap() installs on a GPU (tests/test_loss_assumed.py: 256 x 8 tokens fit only
    with the chunked loss)."""
    prof = gpu_profile(64)
    plan = plan_for(ref, profile=prof, batch=2, seq=8)
    model = clone(ref)
    model, opt = ramstream.wrap(
        model, torch.optim.AdamW(model.parameters(), lr=LR), device="cpu", plan=plan, **options
    )
    w = model._ramstream
    shape = model_shape(ref, list(ref.blocks), batch=2, seq=8, loss="dense")
    check_steps(model, w, plan, shape, prof, w.options, w.log)
    return model, opt


def _check(model) -> StepCheck:
    return next(h for h in model.blocks[0]._forward_pre_hooks.values() if isinstance(h, StepCheck))


def _torch_opt(ref):
    return torch.optim.AdamW(ref.parameters(), lr=LR, fused=True)


def _same_state(model, opt, ref, ref_opt) -> None:
    """Weights, moments and step counts equal torch's, bit for bit."""
    opt.synchronize()
    for a, b in zip(model.parameters(), ref.parameters()):
        assert torch.equal(a, b)
    got, want = opt.state_dict()["state"], ref_opt.state_dict()["state"]
    assert got.keys() == want.keys()
    for k in want:
        assert float(got[k]["step"]) == float(want[k]["step"])
        assert torch.equal(got[k]["exp_avg"], want[k]["exp_avg"])
        assert torch.equal(got[k]["exp_avg_sq"], want[k]["exp_avg_sq"])


def _arithmetic(tokens: int) -> tuple[int, str]:
    """The dense logits' bytes by hand: fp32 logits (4 B) plus their fp32 copy and gradient (8 B)."""
    n = tokens * VOCAB * (4 + 8)
    return n, f"{tokens} tokens x {VOCAB} vocab x 12 bytes (the logits at 4 bytes"


def test_a_dense_loss_out_of_memory_in_the_model_says_the_plan_assumed_a_chunked_loss():
    ref = _ref()
    model, opt = _wrapped(ref)
    small, big = batches(2, vocab=VOCAB, b=2, t=8), batches(1, vocab=VOCAB, b=256, t=8, seed=2)
    model.limit = ref.limit = 1024
    ref_opt = _torch_opt(ref)
    assert train_torch(model, opt, small) == train_torch(ref, ref_opt, small)  # dense, fits
    n0 = len(ramstream.memory_report(model)["plan"]["history"])
    with pytest.raises(PlanOutOfMemoryError) as e:
        model(*big[0])
    err = e.value
    assert isinstance(err, torch.OutOfMemoryError) and isinstance(err, MemoryError)
    assert type(err.__cause__) is torch.OutOfMemoryError and "injected" in str(err.__cause__)
    dense, words = _arithmetic(256 * 8)
    assert dense == 50331648  # 2048 x 2048 x 12
    msg = str(err)
    assert "batch 256 x seq 8 assumed a chunked loss" in msg and words in msg
    assert f"= {dense} bytes = {dense / GIB:.2f} GiB" in msg and "0.05 GiB" in msg
    counted = 1024 * VOCAB * 12  # one chunk of ramstream's default 1024 tokens
    assert f"one chunk of 1024 tokens ({counted / GIB:.2f} GiB)" in msg
    assert "chunked_cross_entropy" in msg and "loss='chunked'" in msg and "smaller batch" in msg
    assert "Weights and optimizer state are unchanged" in msg
    assert err.replanned is False and err.change is None
    assert err.assumed == {"batch": 256, "seq": 8, "tokens": 2048, "vocab": VOCAB, "bytes_per_logit": 12,
                           "dense_logits_bytes": dense, "counted_logits_bytes": counted}  # fmt: skip
    back = pickle.loads(pickle.dumps(err))
    assert type(back) is PlanOutOfMemoryError and back.assumed == err.assumed and str(back) == msg
    del e, err, back
    opt.zero_grad()  # the user drops the step
    _same_state(model, opt, ref, ref_opt)  # torch's state without the failed step
    rep = ramstream.memory_report(model)
    new = rep["plan"]["history"][n0:]
    assert new[-1]["change"] == "out of memory: a dense loss in a step planned with a chunked loss"
    assert new[-1]["where"] == "model call" and new[-1]["dense_logits_bytes"] == dense
    assert sum("assumed a chunked loss" in ev for ev in rep["events"]) == 1
    # the chunked loss now: the same step trains as torch's AdamW does, and the check learns it
    model.chunked = ref.chunked = True
    assert train_torch(model, opt, big) == train_torch(ref, ref_opt, big)
    _same_state(model, opt, ref, ref_opt)
    assert _check(model).session.loss_source == "seen"
    ramstream.unwrap(model)
    assert "forward" not in model.__dict__  # the wrapper is gone


def test_a_dense_loss_out_of_memory_outside_the_model_is_noticed_at_the_next_forward(monkeypatch):
    """The loss on the logits the model returned: no frame of ramstream's sees the error; the next
    forward reads the allocator's count (stood in for here) and logs, records and warns."""
    count = [7]
    monkeypatch.setattr(measure_mod, "oom_count", lambda dev: count[0])
    ref = _ref()
    model, opt = _wrapped(ref)
    (x, y), (bx, by) = batches(1, vocab=VOCAB, b=2, t=8)[0], batches(1, vocab=VOCAB, b=256, t=8, seed=2)[0]
    ref_opt = _torch_opt(ref)
    for m, o in ((model, opt), (ref, ref_opt)):
        dense_loss(m(x), y, 1024).backward()
        o.step()
        o.zero_grad()
    logits = model(bx)  # planned as if the loss were chunked
    assert _check(model).assumed_now is not None
    count[0] += 1  # the allocator's count goes up as torch raises
    with pytest.raises(torch.OutOfMemoryError) as e:
        dense_loss(logits, by, 1024)
    assert type(e.value) is torch.OutOfMemoryError  # raised where ramstream cannot change it
    del e, logits
    opt.zero_grad()
    n0 = len(ramstream.memory_report(model)["plan"]["history"])
    dense, words = _arithmetic(2048)
    with pytest.warns(RuntimeWarning, match="in the previous step, outside ramstream") as rec:
        loss = ramstream.chunked_cross_entropy(model.hidden(bx), model.head.weight, by)
    msg = str(rec[0].message)
    assert words in msg and f"= {dense} bytes" in msg and "updated nothing" in msg
    ref_loss = ramstream.chunked_cross_entropy(ref.hidden(bx), ref.head.weight, by)
    for lo, o in ((loss, opt), (ref_loss, ref_opt)):
        lo.backward()
        o.step()
        o.zero_grad()
    assert loss.item() == ref_loss.item()
    _same_state(model, opt, ref, ref_opt)
    hist = ramstream.memory_report(model)["plan"]["history"][n0:]
    oom = [h for h in hist if h["change"].startswith("out of memory")]
    assert len(oom) == 1 and oom[0]["where"] == "outside the model call" and oom[0]["tokens"] == 2048
    # once: the next forward says nothing more
    with no_runtime_warning():
        model(x)
    ramstream.unwrap(model)


@pytest.mark.parametrize("loss", ["chunked", "dense"])
def test_a_given_loss_changes_nothing(loss):
    """wrap(loss=...): no wrapper on forward; an out-of-memory error stays torch's own."""
    ref = _ref()
    model, opt = _wrapped(ref, loss=loss)
    assert "forward" not in model.__dict__
    model.limit = 8
    (x, y) = batches(1, vocab=VOCAB, b=2, t=8)[0]
    with pytest.raises(torch.OutOfMemoryError) as e:
        model(x, y)
    assert type(e.value) is torch.OutOfMemoryError
    ramstream.unwrap(model)


def test_a_seen_chunked_loss_changes_nothing():
    """A chunked loss ran on the head (loss source "seen"): a dense loss's error later stays torch's
    own, nothing is recorded."""
    ref = _ref()
    model, opt = _wrapped(ref)
    model.chunked = True
    train_torch(model, opt, batches(1, vocab=VOCAB, b=2, t=8))
    assert _check(model).session.loss_source == "seen"
    n0 = len(ramstream.memory_report(model)["plan"]["history"])
    model.chunked, model.limit = False, 1024
    with pytest.raises(torch.OutOfMemoryError) as e:
        model(*batches(1, vocab=VOCAB, b=256, t=8, seed=2)[0])
    assert type(e.value) is torch.OutOfMemoryError
    hist = ramstream.memory_report(model)["plan"]["history"][n0:]
    assert not any(h["change"].startswith("out of memory") for h in hist)
    ramstream.unwrap(model)


def test_an_error_in_a_step_the_dense_loss_fits_stays_torchs():
    """Loss source "default" (nothing assumed): the wrapper lets the error through as it is."""
    ref = _ref()
    model, opt = _wrapped(ref)
    assert "forward" in model.__dict__
    model.limit = 8
    with pytest.raises(torch.OutOfMemoryError) as e:
        model(*batches(1, vocab=VOCAB, b=2, t=8)[0])
    assert type(e.value) is torch.OutOfMemoryError
    ramstream.unwrap(model)


def test_the_wrapper_keeps_the_signature_and_comes_off():
    """Hugging Face's Trainer reads forward's signature; accelerate rebinds the innermost function."""
    import inspect
    import types

    ref = _ref()
    model, _ = _wrapped(ref)
    assert list(inspect.signature(model.forward).parameters) == ["idx", "targets"]
    assert model.forward.__func__.__wrapped__ is LossGPT.forward
    # accelerate's unwrap_model(keep_fp32_wrapper=False): the innermost function, bound again
    inner = model.forward
    while hasattr(inner, "__wrapped__"):
        inner = inner.__wrapped__
    (x, y) = batches(1, vocab=VOCAB, b=2, t=8)[0]
    assert torch.equal(types.MethodType(inner, model)(x, y), model(x, y))
    ramstream.unwrap(model)
    assert "forward" not in model.__dict__


def test_a_deep_copy_runs_its_own_weights():
    """copy.deepcopy of a guarded model (an EMA copy, say) rebinds the wrapper to the copy: the
    copy's forward computes with the copy's weights, not the original's."""
    import copy

    ref = _ref()
    model, _ = _wrapped(ref)
    twin = copy.deepcopy(model)
    with torch.no_grad():
        for p in twin.parameters():
            p.mul_(0.5)
    (x, y) = batches(1, vocab=VOCAB, b=2, t=8)[0]
    assert twin.forward.__self__ is twin
    assert not torch.equal(twin(x, y), model(x, y))
    ramstream.unwrap(model)
