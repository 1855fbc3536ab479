"""OffloadTrainer against the stock transformers Trainer on the CPU engine: tiny configs saved with
save_pretrained (no downloads), 10 steps with gradient accumulation, clipping, a warm-up schedule
and evaluation; the chunked loss and HF's, activation paging, weight streaming, LoRA, tied
embeddings; checkpoints that resume exactly and load across the two trainers; fp16 refused."""

from __future__ import annotations

import logging
import os

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")

import ramstream  # noqa: E402
from ramstream.integrations.huggingface import (  # noqa: E402
    CausalLMLoss,
    OffloadTrainer,
    TrainStreamTrainer,
    find_decoder_layers,
    wrap_hf,
)

pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning", "ignore::UserWarning")

VOCAB = 128
TOL = 2e-4


def _llama_dir(root, name="llama"):
    path = os.path.join(root, name)
    if not os.path.exists(path):
        torch.manual_seed(0)
        cfg = transformers.LlamaConfig(
            vocab_size=VOCAB,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=3,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=64,
        )
        transformers.LlamaForCausalLM(cfg).save_pretrained(path)
    return path


def _gpt2_dir(root):
    path = os.path.join(root, "gpt2")
    if not os.path.exists(path):
        torch.manual_seed(0)
        cfg = transformers.GPT2Config(
            vocab_size=VOCAB, n_embd=64, n_layer=3, n_head=4, n_positions=64, bos_token_id=0, eos_token_id=0
        )
        cfg.resid_pdrop = cfg.embd_pdrop = cfg.attn_pdrop = 0.0
        transformers.GPT2LMHeadModel(cfg).save_pretrained(path)
    return path


