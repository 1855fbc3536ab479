"""Input probe cases: quantization, find_blocks, losses, memory ops, functional, OffloadTrainer and load_model."""

# ruff: noqa: F403, F405
from __future__ import annotations

from _probe_inputs_common import *

# ---- quantize_model / dequantize_model
add("quantize_model(1)", "model", lambda: ramstream.quantize_model(1))
add(
    "quantize_model(quantize='NF4')",
    "quantize",
    lambda: ramstream.quantize_model(make_model(0).requires_grad_(False), "NF4"),
)
add(
    "quantize_model(quantize=None)",
    "quantize",
    lambda: ramstream.quantize_model(make_model(0).requires_grad_(False), None),
)
add(
    "quantize_model(quantize='none')",
    "quantize",
    lambda: ramstream.quantize_model(make_model(0).requires_grad_(False), "none"),
)
add(
    "quantize_model(quantize='auto')",
    "quantize",
    lambda: ramstream.quantize_model(make_model(0).requires_grad_(False), "auto"),
)
add(
    "quantize_model(block_size=3)",
    "block_size",
    lambda: ramstream.quantize_model(make_model(0).requires_grad_(False), block_size=3),
)
add(
    "quantize_model(block_size=64.0)",
    "block_size",
    lambda: ramstream.quantize_model(make_model(0).requires_grad_(False), block_size=64.0),
)
add(
    "quantize_model(blocks=1)",
    "blocks",
    lambda: ramstream.quantize_model(make_model(0).requires_grad_(False), blocks=1),
)
add(
    "quantize_model(blocks=[])",
    "blocks",
    lambda: ramstream.quantize_model(make_model(0).requires_grad_(False), blocks=[]),
)
add(
    "quantize_model(blocks=[1])",
    "blocks",
    lambda: ramstream.quantize_model(make_model(0).requires_grad_(False), blocks=[1]),
)
add(
    "quantize_model(blocks=[foreign])",
    "blocks",
    lambda: ramstream.quantize_model(
        make_model(0).requires_grad_(False), blocks=[nn.Sequential(nn.Linear(64, 64))]
    ),
)
add(
    "quantize_model(pin_budget=-1)",
    "pin_budget",
    lambda: ramstream.quantize_model(make_model(0).requires_grad_(False), pin_budget=-1),
)
add(
    "quantize_model(pin_budget='x')",
    "pin_budget",
    lambda: ramstream.quantize_model(make_model(0).requires_grad_(False), pin_budget="x"),
)
add(
    "quantize_model(pin_budget=nan)",
    "pin_budget",
    lambda: ramstream.quantize_model(make_model(0).requires_grad_(False), pin_budget=NAN),
)
add(
    "quantize_model(twice)",
    "quantize",
    lambda: [
        ramstream.quantize_model(m := make_model(0).requires_grad_(False)),
        ramstream.quantize_model(m, "int8"),
    ],
)
add("dequantize_model(1)", "model", lambda: ramstream.dequantize_model(1))

# ---- find_blocks, offload_checkpoint
add("find_blocks(1)", "model", lambda: __import__("ramstream.blocks").blocks.find_blocks(1))
add(
    "find_blocks(Linear)",
    "blocks",
    lambda: __import__("ramstream.blocks").blocks.find_blocks(nn.Linear(2, 2)),
)
add("offload_checkpoint(1)", "module", lambda: ramstream.offload_checkpoint(1, torch.randn(2)))

# ---- losses
for fn_name in ("chunked_cross_entropy", "causal_lm_loss"):
    fn = getattr(ramstream, fn_name)
    for kw, arg in [
        ({"chunk_size": 0}, "chunk_size"), ({"chunk_size": True}, "chunk_size"), ({"chunk_size": 2.0}, "chunk_size"),
        ({"reduction": "MEAN"}, "reduction"), ({"reduction": None}, "reduction"), ({"ignore_index": 1.5}, "ignore_index"),
        ({"ignore_index": True}, "ignore_index"), ({"num_items": 0}, "num_items"), ({"num_items": -1}, "num_items"),
        ({"num_items": NAN}, "num_items"), ({"num_items": "x"}, "num_items"), ({"num_items": torch.tensor([1, 2])}, "num_items"),
        ({"num_items": True}, "num_items"),
    ]:  # fmt: skip
        add(f"{fn_name}({kw})", arg, lambda fn=fn, kw=kw: fn(H, W, T, **kw))
    add(f"{fn_name}(hidden=list)", "hidden", lambda fn=fn: fn([1.0], W, T))
    add(f"{fn_name}(weight shape)", "weight", lambda fn=fn: fn(H, torch.randn(16, 7), T))
    add(f"{fn_name}(weight 1d)", "weight", lambda fn=fn: fn(H, torch.randn(16), T))
    add(f"{fn_name}(targets float)", "targets|labels", lambda fn=fn: fn(H, W, T.float()))
    add(f"{fn_name}(targets shape)", "targets|labels", lambda fn=fn: fn(H, W, torch.randint(0, 16, (5,))))
    add(f"{fn_name}(targets out of range)", "targets|labels", lambda fn=fn: fn(H, W, torch.full((4,), 99)))
    add(f"{fn_name}(targets negative)", "targets|labels", lambda fn=fn: fn(H, W, torch.full((4,), -5)))
    add(f"{fn_name}(bias shape)", "bias", lambda fn=fn: fn(H, W, T, torch.randn(3)))
    add(f"{fn_name}(bias list)", "bias", lambda fn=fn: fn(H, W, T, [1.0]))
    add(f"{fn_name}(hidden int)", "hidden", lambda fn=fn: fn(H.long(), W, T))

