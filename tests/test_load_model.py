"""load_model on tiny Llama, Qwen2, Mistral and GPT-2 checkpoints written with save_pretrained
into a temp folder (no downloads), sharded and not: against AutoModelForCausalLM.from_pretrained
tensor for tensor (quantize="none"), against quantize_model of that model (int8/NF4), random
weights, auto decisions under injected RAM, and every bad input."""

from __future__ import annotations

import json
import os
import struct

import pytest
import torch

import ramstream

safetensors_torch = pytest.importorskip("safetensors.torch")
from ramstream.integrations import hf_load
from ramstream.integrations.hf_load import load_model
from ramstream.quant import is_quantized

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning", "ignore::UserWarning")
VOCAB = 96


def _config(kind: str, tied: bool):
    common = dict(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        tie_word_embeddings=tied,
    )
    if kind == "llama":
        return transformers.LlamaConfig(**common)
    if kind == "qwen2":
        return transformers.Qwen2Config(**common)
    if kind == "mistral":
        return transformers.MistralConfig(**common, sliding_window=None)
    return transformers.GPT2Config(
        vocab_size=VOCAB, n_embd=64, n_layer=3, n_head=4, n_positions=64, tie_word_embeddings=tied
    )


def _save(tmp_path, kind="llama", tied=False, sharded=False, dtype=torch.float32, seed=0):
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(_config(kind, tied)).to(dtype)
    folder = tmp_path / f"{kind}-{tied}-{sharded}"
    model.save_pretrained(folder, max_shard_size="60KB" if sharded else "10GB")
    return str(folder)


def _assert_same_tensors(a, b):
    sa = dict(a.named_parameters(remove_duplicate=False)) | dict(a.named_buffers())
    sb = dict(b.named_parameters(remove_duplicate=False)) | dict(b.named_buffers())
    assert sa.keys() == sb.keys()
    for k in sa:
        assert sa[k].dtype == sb[k].dtype and sa[k].shape == sb[k].shape, k
        assert torch.equal(sa[k], sb[k]), k


@pytest.mark.parametrize("kind", ["llama", "qwen2", "mistral", "gpt2"])
@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
@pytest.mark.parametrize("sharded", [False, True], ids=["single", "sharded"])
def test_quantize_none_equals_from_pretrained(tmp_path, kind, tied, sharded):
    folder = _save(tmp_path, kind, tied, sharded)
    if sharded:
        assert os.path.exists(os.path.join(folder, "model.safetensors.index.json"))
    got = load_model(folder, quantize="none")
    ref = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16)
    _assert_same_tensors(got, ref)
    assert not got.training
    head, emb = got.get_output_embeddings().weight, got.get_input_embeddings().weight
    assert (head is emb) == tied
    ids = torch.randint(0, VOCAB, (2, 9))
    with torch.no_grad():
        assert torch.equal(got(ids).logits, ref(ids).logits)


@pytest.mark.parametrize("fmt", ["int8", "nf4"])
@pytest.mark.parametrize("kind", ["llama", "gpt2"])
def test_quantized_load_equals_quantize_model_of_from_pretrained(tmp_path, fmt, kind):
    folder = _save(tmp_path, kind, sharded=True)
    got = load_model(folder, quantize=fmt, quant_block_size=32)
    ref = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16)
    ref.requires_grad_(False)
    rep = ramstream.quantize_model(ref, fmt, block_size=32)
    n = sum(is_quantized(m) for m in got.modules())
    assert n == rep["tensors"] > 0
    sg, sr = got.state_dict(), ref.state_dict()
    assert sg.keys() == sr.keys()
    for k in sr:
        assert torch.equal(sg[k], sr[k]), k
    for m, r in zip(got.modules(), ref.modules()):
        if is_quantized(r):
            assert torch.equal(m.weight_codes, r.weight_codes) and torch.equal(
                m.weight_absmax, r.weight_absmax
            )
    assert not is_quantized(got.get_output_embeddings())