def _data(n: int, t: int = 16, seed: int = 1) -> list[dict]:
    """Rows of one length; every other row left-padded by a varying amount (mask 0, label -100)."""
    g = torch.Generator().manual_seed(seed)
    rows = []
    for i in range(n):
        ids = torch.randint(0, VOCAB, (t,), generator=g)
        mask = torch.ones_like(ids)
        if i % 2 == 0:
            mask[: 2 + i % 5] = 0
        rows.append({"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)})
    return rows


def _args(out, **kw):
    base = dict(
        output_dir=str(out),
        per_device_train_batch_size=2,
        per_device_eval_batch_size=4,
        gradient_accumulation_steps=2,
        max_steps=10,
        learning_rate=3e-3,
        weight_decay=0.05,
        warmup_steps=3,
        lr_scheduler_type="linear",
        max_grad_norm=0.5,
        logging_steps=1,
        save_strategy="no",
        eval_strategy="steps",
        eval_steps=5,
        report_to=[],
        use_cpu=True,
        seed=0,
        disable_tqdm=True,
        optim="adamw_torch",
    )
    base.update(kw)
    return transformers.TrainingArguments(**base)


def _losses(trainer) -> tuple[list[float], list[float]]:
    h = trainer.state.log_history
    return [e["loss"] for e in h if "loss" in e], [e["eval_loss"] for e in h if "eval_loss" in e]


def _run(cls, model, out, train, evald=None, resume=None, **kw):
    args_kw = {k: kw.pop(k) for k in list(kw) if k not in ("ramstream", "trainstream")}
    trainer = cls(model=model, args=_args(out, **args_kw), train_dataset=train, eval_dataset=evald, **kw)
    trainer.train(resume_from_checkpoint=resume)
    return trainer


def _params(model) -> dict[str, torch.Tensor]:
    return {n: p.detach().float().clone() for n, p in model.named_parameters()}


def _close(a: dict, b: dict, tol: float) -> float:
    assert a.keys() == b.keys()
    return max((a[k] - b[k]).abs().max().item() for k in a)


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return str(tmp_path_factory.mktemp("hf"))


@pytest.fixture(scope="module")
def stock_llama(root):
    model = transformers.AutoModelForCausalLM.from_pretrained(_llama_dir(root))
    t = _run(transformers.Trainer, model, os.path.join(root, "stock"), _data(40), _data(8, seed=9))
    return _losses(t), _params(t.model)


@pytest.mark.parametrize(
    "opts",
    [
        {"device": "cpu"},
        {"device": "cpu", "chunked_loss": False},
        {"device": "cpu", "activation_offload": True, "min_offload_bytes": 0},
        {"device": "cpu", "param_offload": True},
    ],
    ids=["chunked", "hf_loss", "activation_offload", "param_offload"],
)
def test_losses_equal_the_stock_trainer(root, stock_llama, opts, tmp_path):
    (ref_loss, ref_eval), ref_w = stock_llama
    model = transformers.AutoModelForCausalLM.from_pretrained(_llama_dir(root))
    t = _run(OffloadTrainer, model, tmp_path, _data(40), _data(8, seed=9), ramstream=dict(opts))
    loss, ev = _losses(t)
    assert len(loss) == len(ref_loss) == 10 and len(ev) == len(ref_eval) == 2
    assert max(abs(a - b) for a, b in zip(loss, ref_loss)) < TOL
    assert max(abs(a - b) for a, b in zip(ev, ref_eval)) < TOL
    assert _close(_params(t.model), ref_w, TOL) < TOL
    rep = ramstream.memory_report(t.model)
    opt = t.optimizer.optimizer  # accelerate's wrapper around ramstream's optimizer
    assert isinstance(opt, ramstream.OffloadAdamW)
    assert opt.max_grad_norm == 0.5 and opt.accumulation_steps == 2
    assert opt._engine.last_grad_norm > 0.5  # clipping ran and clipped
    if opts.get("chunked_loss", True):  # the chunked loss ran (HF's loss otherwise)
        assert t._ramstream_loss is not None and t._ramstream_loss.reason is None
    else:
        assert t._ramstream_loss is None
    if opts.get("param_offload"):
        assert rep["params"]["streamed_blocks"] and rep["params"]["loads"] > 0
    if opts.get("activation_offload"):
        assert rep["activations"]["packed_bytes"] > 0


def test_logs_carry_ramstream_figures_and_the_plan_once(root, tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="ramstream")
    model = transformers.AutoModelForCausalLM.from_pretrained(_llama_dir(root))
    t = _run(
        TrainStreamTrainer,
        model,
        tmp_path,
        _data(40),
        max_steps=4,
        eval_strategy="no",
        trainstream={"device": "cpu"},
    )
    assert t.place_model_on_device is False  # wrap() places the model (streamed blocks stay on the host)
    assert type(t.args) is transformers.TrainingArguments  # restored: training_args.bin unpickles anywhere
    train_logs = [e for e in t.state.log_history if "loss" in e]
    assert len(train_logs) == 4
    rep = ramstream.memory_report(t.model)["optimizer"]
    d2h = []
    for e in train_logs:
        assert e["ramstream_host_state_gb"] == rep["host_state_bytes"] / 1e9
        assert e["ramstream_vram_alloc_gb"] == 0.0 == e["ts_vram_alloc_gb"]  # the CPU engine
        # TrainStream's ts_ keys with its meanings: GiB, traffic since the previous log
        assert e["ts_host_state_gb"] == round(rep["host_state_bytes"] / 2**30, 3)
        d2h.append(e["ramstream_d2h_gb"])
    assert d2h == sorted(d2h) and d2h[0] > 0 and d2h[-1] == rep["stats"]["bytes_d2h"] / 1e9
    assert "ts_d2h_gb" not in train_logs[0]
    since = [(b - a) * 1e9 / 2**30 for a, b in zip(d2h, d2h[1:])]
    assert [e["ts_d2h_gb"] for e in train_logs[1:]] == pytest.approx(since, abs=1e-3)
    plans = [r for r in caplog.records if r.getMessage().startswith("ramstream: plan")]
    assert len(plans) == 1
    assert any("wrapped:" in r.getMessage() for r in caplog.records)


def test_lora_offloads_only_the_adapters(root, tmp_path):
    peft = pytest.importorskip("peft")

    def lora():
        base = transformers.AutoModelForCausalLM.from_pretrained(_llama_dir(root))
        m = peft.get_peft_model(base, peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]))
        g = torch.Generator().manual_seed(7)
        with torch.no_grad():
            for n, p in m.named_parameters():
                if "lora_B" in n:
                    p.copy_(torch.randn(p.shape, generator=g) * 0.05)
        return m

    ref = _run(transformers.Trainer, lora(), tmp_path / "stock", _data(40), eval_strategy="no")
    t = _run(
        OffloadTrainer, lora(), tmp_path / "ours", _data(40), eval_strategy="no", ramstream={"device": "cpu"}
    )
    (a, _), (b, _) = _losses(ref), _losses(t)
    assert max(abs(x - y) for x, y in zip(a, b)) < TOL
    adapters = {id(p): p for n, p in t.model.named_parameters() if p.requires_grad}
    assert adapters and all("lora_" in n for n, p in t.model.named_parameters() if p.requires_grad)
    engine = t.optimizer.optimizer._engine
    assert {id(s.param) for s in engine.slots} == set(adapters)
    numel = sum(p.numel() for p in adapters.values())
    held = sum(b.numel for b in engine.buckets)  # bucket elements: the adapters plus alignment padding
    assert numel <= held < numel + 128 * len(adapters)
    # fp32 master + two fp32 moments + the fp32 accumulation sum (gradient_accumulation_steps=2)
    host = ramstream.memory_report(t.model)["optimizer"]["host_state_bytes"]
    assert host == held * (4 + 4 + 4 + 4)


