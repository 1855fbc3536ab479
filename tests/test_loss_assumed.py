"""The loss a plan counts (issue 24, row R5): wrap() does not see the loss, so its plan counts a
dense cross-entropy's logits. A step that fits only with the chunked loss is planned as if its loss
were chunked (planner/revise.py loss_open; logged and in the plan history) and trains as torch does;
a chunked loss computed with the model's head tells the step check (runtime/heads.py), which plans
with it from then on; wrap(loss="dense") keeps the refusal. On the CPU engine with injected GPU
profiles, as tests/test_step_replan.py."""

from __future__ import annotations

import dataclasses
import gc
import weakref

import pytest
import torch

import ramstream
from ramstream.planner.revise import Measured, RevisionError, revise
from ramstream.runtime import heads
from ramstream.runtime.apply import check_steps
from ramstream.runtime.inspect import model_shape, plan_for
from ramstream.runtime.tokens import PlanOutOfMemoryError, StepCheck

from _models import TinyGPT, batches, clone, gpu_profile, train_torch

LR = 3e-3
VOCAB = 2048
APPLIED = {"param_offload": [], "activation_checkpointing": [], "activation_offload": False,
           "moment_dtype": "float32"}  # fmt: skip


class ChunkedGPT(TinyGPT):
    """TinyGPT whose loss is ramstream.chunked_cross_entropy of the final hidden states."""

    def forward(self, idx, targets):
        x = self.emb(idx)
        for b in self.blocks:
            x = b(x)
        return ramstream.chunked_cross_entropy(self.ln_f(x), self.head.weight, targets)


def _ref(cls=TinyGPT):
    torch.manual_seed(0)
    return cls(vocab=VOCAB, d=64, n_blocks=4)


def _shape(ref):
    return model_shape(ref, list(ref.blocks), batch=2, seq=8, loss="dense")


def _wrapped(ref, prof, **options):
    """A clone of `ref` on the CPU engine with the plan for 2 x 8 tokens on `prof` and the step check
    wrap() installs on a GPU."""
    plan = plan_for(ref, profile=prof, batch=2, seq=8)
    model = clone(ref)
    model, opt = ramstream.wrap(
        model, torch.optim.AdamW(model.parameters(), lr=LR), device="cpu", plan=plan, **options
    )
    w = model._ramstream
    check_steps(model, w, plan, _shape(ref), prof, w.options, w.log)
    return model, opt


def _check(model) -> StepCheck:
    return next(h for h in model.blocks[0]._forward_pre_hooks.values() if isinstance(h, StepCheck))


def test_revise_assumes_the_chunked_loss_only_when_the_dense_logits_decide():
    """64 MiB, 256 x 8 tokens: no lever fits the dense loss, the chunked one fits with blocks 2-3
    recomputing; the logits the revision does not count are the hand arithmetic's."""
    shape, prof = _shape(_ref()), gpu_profile(64)
    step = Measured(256, 8)
    with pytest.raises(RevisionError):
        revise(shape, prof, APPLIED, step)
    chunked = revise(dataclasses.replace(shape, loss="chunked"), prof, APPLIED, step)
    rev = revise(shape, prof, APPLIED, step, loss_open=True)
    assert rev.assumed == "chunked" and rev.shape.loss == "chunked"
    assert rev.changed == chunked.changed == {"activation_checkpointing": [2, 3]}
    # fp32 logits (4 B) + their fp32 copy and gradient (8 B) per token x vocab: all 2048 tokens
    # dense, one chunk of 1024 tokens chunked
    assert rev.uncounted_bytes == (2048 - 1024) * VOCAB * (4 + 8)
    # the logits term decides: the same step with a vocab of 64 fits the dense loss
    small_vocab = dataclasses.replace(shape, vocab=64)
    assert revise(small_vocab, prof, APPLIED, step, loss_open=True).assumed is None
    # a step that fits the dense loss assumes nothing; one that fits neither stays refused
    assert revise(shape, prof, APPLIED, Measured(128, 8), loss_open=True).assumed is None
    with pytest.raises(RevisionError):
        revise(shape, prof, APPLIED, Measured(1024, 8), loss_open=True)


