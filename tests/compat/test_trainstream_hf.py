"""TrainStream 0.4.1's Hugging Face scripts (trainstream.integrations.huggingface) with ramstream's
module under that name: `model, optimizer = wrap_hf(model, optimizer)` in a hand-written loop, and
TrainStreamTrainer's public attributes; the numbers against torch and the stock Trainer."""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")

import ramstream as trainstream  # noqa: E402
from ramstream import OffloadAdamW  # noqa: E402
from ramstream.integrations.huggingface import (  # noqa: E402
    CausalLMLoss,
    TrainStreamTrainer,
    decoder_layers,
    lm_head_of,
    wrap_hf,
)

pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning", "ignore::UserWarning")

VOCAB = 128


def _llama(seed: int = 0):
    torch.manual_seed(seed)
    cfg = transformers.LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=32,
    )
    return transformers.LlamaForCausalLM(cfg)


def _rows(n: int, t: int = 12, seed: int = 1) -> list[dict]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        ids = torch.randint(0, VOCAB, (t,), generator=g)
        out.append({"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids.clone()})
    return out


def _batch(rows):
    return {k: torch.stack([r[k] for r in rows]) for k in rows[0]}


def _params(m):
    return [p.detach() for p in m.parameters()]


def test_wrap_hf_returns_model_and_optimizer_and_trains_like_torch():
    ref, model = _llama(), _llama()
    assert decoder_layers(model) == list(model.model.layers)
    assert lm_head_of(model) is model.lm_head
    t_opt = torch.optim.AdamW(ref.parameters(), lr=3e-3, foreach=False)
    model, optimizer = wrap_hf(model, torch.optim.AdamW(model.parameters(), lr=3e-3), device="cpu")
    assert isinstance(optimizer, OffloadAdamW)
    want, got = [], []
    try:
        for step in range(4):
            b = _batch(_rows(2, seed=step))
            for m, opt, out in ((ref, t_opt, want), (model, optimizer, got)):
                loss = m(**b).loss  # the model's own loss, as TrainStream's README loop
                loss.backward()
                opt.step()
                opt.zero_grad()
                out.append(loss.item())
        optimizer.synchronize()
        assert got == pytest.approx(want, abs=1e-5)
        assert max(float((a - b).abs().max()) for a, b in zip(_params(ref), _params(model))) < 1e-5
        # ramstream's chunked loss stays reachable
        b = _batch(_rows(2, seed=9))
        assert isinstance(model.ramstream_loss, CausalLMLoss)
        assert torch.allclose(model.ramstream_loss(**b), model(**b).loss, atol=1e-5)
    finally:
        trainstream.unwrap(model)


def test_wrap_hf_return_loss_gives_the_loss_helper_too():
    model, optimizer, loss_fn = wrap_hf(_llama(), device="cpu", return_loss=True)
    try:
        assert loss_fn is model.ramstream_loss and isinstance(optimizer, OffloadAdamW)
    finally:
        trainstream.unwrap(model)
    with pytest.raises(ValueError, match="return_loss"):
        wrap_hf(_llama(), device="cpu", return_loss=1)


def _args(out, **kw):
    return transformers.TrainingArguments(
        output_dir=str(out),
        per_device_train_batch_size=2,
        gradient_accumulation_steps=2,
        max_steps=3,
        learning_rate=3e-3,
        max_grad_norm=1.0,
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        use_cpu=True,
        seed=0,
        disable_tqdm=True,
        **kw,
    )


def test_trainer_has_trainstream_attributes_and_trains_like_the_stock_trainer(tmp_path):
    rows = _rows(12)
    stock = transformers.Trainer(model=_llama(), args=_args(tmp_path / "a"), train_dataset=rows)
    stock.train()
    trainer = TrainStreamTrainer(
        model=_llama(),
        args=_args(tmp_path / "b"),
        train_dataset=rows,
        trainstream={"moment_dtype": "float32"},
    )
    assert trainer.ts_optimizer is None and trainer.chunked_loss_used == 0
    assert trainer.trainstream_config == {"moment_dtype": "float32"}
    assert trainer.chunked_loss is True and trainer.loss_chunk_size == 1024
    trainer.train()
    assert isinstance(trainer.ts_optimizer, OffloadAdamW)
    assert trainer.chunked_loss_used == 3 * 2  # every micro-batch's loss was chunked
    assert trainer.ts_optimizer.last_grad_norm is not None
    want = [e["loss"] for e in stock.state.log_history if "loss" in e]
    got = [e["loss"] for e in trainer.state.log_history if "loss" in e]
    assert got == pytest.approx(want, rel=2e-4)  # chunked vs dense loss: float rounding only
    off = TrainStreamTrainer(
        model=_llama(), args=_args(tmp_path / "c"), train_dataset=rows, trainstream={"chunked_loss": False}
    )
    off.train()
    assert off.chunked_loss is False and off.chunked_loss_used == 0
    assert [e["loss"] for e in off.state.log_history if "loss" in e] == pytest.approx(want, abs=1e-5)
