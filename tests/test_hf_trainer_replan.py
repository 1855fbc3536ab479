"""OffloadTrainer and a step larger than the plan (issue 24, point 3): when the plan can fit it by
making more layers recompute, the step goes on under the revised plan (no re-run: the Trainer calls
the model, whose own pre-hook runs the check before any layer); only where the check runs first in
the first layer (the model's forward run directly: here its model-level hook removed) and every layer
must recompute, the first too, PlanOutOfMemoryError(replanned=True) -> the Trainer runs the same
training step once more; a second refusal, or one that changed nothing,
propagates. On the CPU engine, with the step check wrap() installs on a GPU installed at train
begin on an injected GPU profile."""

from __future__ import annotations

import logging

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")

import ramstream  # noqa: E402
from ramstream.integrations.huggingface import OffloadTrainer, find_decoder_layers  # noqa: E402
from ramstream.planner import plan_training  # noqa: E402
from ramstream.planner.profile import HardwareProfile  # noqa: E402
from ramstream.runtime.apply import check_steps  # noqa: E402
from ramstream.runtime.inspect import model_shape  # noqa: E402
from ramstream.runtime.tokens import PlanOutOfMemoryError  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning", "ignore::UserWarning")

VOCAB = 128
GIB = 2**30


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("hf") / "llama")
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)  # fmt: skip
    transformers.LlamaForCausalLM(cfg).save_pretrained(path)
    return path


