"""TrainStream 0.4.1's log figures (trainstream.integrations.huggingface): TrainStreamMetrics(opt)
.collect(), TrainStreamCallback for a stock Trainer, and the ts_* keys TrainStreamTrainer adds to
each training log, each checked against ramstream's own counters (optimizer.stats(),
memory_report, ramstream.memory_stats) and the bytes the gradients and weights must take."""

from __future__ import annotations

import ast

import pytest
import torch
import torch.nn.functional as F

transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")

import ramstream as trainstream  # noqa: E402
from ramstream import OffloadAdamW  # noqa: E402
from ramstream.integrations.hf_metrics import ramstream_figures  # noqa: E402
from ramstream.integrations.huggingface import (  # noqa: E402
    TrainStreamCallback,
    TrainStreamMetrics,
    TrainStreamTrainer,
)

pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning", "ignore::UserWarning")

GIB = 2**30
WIDTH = 1024  # 4 x 1M weights: 16 MiB of fp32 gradients a step, visible at 3 decimals of GiB
KEYS = {"ts_vram_alloc_gb", "ts_vram_peak_gb", "ts_pinned_gb", "ts_host_state_gb"}


def _mlp():
    torch.manual_seed(0)
    layers = []
    for _ in range(4):
        layers += [torch.nn.Linear(WIDTH, WIDTH), torch.nn.GELU()]
    return torch.nn.Sequential(*layers)


def _steps(model, opt, n, seed):
    g = torch.Generator().manual_seed(seed)
    for _ in range(n):
        x = torch.randn(8, WIDTH, generator=g)
        F.mse_loss(model(x), torch.zeros_like(x)).backward()
        opt.step()
        opt.zero_grad()
    opt.synchronize()


def test_trainstream_metrics_collect_is_ramstreams_counters_in_gib_since_the_previous_call():
    model = _mlp()
    numel = sum(p.numel() for p in model.parameters())
    opt = OffloadAdamW(model.parameters(), lr=1e-3).attach(model)
    try:
        metrics = TrainStreamMetrics(opt)
        assert metrics.opt is opt
        _steps(model, opt, 1, seed=0)
        first = metrics.collect()
        assert set(first) == KEYS  # traffic needs a previous call
        s0 = opt.stats()
        _steps(model, opt, 3, seed=1)
        second = metrics.collect()
        s1 = opt.stats()
        assert set(second) == KEYS | {"ts_d2h_gb", "ts_h2d_gb"}
        # every trained element's fp32 gradient goes to the host once a step; no weight comes back
        # on the CPU engine (the host updates the weights in place)
        d2h, h2d = s1["bytes_d2h"] - s0["bytes_d2h"], s1["bytes_h2d"] - s0["bytes_h2d"]
        assert d2h == 3 * numel * 4 and h2d == 0
        assert second["ts_d2h_gb"] == round(d2h / GIB, 3) > 0
        assert second["ts_h2d_gb"] == round(h2d / GIB, 3)
        rep = trainstream.memory_report(model)
        assert rep["transfers"]["bytes_d2h"] == s1["bytes_d2h"]  # no activation paging here
        host = rep["optimizer"]["host_state_bytes"]
        assert host >= 3 * 4 * numel  # fp32 master and two moments
        assert second["ts_host_state_gb"] == round(host / GIB, 3) == round(s1["host_state_bytes"] / GIB, 3)
        assert second["ts_pinned_gb"] == round(trainstream.memory_stats()["bytes_in_use"] / GIB, 3)
        assert second["ts_vram_alloc_gb"] == second["ts_vram_peak_gb"] == 0.0  # the CPU engine
        # ramstream's figures for the same counters, in GB since training began
        own = ramstream_figures(model, opt)
        assert own["ramstream_d2h_gb"] == s1["bytes_d2h"] / 1e9
        assert own["ramstream_h2d_gb"] == s1["bytes_h2d"] / 1e9
        assert own["ramstream_host_state_gb"] == host / 1e9
        assert own["ramstream_vram_alloc_gb"] == own["ramstream_vram_peak_gb"] == 0.0
        assert metrics.collect()["ts_d2h_gb"] == 0.0  # nothing moved since
    finally:
        trainstream.unwrap(model)
    with pytest.raises(TypeError, match="OffloadAdamW"):
        TrainStreamMetrics(torch.optim.AdamW(_mlp().parameters()))


@pytest.mark.cuda
def test_trainstream_metrics_device_figures_cuda():
    model = _mlp().cuda()
    numel = sum(p.numel() for p in model.parameters())
    opt = OffloadAdamW(model.parameters(), lr=1e-3).attach(model)
    try:
        metrics = TrainStreamMetrics(opt)
        metrics.collect()
        s0 = opt.stats()
        g = torch.Generator().manual_seed(0)
        for _ in range(2):
            x = torch.randn(8, WIDTH, generator=g).cuda()
            F.mse_loss(model(x), torch.zeros_like(x)).backward()
            opt.step()
            opt.zero_grad()
        opt.synchronize()
        got = metrics.collect()
        s1 = opt.stats()
        assert got["ts_vram_alloc_gb"] == round(torch.cuda.memory_allocated() / GIB, 3) > 0
        assert got["ts_vram_peak_gb"] == round(torch.cuda.max_memory_allocated() / GIB, 3)
        h2d = s1["bytes_h2d"] - s0["bytes_h2d"]
        assert h2d >= 2 * numel * 4 and got["ts_h2d_gb"] == round(h2d / GIB, 3) > 0
    finally:
        trainstream.unwrap(model)