def test_tied_embeddings_with_weight_streaming(root, tmp_path):
    ref = _run(
        transformers.Trainer,
        transformers.AutoModelForCausalLM.from_pretrained(_gpt2_dir(root)),
        tmp_path / "stock",
        _data(40),
        eval_strategy="no",
    )
    model = transformers.AutoModelForCausalLM.from_pretrained(_gpt2_dir(root))
    t = _run(
        OffloadTrainer,
        model,
        tmp_path / "ours",
        _data(40),
        eval_strategy="no",
        ramstream={"device": "cpu", "param_offload": True},
    )
    (a, _), (b, _) = _losses(ref), _losses(t)
    assert max(abs(x - y) for x, y in zip(a, b)) < TOL
    assert t.model.lm_head.weight is t.model.transformer.wte.weight
    assert _close(_params(t.model), _params(ref.model), TOL) < TOL
    assert ramstream.memory_report(t.model)["params"]["streamed_blocks"]


def _ckpt_run(cls, root, out, resume=None, **kw):
    model = transformers.AutoModelForCausalLM.from_pretrained(_llama_dir(root))
    return _run(
        cls,
        model,
        out,
        _data(40),
        resume=resume,
        eval_strategy="no",
        save_strategy="steps",
        save_steps=5,
        **kw,
    )


def test_trainer_checkpoint_resumes_exactly_and_loads_across_trainers(root, tmp_path):
    ours = {"ramstream": {"device": "cpu"}}
    full = _ckpt_run(OffloadTrainer, root, tmp_path / "full", **ours)
    ck = str(tmp_path / "full" / "checkpoint-5")
    sd = torch.load(os.path.join(ck, "optimizer.pt"), weights_only=True)  # torch's format, no pickle load
    assert sd["state"] and all("master" in st and "exp_avg" in st for st in sd["state"].values())

    resumed = _ckpt_run(OffloadTrainer, root, tmp_path / "resumed", resume=ck, **ours)
    w_full, w_res = _params(full.model), _params(resumed.model)
    assert all(torch.equal(w_full[k], w_res[k]) for k in w_full)  # bit for bit (fp32 moments)
    assert _losses(full)[0] == _losses(resumed)[0]  # the first 5 come from the checkpoint's trainer state

    stock_full = _ckpt_run(transformers.Trainer, root, tmp_path / "stock")
    stock_from_ours = _ckpt_run(transformers.Trainer, root, tmp_path / "s2", resume=ck)
    ours_from_stock = _ckpt_run(
        OffloadTrainer, root, tmp_path / "o2", resume=str(tmp_path / "stock" / "checkpoint-5"), **ours
    )
    assert _close(_params(stock_from_ours.model), w_full, TOL) < 1e-5
    assert _close(_params(ours_from_stock.model), _params(stock_full.model), TOL) < 1e-5