def _data(n: int, t: int = 16) -> list[dict]:
    g = torch.Generator().manual_seed(1)
    rows = []
    for _ in range(n):
        ids = torch.randint(0, VOCAB, (t,), generator=g)
        rows.append({"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids})
    return rows


def _trainer(llama_dir, out, callbacks=(), max_steps: int = 3) -> OffloadTrainer:
    args = transformers.TrainingArguments(
        output_dir=str(out), per_device_train_batch_size=2, gradient_accumulation_steps=2, max_steps=max_steps,
        learning_rate=3e-3, max_grad_norm=0.5, logging_steps=1, save_strategy="no", eval_strategy="no",
        report_to=[], use_cpu=True, seed=0, disable_tqdm=True, optim="adamw_torch",
    )  # fmt: skip
    model = transformers.AutoModelForCausalLM.from_pretrained(llama_dir)
    return OffloadTrainer(
        model=model, args=args, train_dataset=_data(4 * max_steps), callbacks=list(callbacks),
        ramstream={"device": "cpu"},
    )  # fmt: skip


def _revision(check, batch: int, seq: int) -> list[int] | None:
    """The layers the check's re-plan for a batch x seq step recomputes; None when the applied plan
    fits it or nothing does."""
    from ramstream.planner import PlanError
    from ramstream.planner.replan import replan_recompute

    fixed = check._now()
    shape = check.shape.with_tokens(batch=batch, seq=seq)
    try:
        plan_training(shape, check.profile, quantize="none", _suggest=False, **fixed)
        return None
    except PlanError:
        pass
    rest = {k: v for k, v in fixed.items() if k != "activation_checkpointing"}
    try:
        plan = replan_recompute(shape, check.profile, [], order="back", **rest)
    except PlanError:
        return None
    return [i for i, m in enumerate(plan.activations) if m == "recompute"]


class _SmallPlan(transformers.TrainerCallback):
    """At train begin, the step check wrap() installs on a GPU, for a plan made for 1 x 4 tokens on a
    GPU with a few MiB free, the first (from 1440 KiB down) on which the Trainer's 2 x 16 token steps
    need `want` layers recomputed (the planner's answer, from the back)."""

    def __init__(self, want: list[int], model_hook: bool = True) -> None:
        self.want, self.free_kib, self.model_hook = want, None, model_hook

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        from ramstream.runtime.tokens import StepCheck

        w = model._ramstream
        layers = find_decoder_layers(model)
        shape = model_shape(model, layers, batch=1, seq=4, loss="chunked")
        for kib in range(1440, 1200, -10):
            prof = HardwareProfile(
                device="cuda", vram_total=4 * GIB, vram_free=kib << 10, ram_total=64 * GIB,
                ram_available=64 * GIB, pin_budget=32 * GIB, h2d_gbps=54.9, d2h_gbps=55.0,
                duplex_gbps=49.5, adamw_gbps=127.7, matmul_tflops=790.0, source="given",
            )  # fmt: skip
            plan = plan_training(
                shape, prof, quantize="none", activation_checkpointing=[], activation_offload=False
            )
            n = len(w.handles)
            check_steps(model, w, plan, shape, prof, w.options, w.log)  # the layer's and the model's hooks
            check = next(h for h in layers[0]._forward_pre_hooks.values() if isinstance(h, StepCheck))
            if _revision(check, 2, 16) == self.want:
                self.free_kib = kib
                if not self.model_hook:
                    w.handles.pop().remove()  # the model's (added last): only the first layer checks
                return
            while len(w.handles) > n:
                w.handles.pop().remove()
        raise AssertionError(f"no GPU size on which 2 x 16 tokens need layers {self.want} recomputed")


def _losses(t) -> list:
    return [e["loss"] for e in t.state.log_history if "loss" in e]


@pytest.fixture(scope="module")
def plain(llama_dir, tmp_path_factory):
    t = _trainer(llama_dir, tmp_path_factory.mktemp("plain"))
    t.train()
    return t


@pytest.mark.parametrize(
    "want,model_hook,rerun",
    [([1, 2], True, False), ([0, 1, 2], True, False), ([0, 1, 2], False, True)],
    ids=["goes-on", "every-layer-goes-on", "every-layer-from-the-first-layer-re-run"],
)
def test_a_larger_step_is_re_planned_and_trains_as_without_the_check(
    llama_dir, tmp_path, caplog, plain, want, model_hook, rerun
):
    caplog.set_level(logging.INFO, logger="ramstream")
    small = _SmallPlan(want, model_hook)
    checked = _trainer(llama_dir, tmp_path / "checked", callbacks=[small])
    checked.train()
    assert small.free_kib is not None
    what = f"now recomputing blocks {'0-2' if 0 in want else '1-2'} (was none)"
    reruns = [r for r in caplog.records if "re-running the step" in r.getMessage()]
    if rerun:  # the first layer must recompute too: refused before anything ran, run once more
        assert len(reruns) == 1 and what in reruns[0].getMessage()
    else:  # the layers after the first recompute from that very step: it goes on
        assert reruns == []
    rep = ramstream.memory_report(checked.model)["plan"]
    assert [h["change"] for h in rep["history"] if h["change"].startswith("re-planned")] == [
        "re-planned: " + what
    ]
    assert rep["recompute"] == want
    events = ramstream.memory_report(checked.model)["events"]
    assert any(what in e and e.endswith("the step goes on") for e in events) is not rerun
    assert checked.state.global_step == plain.state.global_step == 3
    assert _losses(checked) == _losses(plain)
    for (n, a), (_, b) in zip(plain.model.named_parameters(), checked.model.named_parameters()):
        assert torch.equal(a.detach(), b.detach()), n  # recomputing layers is bit-exact


@pytest.mark.parametrize("replanned", [True, False])
def test_a_second_refusal_or_one_that_changed_nothing_propagates(llama_dir, tmp_path, monkeypatch, replanned):
    calls = []

    def refuse(self, model, inputs, num_items_in_batch=None):
        calls.append(1)
        raise PlanOutOfMemoryError("ramstream: refused (test)", replanned=replanned)

    monkeypatch.setattr(transformers.Trainer, "training_step", refuse)
    t = _trainer(llama_dir, tmp_path, max_steps=1)
    with pytest.raises(PlanOutOfMemoryError, match="refused"):
        t.train()
    assert len(calls) == (2 if replanned else 1)