def test_config_overrides_and_random_weights(tmp_path):
    folder = _save(tmp_path, "qwen2")
    m = load_model(folder, quantize="nf4", random_weights=True, num_hidden_layers=2)
    assert len(m.model.layers) == 2 and m.config.num_hidden_layers == 2
    assert all(is_quantized(m.model.layers[i].mlp.up_proj) for i in range(2))
    assert not any(t.is_meta for t in list(m.parameters()) + list(m.buffers()))
    w = m.model.layers[0].self_attn.q_proj.weight.float()
    assert 0.005 < w.std() < 0.1  # the config's initializer_range (0.02), quantized
    with torch.no_grad():
        out = m(torch.randint(0, VOCAB, (1, 5))).logits
    assert torch.isfinite(out).all()


def test_random_weights_pack_the_draws_of_the_unpacked_model(tmp_path):
    """Packed random weights are drawn one module after another into reused memory: the codes equal
    packing what quantize="none" draws under the same seed (no draw seen by another module)."""
    folder = _save(tmp_path, "llama")
    torch.manual_seed(3)
    plain = load_model(folder, quantize="none", random_weights=True)
    torch.manual_seed(3)
    packed = load_model(folder, quantize="nf4", random_weights=True)
    n = 0
    for name, m in packed.named_modules():
        if is_quantized(m):
            codes, absmax = ramstream.functional.quantize_nf4(plain.get_submodule(name).weight, 64)
            assert torch.equal(m.weight_codes, codes) and torch.equal(m.weight_absmax, absmax), name
            n += 1
    assert n == 3 * 7
    for k, v in packed.state_dict().items():  # embeddings, norms, head: the same draws
        if not is_quantized(packed.get_submodule(k.rsplit(".", 1)[0])):
            assert torch.equal(v, plain.state_dict()[k]), k


def test_auto_quantizes_only_when_the_dtype_does_not_fit(tmp_path, monkeypatch):
    folder = _save(tmp_path, "llama")
    full = sum(p.numel() * 2 for p in load_model(folder, quantize="none").parameters())
    for ram, want in ((10 * full, None), (full * 0.9 / 0.85, "int8"), (full * 0.5 / 0.85, "nf4")):
        monkeypatch.setattr(hf_load, "_available_ram", lambda ram=ram: int(ram))
        m = load_model(folder)
        fmts = {mod.quant_format for mod in m.modules() if is_quantized(mod)}
        assert fmts == ({want} if want else set())
    monkeypatch.setattr(hf_load, "_available_ram", lambda: 1000)
    with pytest.raises(MemoryError, match="as NF4"):
        load_model(folder)


# ---- bad input --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kw,match",
    [
        (dict(quantize="fp4"), r"quantize='fp4'.*accepted: 'int8', 'nf4'"),
        (dict(quant_block_size=63), r"quant_block_size=63.*even integer"),
        (dict(dtype=torch.int8), r"dtype=.*accepted"),
        (dict(ram_fraction=0), r"ram_fraction=0.*accepted"),
    ],
)
def test_bad_arguments(tmp_path, kw, match):
    folder = _save(tmp_path, "llama")
    with pytest.raises(ValueError, match=match):
        load_model(folder, **kw)


def test_a_folder_without_safetensors_and_pickles_are_refused(tmp_path, monkeypatch):
    folder = _save(tmp_path, "llama")
    os.remove(os.path.join(folder, "model.safetensors"))
    with pytest.raises(ValueError, match="has no .safetensors files"):
        load_model(folder, quantize="none")
    torch.save({"x": torch.zeros(1)}, os.path.join(folder, "pytorch_model.bin"))
    monkeypatch.setattr(torch, "load", lambda *a, **k: pytest.fail("torch.load was called"))
    with pytest.raises(ValueError, match=r"pickle.*pytorch_model\.bin.*never"):
        load_model(folder, quantize="none")
    with pytest.raises(ValueError, match="neither a local folder"):
        load_model(str(tmp_path / "nowhere"))


def _header(path):
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        return n, json.loads(f.read(n)), f.read()


def _write(path, header, data, n=None):
    raw = json.dumps(header).encode()
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw) if n is None else n) + raw + data)


def test_a_truncated_file_names_the_file_and_tensor(tmp_path):
    folder = _save(tmp_path, "llama")
    path = os.path.join(folder, "model.safetensors")
    size = os.path.getsize(path)
    with open(path, "r+b") as f:
        f.truncate(size - 100)
    with pytest.raises(ValueError, match=r"model\.safetensors, tensor '.*': offsets .* run past the end"):
        load_model(folder, quantize="nf4")
    with open(path, "r+b") as f:
        f.truncate(5)
    with pytest.raises(ValueError, match="truncated"):
        load_model(folder, quantize="nf4")