def test_fp16_and_other_optimizers_are_refused(root, tmp_path):
    model = transformers.AutoModelForCausalLM.from_pretrained(_llama_dir(root))
    args = _args(tmp_path)
    args.fp16 = True  # set after construction: TrainingArguments itself may refuse fp16 on a CPU
    with pytest.raises(ValueError, match="fp16=True"):
        OffloadTrainer(model=model, args=args, train_dataset=_data(4))
    with pytest.raises(ValueError, match="optim='adafactor'"):
        OffloadTrainer(model=model, args=_args(tmp_path, optim="adafactor"), train_dataset=_data(4))
    with pytest.raises(ValueError, match="no_such_option"):
        OffloadTrainer(
            model=model, args=_args(tmp_path), train_dataset=_data(4), ramstream={"no_such_option": 1}
        )
    with pytest.raises(ValueError, match="gradient_accumulation_steps"):
        OffloadTrainer(
            model=model, args=_args(tmp_path), train_dataset=_data(4), ramstream={"accumulation_steps": 2}
        )
    with pytest.raises(ValueError, match="not both"):
        TrainStreamTrainer(model=model, args=_args(tmp_path), trainstream={}, ramstream={})


# ---- wrap_hf -------------------------------------------------------------------------------------
def _tiny(kind: str):
    common = dict(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4
    )
    if kind == "gpt2":
        return transformers.GPT2LMHeadModel(
            transformers.GPT2Config(vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4)
        )
    if kind == "gpt_neox":
        return transformers.GPTNeoXForCausalLM(transformers.GPTNeoXConfig(**common))
    cfg_cls, model_cls = {
        "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
        "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
        "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM),
        "gemma": (transformers.GemmaConfig, transformers.GemmaForCausalLM),
        "phi": (transformers.PhiConfig, transformers.PhiForCausalLM),
    }[kind]
    extra = {"head_dim": 8} if kind == "gemma" else {}
    return model_cls(cfg_cls(num_key_value_heads=2, **common, **extra))


@pytest.mark.parametrize("kind", ["llama", "qwen2", "mistral", "gemma", "phi", "gpt2", "gpt_neox"])
def test_find_decoder_layers_and_the_loss_helper(kind):
    torch.manual_seed(0)
    model = _tiny(kind)
    layers = find_decoder_layers(model)
    if kind == "gpt2":
        want = list(model.transformer.h)
    elif kind == "gpt_neox":
        want = list(model.gpt_neox.layers)
    else:
        want = list(model.model.layers)
    assert layers == want and len(layers) == 2
    batch = _data(2)
    ids = torch.stack([r["input_ids"] for r in batch])
    mask = torch.stack([r["attention_mask"] for r in batch])
    labels = torch.stack([r["labels"] for r in batch])
    model.eval()
    ref = model(input_ids=ids, attention_mask=mask, labels=labels).loss
    ref_n = model(input_ids=ids, attention_mask=mask, labels=labels, num_items_in_batch=torch.tensor(7)).loss
    m, opt, loss_fn = wrap_hf(model, device="cpu", loss_chunk_size=5, return_loss=True)
    got = loss_fn(input_ids=ids, attention_mask=mask, labels=labels)
    got_n = loss_fn(input_ids=ids, attention_mask=mask, labels=labels, num_items_in_batch=torch.tensor(7))
    assert torch.allclose(got, ref, atol=1e-5) and torch.allclose(got_n, ref_n, atol=1e-5)
    assert m._ramstream.options.blocks == want


