"""Damaged and hostile checkpoint files (issue 25): shifted or overlapping safetensors offsets are
refused by load_checkpoint and load_model, malformed JSON names the file and the key, missing and
truncated files name the path, and a refused load_checkpoint leaves the model and the optimizer
bit for bit as they were (weights, masters, moments, steps, hyper-parameters)."""

from __future__ import annotations

import copy
import json
import os
import re
import struct

import pytest
import torch

import ramstream
from test_checkpoint import _model, _train, _wrapped


# ---- helpers -------------------------------------------------------------------------------------
def _split(path) -> tuple[dict, bytes]:
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        return json.loads(f.read(n)), f.read()


def _join(path, header: dict, data: bytes) -> None:
    raw = json.dumps(header).encode()
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)) + raw + data)


def _edit_json(path, fn) -> None:
    """fn(value) edits the JSON value in place; a str or bytes result replaces the file's text."""
    with open(path) as f:
        value = json.load(f)
    out = fn(value)
    with open(path, "wb") as f:
        f.write(out if isinstance(out, bytes) else (out or json.dumps(value)).encode())


def _truncate(path, by: int = 10) -> None:
    with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) - by)


def _overlap(path, a: str, b: str) -> None:
    """Tensor b's offsets made a's (both the same size): the file still looks whole to a reader
    that checks only each tensor's own range."""
    header, data = _split(path)
    assert header[a]["data_offsets"][1] - header[a]["data_offsets"][0] == (
        header[b]["data_offsets"][1] - header[b]["data_offsets"][0]
    )
    header[b]["data_offsets"] = list(header[a]["data_offsets"])
    _join(path, header, data)


def _shift(path, name: str, by: int = 4) -> None:
    """One tensor's offsets moved by a few bytes, still inside the data."""
    header, data = _split(path)
    header[name]["data_offsets"] = [o + by for o in header[name]["data_offsets"]]
    _join(path, header, data)