# ---- memory ops
add("pinned_empty(-1)", "shape", lambda: ramstream.pinned_empty(-1))
add("pinned_empty('a')", "shape", lambda: ramstream.pinned_empty("a"))
add("pinned_empty(2.5)", "shape", lambda: ramstream.pinned_empty(2.5))
add("pinned_empty(True)", "shape", lambda: ramstream.pinned_empty(True))
add("pinned_empty(dtype=str)", "dtype", lambda: ramstream.pinned_empty(4, "float32"))
add("pinned_empty(own_pages=1)", "own_pages", lambda: ramstream.pinned_empty(4, own_pages=1))
add("pinned_empty(own_pages='no')", "own_pages", lambda: ramstream.pinned_empty(4, own_pages="no"))
add("pinned_empty(2**62)", "shape", lambda: ramstream.pinned_empty(2**62))
add("set_pin_budget(-1)", "bytes", lambda: ramstream.set_pin_budget(-1))
add("set_pin_budget(nan)", "fraction", lambda: ramstream.set_pin_budget(NAN))
add("set_pin_budget(1.5)", "fraction", lambda: ramstream.set_pin_budget(1.5))
add("set_pin_budget(-0.5)", "fraction", lambda: ramstream.set_pin_budget(-0.5))
add("set_pin_budget('abc')", "bytes_or_fraction", lambda: ramstream.set_pin_budget("abc"))
add("set_pin_budget(None)", "bytes_or_fraction must", lambda: ramstream.set_pin_budget(None))
add("set_pin_budget(tensor)", "bytes_or_fraction must", lambda: ramstream.set_pin_budget(torch.tensor(5)))
add("register_host_memory(1)", "t", lambda: ramstream.register_host_memory(1))
add("register_host_memory(empty)", "t", lambda: ramstream.register_host_memory(torch.empty(0)))

# ---- functional
Z = lambda *s, d=torch.float32: torch.zeros(*s, dtype=d)  # noqa: E731
add("adamw_(lr=nan)", "lr", lambda: F.adamw_(Z(4), Z(4), Z(4), Z(4), step=1, lr=NAN))
add("adamw_(step=0)", "step", lambda: F.adamw_(Z(4), Z(4), Z(4), Z(4), step=0, lr=1e-3))
add("adamw_(step=1.0)", "step", lambda: F.adamw_(Z(4), Z(4), Z(4), Z(4), step=1.0, lr=1e-3))
add("adamw_(grad shape)", "grad", lambda: F.adamw_(Z(4), Z(5), Z(4), Z(4), step=1, lr=1e-3))
add("adamw_(out shape)", "out", lambda: F.adamw_(Z(4), Z(4), Z(4), Z(4), step=1, lr=1e-3, out=Z(3)))
add(
    "adamw_(param bf16)", "param", lambda: F.adamw_(Z(4, d=torch.bfloat16), Z(4), Z(4), Z(4), step=1, lr=1e-3)
)
add("sq_norm(list)", "tensor", lambda: F.sq_norm([1.0]))
add("sq_norm(int tensor)", "tensor", lambda: F.sq_norm(torch.ones(4, dtype=torch.int32)))
add("accumulate_(shape)", "src", lambda: F.accumulate_(Z(4), Z(5)))
add("accumulate_(dst bf16)", "dst", lambda: F.accumulate_(Z(4, d=torch.bfloat16), Z(4)))
add("accumulate_(dst int)", "dst", lambda: F.accumulate_(Z(4, d=torch.int32), Z(4)))
add("quantize_nf4(block_size=3)", "block_size", lambda: F.quantize_nf4(Z(64), 3))
add("quantize_nf4(list)", "x", lambda: F.quantize_nf4([1.0]))
add("quantize_nf4(int)", "x", lambda: F.quantize_nf4(Z(64, d=torch.int32)))
add("dequantize_nf4(shape mismatch)", "shape", lambda: F.dequantize_nf4(*F.quantize_nf4(Z(64)), (65,)))
add("dequantize_nf4(shape=-1)", "shape", lambda: F.dequantize_nf4(*F.quantize_nf4(Z(64)), (-64,)))
add("dequantize_nf4(shape='a')", "shape", lambda: F.dequantize_nf4(*F.quantize_nf4(Z(64)), "ab"))
add(
    "dequantize_nf4(dtype=int)", "dtype", lambda: F.dequantize_nf4(*F.quantize_nf4(Z(64)), (64,), torch.int32)
)
add("dequantize_nf4(dtype=str)", "dtype", lambda: F.dequantize_nf4(*F.quantize_nf4(Z(64)), (64,), "bfloat16"))
add(
    "dequantize_int8(block mismatch)",
    "block_size",
    lambda: F.dequantize_int8(*F.quantize_int8(Z(64)), (64,), block_size=32),
)
add("quantize_int8(block_size=True)", "block_size", lambda: F.quantize_int8(Z(64), True))