def test_wrap_hf_trains_like_torch_with_tied_streamed_embeddings():
    """wrap_hf with streamed blocks and tied embeddings: bit-identical to the unstreamed wrap_hf
    run, and the losses follow torch's AdamW loop. (Weights are not compared with torch's:
    c_attn's key bias gets a gradient of rounding noise only, softmax being blind to it, which
    AdamW's normalisation turns into +-lr steps that differ between any two summation orders;
    with 2 threads that was 1.2e-5 here.)"""
    torch.manual_seed(0)
    base = _tiny("gpt2")
    for mod in base.modules():
        if isinstance(mod, torch.nn.Dropout):
            mod.p = 0.0
    runs = []
    for offload in (None, False, True):
        m = _tiny("gpt2")
        m.load_state_dict(base.state_dict())
        for mod in m.modules():
            if isinstance(mod, torch.nn.Dropout):
                mod.p = 0.0
        if offload is None:  # torch's own loop, the same loss function
            opt, loss_fn = torch.optim.AdamW(m.parameters(), lr=3e-3, foreach=False), CausalLMLoss(m)
        else:
            m, opt = wrap_hf(
                m, torch.optim.AdamW(m.parameters(), lr=3e-3), device="cpu", param_offload=offload
            )
            loss_fn = m.ramstream_loss
            assert m.lm_head.weight is m.transformer.wte.weight
        losses = []
        for step in range(6):
            batch = _data(2, seed=step)
            kw = {k: torch.stack([r[k] for r in batch]) for k in ("input_ids", "attention_mask", "labels")}
            loss = loss_fn(**kw)
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
        if offload is not None:
            opt.synchronize()
            assert m.lm_head.weight is m.transformer.wte.weight
        runs.append((m, losses))
    (_, l_torch), (plain, l_plain), (streamed, l_streamed) = runs
    assert l_streamed == l_plain
    assert all(torch.equal(a, b) for a, b in zip(_params(plain).values(), _params(streamed).values()))
    assert l_plain == pytest.approx(l_torch, rel=1e-4)
    assert ramstream.memory_report(streamed)["params"]["streamed_blocks"] == [0, 1]


def test_a_nan_batch_skips_its_step_with_a_warning(root, tmp_path):
    """OffloadTrainer skips a step whose gradients are not finite (skip_nonfinite defaults to True
    there): training goes on, the weights stay finite, the count is in the logs. The stock
    Trainer, clipping by a NaN norm, would make every weight NaN."""
    model = transformers.AutoModelForCausalLM.from_pretrained(_llama_dir(root))
    calls = []
    weight = model.model.layers[1].mlp.up_proj.weight
    weight.register_hook(lambda g: (calls.append(1), g * float("nan") if len(calls) == 3 else g)[1])
    with pytest.warns(RuntimeWarning, match=r"skipped: the global gradient norm is nan"):
        t = _run(
            OffloadTrainer,
            model,
            tmp_path,
            _data(40),
            max_steps=4,
            eval_strategy="no",
            ramstream={"device": "cpu"},
        )
    assert len(calls) == 8  # 4 steps x 2 micro-batches; the poisoned one is in step 2
    logs = [e for e in t.state.log_history if "ramstream_skipped_steps" in e]
    assert logs and logs[-1]["ramstream_skipped_steps"] == 1
    assert all(torch.isfinite(p).all() for p in t.model.parameters())
    assert ramstream.memory_report(t.model)["optimizer"]["stats"]["skipped_steps"] == 1


@pytest.mark.parametrize("damaged", ["optimizer.pt", "model.safetensors", "trainer_state.json"])
def test_resume_from_a_damaged_checkpoint_is_refused_before_the_model_loads(root, tmp_path, damaged):
    """The Trainer loads the model long before the optimizer: a truncated optimizer file used to
    be found only after the weights were replaced. OffloadTrainer checks every file first."""
    full = _ckpt_run(OffloadTrainer, root, tmp_path / "full", ramstream={"device": "cpu"})
    ck = tmp_path / "full" / "checkpoint-5"
    path = ck / damaged
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    model = transformers.AutoModelForCausalLM.from_pretrained(_llama_dir(root))
    before = _params(model)
    t = OffloadTrainer(
        model=model,
        args=_args(tmp_path / "again", eval_strategy="no"),
        train_dataset=_data(40),
        ramstream={"device": "cpu"},
    )
    with pytest.raises(ValueError, match=damaged):
        t.train(resume_from_checkpoint=str(ck))
    after = _params(t.model)
    assert all(torch.equal(before[k], after[k]) for k in before)  # nothing was loaded
    assert full.state.global_step == 10