def test_a_step_that_fits_only_with_the_chunked_loss_goes_on_as_torch_and_says_so():
    ref = _ref()
    model, opt = _wrapped(ref, gpu_profile(64))
    small, big = batches(2, vocab=VOCAB, b=2, t=8), batches(1, vocab=VOCAB, b=256, t=8, seed=2)
    want = train_torch(ref, torch.optim.AdamW(ref.parameters(), lr=LR, fused=True), small + big)
    got = train_torch(model, opt, small + big)
    assert got == want
    for a, b in zip(model.parameters(), ref.parameters()):
        assert torch.equal(a, b)
    rep = ramstream.memory_report(model)
    last = rep["plan"]["history"][-1]
    assert last["loss"] == "chunked" and last["loss_assumed"] is True
    assert last["uncounted_logits_bytes"] == (2048 - 1024) * VOCAB * 12
    assert last["recompute"] == [2, 3] and last["change"].startswith("re-planned")
    assert rep["plan"]["planner"]["loss"] == "chunked"
    said = [e for e in rep["events"] if "planned as if the loss were chunked" in e]
    assert len(said) == 1 and "0.02 GiB more" in said[0] and "loss='chunked'" in said[0]
    assert _check(model).loss == "chunked" and _check(model).session.loss_source == "assumed"
    ramstream.unwrap(model)


def test_with_loss_dense_given_the_step_is_refused_as_before():
    ref = _ref()
    model, opt = _wrapped(ref, gpu_profile(64), loss="dense")
    train_torch(model, opt, batches(1, vocab=VOCAB, b=2, t=8))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    (x, y) = batches(1, vocab=VOCAB, b=256, t=8, seed=2)[0]
    with pytest.raises(PlanOutOfMemoryError) as e:
        model(x, y)
    assert e.value.replanned is False and "planned as if" not in str(e.value)
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k]), k
    assert _check(model).loss == "dense"
    # a chunked loss given the head changes nothing either: the given loss stands
    h = model.ln_f(model.emb(x[:2]))
    ramstream.chunked_cross_entropy(h, model.head.weight, y[:2])
    assert _check(model).loss == "dense"
    ramstream.unwrap(model)


def test_a_chunked_loss_on_the_head_makes_the_check_plan_with_it_once():
    ref = _ref(ChunkedGPT)
    model, opt = _wrapped(ref, gpu_profile(64))
    check = _check(model)
    assert check.loss == "dense" and check.session.loss_source == "default"
    n0 = len(ramstream.memory_report(model)["plan"]["history"])
    small, big = batches(2, vocab=VOCAB, b=2, t=8), batches(1, vocab=VOCAB, b=256, t=8, seed=2)
    want = train_torch(ref, torch.optim.AdamW(ref.parameters(), lr=LR, fused=True), small + big)
    got = train_torch(model, opt, small)
    assert check.loss == "chunked" and check.session.loss_source == "seen"
    rep = ramstream.memory_report(model)["plan"]
    seen = [h for h in rep["history"][n0:] if h.get("change") == "loss: chunked (seen)"]
    assert len(seen) == 1 and rep["planner"]["loss"] == "chunked"
    got += train_torch(model, opt, big)  # planned with the chunked loss: nothing assumed
    assert got == want
    assert not any(h.get("loss_assumed") for h in ramstream.memory_report(model)["plan"]["history"])
    assert ramstream.memory_report(model)["plan"]["history"][-1]["recompute"] == [2, 3]
    ramstream.unwrap(model)


def test_the_head_registry_holds_no_reference():
    class Check:
        def __init__(self):
            self.got = []

        def learn_loss(self, loss):
            self.got.append(loss)

    w, other, check = torch.zeros(4, 2), torch.zeros(4, 2), Check()
    heads.register(w, check)
    heads.seen(other)
    heads.seen(w)
    assert check.got == ["chunked"]
    ref = weakref.ref(check)
    del check
    gc.collect()
    assert ref() is None
    heads.seen(w)  # the check went away: nothing happens, the entry goes
    assert id(w) not in heads._HEADS
    heads.register(w, Check())
    wid = id(w)
    del w
    gc.collect()
    assert wid not in heads._HEADS