# ---- OffloadTrainer
try:
    from ramstream.integrations import huggingface as hf
    from ramstream.integrations.hf_load import load_model

    def _tr(**kw):
        import tempfile

        from transformers import TrainingArguments

        tiny = _tiny_llama()
        args = TrainingArguments(tempfile.mkdtemp(), report_to=[], use_cpu=True, max_steps=1)
        return hf.OffloadTrainer(
            model=tiny,
            args=args,
            train_dataset=[
                {"input_ids": torch.ones(4, dtype=torch.long), "labels": torch.ones(4, dtype=torch.long)}
            ],
            **kw,
        )

    def _tiny_llama():
        from transformers import LlamaConfig, LlamaForCausalLM

        cfg = LlamaConfig(
            vocab_size=32,
            hidden_size=16,
            intermediate_size=32,
            num_hidden_layers=2,
            num_attention_heads=2,
            num_key_value_heads=2,
        )
        return LlamaForCausalLM(cfg)

    for kw, arg in [
        ({"ramstream": 1}, "ramstream"), ({"ramstream": {"foo": 1}}, "foo"), ({"ramstream": {"chunked_loss": 1}}, "chunked_loss"),
        ({"ramstream": {"loss_chunk_size": 0}}, "loss_chunk_size"), ({"ramstream": {"loss_chunk_size": "a"}}, "loss_chunk_size"),
        ({"ramstream": {"atomic_checkpoints": "no"}}, "atomic_checkpoints"), ({"ramstream": {"lr": NAN}}, "lr"),
        ({"ramstream": {"threads": 0}}, "threads"),
    ]:  # fmt: skip
        add(f"OffloadTrainer({kw})", arg, lambda kw=kw: _tr(**kw))
    add(
        "TrainStreamTrainer(trainstream=1)",
        "trainstream",
        lambda: hf.TrainStreamTrainer(trainstream=1, model=_tiny_llama()),
    )
    add(
        "TrainStreamTrainer(both)",
        "trainstream",
        lambda: hf.TrainStreamTrainer(trainstream={}, ramstream={}, model=_tiny_llama()),
    )
    add(
        "wrap_hf(loss_chunk_size=0)",
        "loss_chunk_size",
        lambda: hf.wrap_hf(_tiny_llama(), device="cpu", loss_chunk_size=0),
    )
    add("wrap_hf(1)", "model", lambda: hf.wrap_hf(1))
    add("find_decoder_layers(1)", "model", lambda: hf.find_decoder_layers(1))
    add("find_decoder_layers(Linear)", "layers", lambda: hf.find_decoder_layers(nn.Linear(2, 2)))
    import tempfile

    def _folder():
        d = tempfile.mkdtemp()
        _tiny_llama().save_pretrained(d)
        return d

    FOLDER = None

    def _lm(**kw):
        global FOLDER
        FOLDER = FOLDER or _folder()
        return load_model(FOLDER, **kw)

    for kw, arg in [
        ({"quantize": "NF4"}, "quantize"), ({"quantize": 1}, "quantize"), ({"dtype": "bf16"}, "dtype"),
        ({"dtype": torch.int8}, "dtype"), ({"dtype": 1}, "dtype"), ({"quant_block_size": 3}, "quant_block_size"),
        ({"ram_fraction": 0}, "ram_fraction"), ({"ram_fraction": 1.5}, "ram_fraction"), ({"ram_fraction": NAN}, "ram_fraction"),
        ({"ram_fraction": "a"}, "ram_fraction"), ({"ram_fraction": True}, "ram_fraction"), ({"random_weights": "no"}, "random_weights"),
        ({"random_weights": 1}, "random_weights"), ({"trust_remote_code": "yes"}, "trust_remote_code"),
        ({"disable_mmap": 1}, "disable_mmap"),
        ({"not_a_config_key": 3}, "not_a_config_key"), ({"quant_block_size": 64.0}, "quant_block_size"),
    ]:  # fmt: skip
        add(f"load_model({kw})", arg, lambda kw=kw: _lm(**kw))
    add("load_model(name=1)", "name_or_path", lambda: load_model(1))
    add("load_model(name=None)", "name_or_path", lambda: load_model(None))
except ImportError as e:
    print("no transformers:", e)