def test_a_header_whose_offsets_run_past_the_end(tmp_path):
    folder = _save(tmp_path, "llama")
    path = os.path.join(folder, "model.safetensors")
    n, header, data = _header(path)
    key = next(k for k in header if k != "__metadata__")
    b, e = header[key]["data_offsets"]
    header[key]["data_offsets"] = [b + len(data), e + len(data)]
    _write(path, header, data)
    with pytest.raises(ValueError, match=rf"tensor '{key}': offsets .* run past the end"):
        load_model(folder, quantize="none")
    _write(path, header, data, n=10**9)
    with pytest.raises(ValueError, match="header length .* runs past the end"):
        load_model(folder, quantize="none")


def test_a_header_that_lies_about_a_size_or_is_not_json(tmp_path):
    folder = _save(tmp_path, "llama")
    path = os.path.join(folder, "model.safetensors")
    n, header, data = _header(path)
    key = next(k for k in header if k != "__metadata__")
    header[key]["shape"] = [header[key]["shape"][0] + 1] + header[key]["shape"][1:]
    _write(path, header, data)
    with pytest.raises(ValueError, match=rf"tensor '{key}': offsets .* do not hold"):
        load_model(folder, quantize="none")
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", 4) + b"{{{{")
    with pytest.raises(ValueError, match="not valid JSON"):
        load_model(folder, quantize="none")


def test_shapes_that_do_not_match_the_config(tmp_path):
    folder = _save(tmp_path, "llama", sharded=True)
    with pytest.raises(ValueError, match=r"safetensors, tensor 'model\.layers\.\d\..*' has shape .* expects"):
        load_model(folder, quantize="nf4", intermediate_size=128)
    with pytest.raises(ValueError, match=r"lacks .* tensor"):
        load_model(folder, quantize="nf4", num_hidden_layers=4)


def test_keys_without_the_base_model_prefix_load_like_from_pretrained(tmp_path):
    """Hub GPT-2 checkpoints name h.0.attn... without 'transformer.'."""
    folder = _save(tmp_path, "gpt2", tied=True)
    path = os.path.join(folder, "model.safetensors")
    tensors = safetensors_torch.load_file(path)
    stripped = {k.removeprefix("transformer."): v for k, v in tensors.items()}
    assert stripped.keys() != tensors.keys()
    safetensors_torch.save_file(stripped, path, metadata={"format": "pt"})
    got = load_model(folder, quantize="none")
    ref = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16)
    _assert_same_tensors(got, ref)


def test_a_failed_load_leaves_no_patch_behind(tmp_path):
    folder = _save(tmp_path, "llama")
    register = torch.nn.Module.register_parameter
    with pytest.raises(ValueError, match="has shape"):
        load_model(folder, quantize="nf4", hidden_size=128, num_attention_heads=4)
    assert torch.nn.Module.register_parameter is register
    lin = torch.nn.Linear(2, 2)
    assert lin.weight.device.type == "cpu"


def test_the_skeleton_skips_initialising_its_meta_parameters():
    """transformers' init functions skip the meta parameters (marked initialised): on the meta
    device an init computes nothing but costs ~0.3 ms a tensor; the buffers are still real."""
    pytest.importorskip("transformers.initialization")
    from torch.overrides import TorchFunctionMode

    calls = []

    class Inits(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            t = args[0] if args else kwargs.get("tensor")
            if getattr(func, "__name__", "") == "normal_" and isinstance(t, torch.Tensor) and t.is_meta:
                calls.append(tuple(t.shape))
            return func(*args, **kwargs)

    cfg = _config("llama", tied=False)
    with Inits():
        model = hf_load._skeleton(cfg, torch.bfloat16, False)
    linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    assert len(linears) == 3 * 7 + 1 and all(m.weight.is_meta for m in linears)
    assert len(calls) <= 2, calls  # at most the embeddings' own reset_parameters, not one per weight
    inv = model.model.rotary_emb.inv_freq
    assert not inv.is_meta and torch.equal(
        inv, transformers.AutoModelForCausalLM.from_config(cfg).model.rotary_emb.inv_freq
    )