def test_trainstream_metrics_of_a_standalone_optimizer_count_its_own_copies():
    model = _mlp()
    opt = OffloadAdamW(model.parameters(), lr=1e-3)  # no attach(): no model to report on
    metrics = TrainStreamMetrics(opt)
    metrics.collect()
    _steps(model, opt, 2, seed=0)
    got = metrics.collect()
    assert got["ts_d2h_gb"] == round(opt.stats()["bytes_d2h"] / GIB, 3) > 0


def test_trainstream_callback_prints_the_figures_on_the_main_process_only(capsys):
    model = _mlp()
    opt = OffloadAdamW(model.parameters(), lr=1e-3).attach(model)
    try:
        cb = TrainStreamCallback(opt)
        assert isinstance(cb, transformers.TrainerCallback) and isinstance(cb.metrics, TrainStreamMetrics)
        state, control = transformers.TrainerState(), transformers.TrainerControl()
        args = None
        cb.on_log(args, state, control, logs={"loss": 1.0})
        printed = capsys.readouterr().out
        assert set(ast.literal_eval(printed)) == KEYS  # a dict of the figures, as TrainStream prints it
        state.is_world_process_zero = False
        cb.on_log(args, state, control, logs={"loss": 1.0})
        assert capsys.readouterr().out == ""
    finally:
        trainstream.unwrap(model)


def _llama():
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        vocab_size=128,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=32,
    )
    return transformers.LlamaForCausalLM(cfg)


def _rows():
    g = torch.Generator().manual_seed(1)
    rows = []
    for _ in range(8):
        ids = torch.randint(0, 128, (12,), generator=g)
        rows.append({"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids.clone()})
    return rows


def test_trainer_logs_carry_trainstreams_keys_beside_ramstreams(tmp_path):
    rows = _rows()
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path),
        per_device_train_batch_size=2,
        max_steps=3,
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        use_cpu=True,
        disable_tqdm=True,
    )
    trainer = TrainStreamTrainer(model=_llama(), args=args, train_dataset=rows)
    trainer.train()
    logs = [e for e in trainer.state.log_history if "loss" in e]
    assert len(logs) == 3
    own = {
        "ramstream_vram_alloc_gb",
        "ramstream_vram_peak_gb",
        "ramstream_pinned_gb",
        "ramstream_host_state_gb",
        "ramstream_d2h_gb",
        "ramstream_h2d_gb",
        "ramstream_skipped_steps",
    }
    assert own | KEYS <= set(logs[0]) and "ts_d2h_gb" not in logs[0]
    assert all(own | KEYS | {"ts_d2h_gb", "ts_h2d_gb"} <= set(e) for e in logs[1:])
    host = trainstream.memory_report(trainer.model)["optimizer"]["host_state_bytes"]
    assert all(e["ts_host_state_gb"] == round(host / GIB, 3) for e in logs)
    assert all(e["ramstream_host_state_gb"] == host / 1e9 for e in logs)
    d2h = [e["ramstream_d2h_gb"] for e in logs]
    assert [e["ts_d2h_gb"] for e in logs[1:]] == pytest.approx(
        [(b - a) * 1e9 / GIB for a, b in zip(d2h, d2h[1:])], abs=1e-3
    )


def test_stock_trainer_driving_an_offload_adamw_with_trainstream_callback(tmp_path, capsys):
    """TrainStream's use of TrainStreamCallback: a stock Trainer, an OffloadAdamW attached by hand.
    The stock Trainer clips (max_grad_norm=1.0) by torch.nn.utils.clip_grad_norm_ before step(),
    so the updates must wait for step(): eager=False (TrainStream's name for eager_updates)."""
    rows = _rows()

    def args(out):
        return transformers.TrainingArguments(
            output_dir=str(out),
            per_device_train_batch_size=2,
            max_steps=3,
            logging_steps=1,
            learning_rate=3e-3,
            max_grad_norm=1.0,
            save_strategy="no",
            report_to=[],
            use_cpu=True,
            disable_tqdm=True,
            seed=0,
        )

    ref = _llama()
    t_opt = torch.optim.AdamW(ref.parameters(), lr=3e-3, weight_decay=0.0, foreach=False)
    stock = transformers.Trainer(
        model=ref, args=args(tmp_path / "a"), train_dataset=rows, optimizers=(t_opt, None)
    )
    stock.train()
    model = _llama()
    opt = OffloadAdamW(model.parameters(), lr=3e-3, weight_decay=0.0, eager=False).attach(model)
    try:
        trainer = transformers.Trainer(
            model=model,
            args=args(tmp_path / "b"),
            train_dataset=rows,
            optimizers=(opt, None),
            callbacks=[TrainStreamCallback(opt)],
        )
        capsys.readouterr()
        trainer.train()
        printed = [
            ast.literal_eval(line)
            for line in capsys.readouterr().out.splitlines()
            if line.startswith("{'ts_")
        ]
        opt.synchronize()
        want = [(e["loss"], e["grad_norm"]) for e in stock.state.log_history if "loss" in e]
        got = [(e["loss"], e["grad_norm"]) for e in trainer.state.log_history if "loss" in e]
        assert [g[0] for g in got] == pytest.approx([w[0] for w in want], rel=1e-6)
        assert [g[1] for g in got] == pytest.approx([w[1] for w in want], rel=1e-5)
        diff = max(float((p - q).abs().max()) for p, q in zip(ref.parameters(), model.parameters()))
        assert diff < 1e-6
        # printed at every log (3 training logs and the final summary), not added to the history
        assert len(printed) == 4 and set(printed[0]) == KEYS
        assert all(KEYS | {"ts_d2h_gb", "ts_h2d_gb"} == set(p) for p in printed[1:])
        assert not any(k.startswith("ts_") for e in trainer.state.log_history for k in e)
    finally:
        trainstream.unwrap(model)