def _snapshot(model, opt) -> dict:
    """Copies of everything a load may change: weights, masters, the optimizer's state dict
    (moments, steps) and hyper-parameters."""
    if hasattr(opt, "synchronize"):
        opt.synchronize()
    snap = {"weights": {k: v.detach().clone() for k, v in model.state_dict().items()}}
    sd = opt.state_dict()
    snap["state"] = {
        pid: {k: v.clone() if torch.is_tensor(v) else v for k, v in st.items()}
        for pid, st in sd["state"].items()
    }
    snap["groups"] = copy.deepcopy([{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups])
    if hasattr(opt, "master_weights"):
        snap["masters"] = [t.clone() for t in opt.master_weights()]
    return snap


def _assert_unchanged(before: dict, model, opt) -> None:
    after = _snapshot(model, opt)
    assert before["weights"].keys() == after["weights"].keys()
    for k, v in before["weights"].items():
        assert torch.equal(v, after["weights"][k]), f"weight {k} changed"
    assert before["state"].keys() == after["state"].keys(), "the optimizer's state changed"
    for pid, st in before["state"].items():
        for k, v in st.items():
            w = after["state"][pid][k]
            assert torch.equal(v, w) if torch.is_tensor(v) else v == w, f"state {pid}.{k} changed"
    assert before["groups"] == after["groups"], "hyper-parameters changed"
    for i, (a, b) in enumerate(zip(before.get("masters", []), after.get("masters", []))):
        assert torch.equal(a, b), f"master {i} changed"


@pytest.fixture
def wrapped_ck(tmp_path):
    """(checkpoint folder after 2 steps, the model and OffloadAdamW trained 2 steps further, so
    that a load would change every weight, moment and step)."""
    m, opt, sched = _wrapped()
    _train(m, opt, sched, range(2))
    ck = tmp_path / "ck"
    ramstream.save_checkpoint(ck, m, opt, step=2, note="x", t=torch.arange(3))
    _train(m, opt, sched, range(2, 4))
    return ck, m, opt


def _plain(seed: int = 0):
    m = _model(seed)
    opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
    for s in range(2):
        x = torch.randn(4, 16, generator=torch.Generator().manual_seed(s))
        torch.nn.functional.mse_loss(m(x), x).backward()
        opt.step()
        opt.zero_grad()
    return m, opt


def _load_refused(ck, m, opt, exc, match) -> None:
    before = _snapshot(m, opt)
    with pytest.raises(exc, match=match):
        ramstream.load_checkpoint(ck, m, opt)
    _assert_unchanged(before, m, opt)


# ---- hostile safetensors offsets -----------------------------------------------------------------
@pytest.mark.parametrize("how", ["overlap", "shift"])
def test_load_checkpoint_refuses_shifted_or_overlapping_offsets(wrapped_ck, how):
    ck, m, opt = wrapped_ck
    path = str(ck / "model.safetensors")
    if how == "overlap":  # 2.bias would load 0.bias's values
        _overlap(path, "0.bias", "2.bias")
        match = rf"{re.escape(path)}, tensor '2\.bias': offsets .* overlap tensor '0\.bias'"
    else:  # 0.bias would load 4 bytes of its neighbour
        _shift(path, "0.bias")
        match = rf"{re.escape(path)}, tensor '0\.bias': offsets .* leave bytes .* \(a gap"
    _load_refused(ck, m, opt, ValueError, match)


@pytest.mark.parametrize("how", ["overlap", "shift"])
def test_load_model_refuses_shifted_or_overlapping_offsets(tmp_path, how):
    pytest.importorskip("transformers")
    from ramstream.integrations.hf_load import load_model
    from test_load_model import _save

    folder = _save(tmp_path, "llama")
    path = os.path.join(folder, "model.safetensors")
    a, b = "model.layers.0.input_layernorm.weight", "model.layers.0.post_attention_layernorm.weight"
    if how == "overlap":
        _overlap(path, a, b)
        match = rf"{re.escape(path)}, tensor '{re.escape(b)}': offsets .* overlap tensor '{re.escape(a)}'"
    else:
        _shift(path, a)
        match = rf"{re.escape(path)}, tensor '{re.escape(a)}': offsets .* leave bytes"
    with pytest.raises(ValueError, match=match):
        load_model(folder, quantize="none")


def test_load_model_refuses_an_index_whose_weight_map_is_not_an_object(tmp_path):
    pytest.importorskip("transformers")
    from ramstream.integrations.hf_load import load_model
    from test_load_model import _save

    folder = _save(tmp_path, "llama", sharded=True)
    index = os.path.join(folder, "model.safetensors.index.json")
    _edit_json(index, lambda v: v.__setitem__("weight_map", ["model-00001-of-00002.safetensors"]))
    with pytest.raises(ValueError, match=rf"{re.escape(index)}: 'weight_map' must be an object"):
        load_model(folder, quantize="none")


# ---- malformed JSON ------------------------------------------------------------------------------
def _set(*keys_value):
    *keys, value = keys_value

    def fn(v):
        for k in keys[:-1]:
            v = v[k]
        v[keys[-1]] = value

    return fn


def _ties(text: str):
    def fn(ck):
        path = ck / "model.safetensors"
        header, data = _split(path)
        header["__metadata__"]["ramstream_ties"] = text
        _join(path, header, data)

    return fn


JSON_CASES = {
    "meta-not-json": ("meta.json", lambda v: "{", r"meta\.json is not valid JSON"),
    "meta-list": ("meta.json", lambda v: "[]", r"meta\.json: the file must be a JSON object"),
    "meta-version": (
        "meta.json",
        _set("version", "1"),
        r"meta\.json: 'version' must be a non-negative integer",
    ),
    "meta-complete": (
        "meta.json",
        _set("complete", "yes"),
        r"not a complete .*meta\.json: .*'complete' 'yes'",
    ),
    "meta-optimizer": ("meta.json", _set("optimizer", 1), r"meta\.json: 'optimizer' must be true or false"),
    "opt-not-json": ("optimizer.json", lambda v: '{"state": ', r"optimizer\.json is not valid JSON"),
    "opt-list": ("optimizer.json", lambda v: "[1]", r"optimizer\.json: the file must be a JSON object"),
    "opt-no-state": (
        "optimizer.json",
        lambda v: v.pop("state") and None,
        r"optimizer\.json: 'state' is missing",
    ),
    "opt-groups": (
        "optimizer.json",
        _set("param_groups", {}),
        r"optimizer\.json: 'param_groups' must be a list",
    ),
    "opt-group-params": (
        "optimizer.json",
        _set("param_groups", 0, "params", ["a"]),
        r"optimizer\.json: 'param_groups'\[0\]\['params'\] must be a list of integer parameter ids",
    ),
    "opt-lr": (
        "optimizer.json",
        _set("param_groups", 0, "lr", "fast"),
        r"optimizer\.json: 'param_groups'\[0\]\['lr'\] must be a number, got 'fast'",
    ),
    "opt-betas": (
        "optimizer.json",
        _set("param_groups", 0, "betas", [0.9]),
        r"optimizer\.json: 'param_groups'\[0\]\['betas'\] must be a list of 2 values",
    ),
    "opt-state-entry": (
        "optimizer.json",
        _set("state", "0", 5),
        r"optimizer\.json: 'state'\['0'\] must be an object, got 5",
    ),
    "opt-step": (
        "optimizer.json",
        _set("state", "1", "step", "x"),
        r"optimizer\.json: 'state'\['1'\]\['step'\] must be a non-negative number, got 'x'",
    ),
    "opt-unknown-id": (
        "optimizer.json",
        _set("state", "99", {"step": 1.0}),
        r"optimizer\.json: 'state' has state for '99', which is not a parameter id",
    ),
    "extra-not-json": ("extra.json", lambda v: "{", r"extra\.json is not valid JSON"),
    "extra-list": ("extra.json", lambda v: "[1, 2]", r"extra\.json: the file must be a JSON object"),
    "ties-not-json": (
        None,
        _ties("{"),
        r"model\.safetensors: __metadata__ 'ramstream_ties' is not valid JSON",
    ),
    "ties-dangling": (
        None,
        _ties('{"x": "nope"}'),
        r"model\.safetensors: __metadata__ 'ramstream_ties' ties 'x' to 'nope', but the file holds no tensor",
    ),
}


@pytest.mark.parametrize("case", sorted(JSON_CASES))
def test_malformed_json_names_the_file_and_the_key(wrapped_ck, case):
    ck, m, opt = wrapped_ck
    name, fn, match = JSON_CASES[case]
    if name is None:
        fn(ck)
    else:
        _edit_json(ck / name, fn)
    _load_refused(ck, m, opt, ValueError, match)


# ---- missing and truncated files -----------------------------------------------------------------
@pytest.mark.parametrize(
    "name",
    ["model.safetensors", "optimizer.json", "optimizer.safetensors", "extra.json", "extra.safetensors"],
)
def test_a_missing_file_names_its_path(wrapped_ck, name):
    ck, m, opt = wrapped_ck
    os.remove(ck / name)
    _load_refused(ck, m, opt, FileNotFoundError, re.escape(str(ck / name)))


def test_a_missing_folder_names_its_path(tmp_path):
    m, opt = _plain()
    with pytest.raises(FileNotFoundError, match=re.escape(str(tmp_path / "nowhere"))):
        ramstream.load_checkpoint(tmp_path / "nowhere", m, opt)


@pytest.mark.parametrize("name", ["model.safetensors", "optimizer.safetensors", "extra.safetensors"])
def test_a_truncated_tensor_file_names_it_and_changes_nothing(wrapped_ck, name):
    ck, m, opt = wrapped_ck
    _truncate(ck / name)
    _load_refused(ck, m, opt, ValueError, rf"{re.escape(str(ck / name))}.*(truncated|run past the end)")


def test_a_truncated_optimizer_file_leaves_weights_moments_and_steps_bit_identical(wrapped_ck):
    """The case of issue 25: the model's weights were replaced, the moments and steps kept."""
    ck, m, opt = wrapped_ck
    weights = [p.detach().clone() for p in m.parameters()]
    masters = [t.clone() for t in opt.master_weights()]
    sd = opt.state_dict()
    moments = {
        i: (st["exp_avg"].clone(), st["exp_avg_sq"].clone(), st["step"].clone())
        for i, st in sd["state"].items()
    }
    _truncate(ck / "optimizer.safetensors", 100)
    with pytest.raises(ValueError, match=re.escape(str(ck / "optimizer.safetensors"))):
        ramstream.load_checkpoint(ck, m, opt)
    opt.synchronize()
    assert all(torch.equal(a, p) for a, p in zip(weights, m.parameters()))
    assert all(torch.equal(a, b) for a, b in zip(masters, opt.master_weights()))
    after = opt.state_dict()["state"]
    for i, (ea, eas, step) in moments.items():
        assert torch.equal(ea, after[i]["exp_avg"]) and torch.equal(eas, after[i]["exp_avg_sq"]), i
        assert torch.equal(step, after[i]["step"]) and step.item() == 4, i


def test_a_truncated_optimizer_file_changes_nothing_with_a_torch_optimizer(tmp_path):
    m, opt = _plain()
    ramstream.save_checkpoint(tmp_path / "ck", m, opt)
    m2, opt2 = _plain(seed=1)
    _truncate(tmp_path / "ck" / "optimizer.safetensors")
    _load_refused(tmp_path / "ck", m2, opt2, ValueError, r"optimizer\.safetensors")


# ---- state that does not fit ---------------------------------------------------------------------
def test_an_optimizer_state_that_does_not_fit_changes_nothing(tmp_path, wrapped_ck):
    ck, m, opt = wrapped_ck
    m2 = _model()
    params = list(m2.parameters())
    two = torch.optim.AdamW([{"params": params[:2]}, {"params": params[2:]}], lr=1e-2)
    ramstream.save_checkpoint(tmp_path / "two", m2, two)
    _load_refused(
        tmp_path / "two",
        m,
        opt,
        ValueError,
        r"optimizer\.json: 'param_groups' holds 2 groups, the optimizer 1",
    )


def test_a_moment_of_the_wrong_size_changes_nothing(wrapped_ck):
    from safetensors.torch import save_file

    from ramstream._tensorfile import read_safetensors

    ck, m, opt = wrapped_ck
    path = str(ck / "optimizer.safetensors")
    tensors = {k: v.clone() for k, v in read_safetensors(path)[0].items()}
    tensors["state.0.exp_avg"] = torch.zeros(5)  # a valid file, the wrong state
    save_file(tensors, path)
    _load_refused(
        ck, m, opt, ValueError, r"optimizer\.safetensors, tensor 'state\.0\.exp_avg': .* 5 elements"
    )


def test_a_model_file_of_another_shape_or_dtype_changes_nothing(tmp_path, wrapped_ck):
    ck, m, opt = wrapped_ck
    path = ck / "model.safetensors"
    header, data = _split(path)
    header["0.bias"]["shape"] = [6, 8]  # 48 elements still: the file is valid
    _join(path, header, data)
    _load_refused(
        ck,
        m,
        opt,
        ValueError,
        r"model\.safetensors, tensor '0\.bias': shape \(6, 8\), the model's is \(48,\)",
    )
    header["0.bias"]["shape"], header["0.bias"]["dtype"] = [48], "I32"
    _join(path, header, data)
    _load_refused(ck, m, opt, ValueError, r"model\.safetensors, tensor '0\.bias': dtype torch\.int32")
    header["0.bias"]["dtype"] = "F32"
    header["extra.weight"] = header.pop("4.bias")
    _join(path, header, data)
    _load_refused(
        ck,
        m,
        opt,
        ValueError,
        r"model\.safetensors does not match the model: it lacks 1 .*'4\.bias'.* holds 1 .*'extra\.weight'",
    )


# ---- the layout a data-parallel save writes ------------------------------------------------------
def _as_shards(ck) -> None:
    """The optimizer files rewritten as a 1-rank data-parallel save writes them."""
    with open(ck / "optimizer.json") as f:
        js = json.load(f)
    base = ck / "optimizer-00000-of-00001"
    with open(f"{base}.json", "w") as f:
        json.dump(js["state"], f)
    os.rename(ck / "optimizer.safetensors", f"{base}.safetensors")
    js["state"], js["shards"] = {}, 1
    with open(ck / "optimizer.json", "w") as f:
        json.dump(js, f)


def test_sharded_optimizer_files_are_checked_too(wrapped_ck):
    ck, m, opt = wrapped_ck
    _as_shards(ck)
    m2, opt2, _ = _wrapped()
    ramstream.load_checkpoint(ck, m2, opt2)  # the layout itself loads
    assert opt2.state_dict()["state"][0]["step"].item() == 2
    shard = ck / "optimizer-00000-of-00001.json"
    _edit_json(shard, lambda v: v["0"].__setitem__("step", -1))
    _load_refused(
        ck, m, opt, ValueError, rf"{re.escape(str(shard))}: the file\['0'\]\['step'\] must be a non-negative"
    )
    os.remove(shard)
    _load_refused(ck, m, opt, FileNotFoundError, re.escape(str(shard)))


# ---- the check reads the model's keys without building its state dict --------------------------
def test_model_signature_equals_the_state_dict():
    transformers = pytest.importorskip("transformers")
    peft = pytest.importorskip("peft")
    from ramstream._checkpoint_read import model_signature
    from ramstream.quant import quantize_model

    def sig(model):
        return {k: (tuple(v.shape), v.dtype) for k, v in model.state_dict().items()}

    cfg = transformers.GPT2Config(vocab_size=64, n_embd=32, n_layer=2, n_head=4, n_positions=32)
    gpt2 = transformers.GPT2LMHeadModel(cfg)
    gpt2, _ = ramstream.wrap(
        gpt2, torch.optim.AdamW(gpt2.parameters()), device="cpu", param_offload=True, threads=1
    )
    assert model_signature(gpt2) == sig(gpt2)  # tied, streamed
    cfg = transformers.LlamaConfig(
        vocab_size=64,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
    )
    llama = transformers.LlamaForCausalLM(cfg).to(torch.bfloat16)
    quantize_model(llama, "nf4")
    llama = peft.get_peft_model(llama, peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
    assert model_signature(llama) == sig(llama)  # packed weights count as the weights they serve


def test_values_offload_adamw_refuses_change_nothing(wrapped_ck):
    """OffloadAdamW.load_state_dict's own value rules (a negative lr, a negative second moment)
    run before the model is installed."""
    from safetensors.torch import save_file

    from ramstream._tensorfile import read_safetensors

    ck, m, opt = wrapped_ck
    path = str(ck / "optimizer.safetensors")
    tensors = {k: v.clone() for k, v in read_safetensors(path)[0].items()}
    tensors["state.1.exp_avg_sq"][0] = -1.0
    save_file(tensors, path)
    _load_refused(
        ck, m, opt, ValueError, r"the optimizer state does not fit .*\['exp_avg_sq'\] has negative values"
    )
    os.remove(ck / "optimizer.safetensors")
    ramstream.save_checkpoint(ck, m, opt)  # a valid one again, then a negative lr
    _edit_json(ck / "optimizer.json", _set("param_groups", 0, "lr", -1.0))
    _load_refused(ck, m, opt, ValueError, r"the optimizer state does not fit .*\['lr'\]")
