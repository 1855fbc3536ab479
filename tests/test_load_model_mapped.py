"""load_model keeps an unpacked tensor stored in the model's dtype as a private mapping of its
file's bytes (tensor_reads.map_tensor), as from_pretrained does, instead of copying it: checked by
where its memory lies (/proc/self/maps), against from_pretrained's values, with tied embeddings,
a write that must not reach the file, a deleted file, a misaligned file (copied instead),
disable_mmap=True (every tensor copied) and the mappings' release with the model."""

from __future__ import annotations

import gc
import json
import os
import struct

import pytest
import torch

transformers = pytest.importorskip("transformers")
safetensors_torch = pytest.importorskip("safetensors.torch")
from ramstream.integrations import hf_load
from ramstream.integrations.hf_load import load_model
from ramstream.integrations.tensor_reads import map_tensor

pytestmark = [
    pytest.mark.filterwarnings("ignore::FutureWarning", "ignore::UserWarning"),
    pytest.mark.skipif(not os.path.exists("/proc/self/maps"), reason="needs Linux /proc"),
]


def _save(tmp_path, *, vocab=96, tied=False, dtype=torch.bfloat16, sharded=True):
    cfg = transformers.LlamaConfig(
        vocab_size=vocab,
        hidden_size=64,
        intermediate_size=160,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        tie_word_embeddings=tied,
    )
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg).to(dtype)
    folder = tmp_path / f"ckpt-{vocab}-{tied}-{str(dtype)[6:]}"
    model.save_pretrained(folder, max_shard_size="60KB" if sharded else "10GB")
    return str(folder)


def _file_maps(folder) -> list[tuple[int, int]]:
    out = []
    with open("/proc/self/maps") as f:
        for line in f:
            if folder in line:
                lo, hi = (int(x, 16) for x in line.split()[0].split("-"))
                out.append((lo, hi))
    return out


def _mapped(t: torch.Tensor, folder) -> bool:
    """Whether t's memory lies in a mapping of a file of folder."""
    p, n = t.data_ptr(), t.numel() * t.element_size()
    return any(lo <= p and p + n <= hi for lo, hi in _file_maps(folder))


def _tensors(model) -> dict[str, torch.Tensor]:
    return dict(model.named_parameters(remove_duplicate=False)) | dict(model.named_buffers())


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_unpacked_tensors_stay_mappings_of_the_file_and_equal_from_pretrained(tmp_path, monkeypatch, tied):
    folder = _save(tmp_path, tied=tied)
    monkeypatch.setattr(hf_load, "_SHARE_MIN", 0)  # every tensor of this tiny model
    got = load_model(folder, quantize="none")
    ref = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16)
    tg, tr = _tensors(got), _tensors(ref)
    assert tg.keys() == tr.keys()
    for k, t in tg.items():
        assert t.dtype == tr[k].dtype and t.shape == tr[k].shape and torch.equal(t, tr[k]), k
        assert _mapped(t, folder) == ("rotary" not in k), k  # inv_freq is computed, not stored
    head, emb = got.get_output_embeddings().weight, got.get_input_embeddings().weight
    assert (head is emb) == tied and head.requires_grad and emb.requires_grad
    ids = torch.randint(0, 96, (2, 9))
    with torch.no_grad():
        assert torch.equal(got(ids).logits, ref(ids).logits)
    packed = load_model(folder, quantize="nf4", quant_block_size=32)  # the embeddings, the norms
    kept = {k: t for k, t in _tensors(packed).items() if "rotary" not in k}
    codes = [k for k in kept if k.endswith(("weight_codes", "weight_absmax"))]
    assert codes and all(_mapped(t, folder) == (k not in codes) for k, t in kept.items())


def test_by_default_only_tensors_of_1_mib_or_more_are_mapped(tmp_path):
    folder = _save(tmp_path, vocab=8192, sharded=False)  # embeddings and head: 8192 x 64 bf16 = 1 MiB
    got = load_model(folder, quantize="nf4")
    assert _mapped(got.model.embed_tokens.weight, folder) and _mapped(got.lm_head.weight, folder)
    assert not _mapped(got.model.norm.weight, folder)  # 128 bytes: copied
    codes = [b for n, b in got.named_buffers() if n.endswith("weight_codes")]
    assert codes and not any(_mapped(c, folder) for c in codes)


def test_disable_mmap_copies_every_tensor(tmp_path, monkeypatch):
    folder = _save(tmp_path)
    monkeypatch.setattr(hf_load, "_SHARE_MIN", 0)
    got = load_model(folder, quantize="none", disable_mmap=True)
    assert not any(_mapped(t, folder) for t in _tensors(got).values())
    ref = load_model(folder, quantize="none")
    for k, t in _tensors(ref).items():
        assert torch.equal(t, _tensors(got)[k]), k
    with pytest.raises(ValueError, match="disable_mmap=1 is not accepted"):
        load_model(folder, disable_mmap=1)


def test_a_cast_tensor_is_copied(tmp_path, monkeypatch):
    folder = _save(tmp_path, dtype=torch.float32)
    monkeypatch.setattr(hf_load, "_SHARE_MIN", 0)
    got = load_model(folder, quantize="none")  # float32 file, bfloat16 model
    assert got.lm_head.weight.dtype == torch.bfloat16
    assert not any(_mapped(t, folder) for t in _tensors(got).values())


def test_writes_stay_private_and_the_mappings_leave_with_the_model(tmp_path, monkeypatch):
    folder = _save(tmp_path, sharded=False)
    monkeypatch.setattr(hf_load, "_SHARE_MIN", 0)
    path = os.path.join(folder, "model.safetensors")
    before = open(path, "rb").read()
    model = load_model(folder, quantize="nf4")
    emb = model.model.embed_tokens.weight
    assert _mapped(emb, folder)
    with torch.no_grad():
        emb.mul_(2)  # copy-on-write: this process's pages only
    assert open(path, "rb").read() == before
    fresh = load_model(folder, quantize="nf4").model.embed_tokens.weight
    assert torch.equal(emb, fresh * 2)
    del model, emb, fresh
    gc.collect()
    assert not _file_maps(folder)


def test_a_deleted_file_leaves_the_model_intact(tmp_path, monkeypatch):
    folder = _save(tmp_path)
    monkeypatch.setattr(hf_load, "_SHARE_MIN", 0)
    got = load_model(folder, quantize="none")
    want = {k: t.clone() for k, t in _tensors(got).items()}
    for name in os.listdir(folder):
        os.remove(os.path.join(folder, name))
    for k, t in _tensors(got).items():
        assert torch.equal(t, want[k]), k


def test_a_misaligned_file_is_copied_and_loads_the_same(tmp_path, monkeypatch):
    """One byte of header padding puts every bf16 tensor at an odd offset: nothing can be viewed
    in place, so everything is read into memory of its own, with the same values."""
    folder = _save(tmp_path, sharded=False)
    monkeypatch.setattr(hf_load, "_SHARE_MIN", 0)
    ref = load_model(folder, quantize="none", disable_mmap=True)
    path = os.path.join(folder, "model.safetensors")
    raw = open(path, "rb").read()
    (n,) = struct.unpack("<Q", raw[:8])
    json.loads(raw[8 : 8 + n])
    with open(path, "wb") as f:  # a space after the JSON is still the same header
        f.write(struct.pack("<Q", n + 1) + raw[8 : 8 + n] + b" " + raw[8 + n :])
    got = load_model(folder, quantize="none")
    assert not any(_mapped(t, folder) for t in _tensors(got).values())
    for k, t in _tensors(ref).items():
        assert torch.equal(t, _tensors(got)[k]), k


def test_map_tensor_checks_the_file_and_the_offset(tmp_path):
    path = tmp_path / "f.bin"
    data = torch.arange(5000, dtype=torch.int16)
    path.write_bytes(data.numpy().tobytes())
    t = map_tensor(str(path), 4096 + 2, (10, 5), torch.int16)  # past the first page, in the middle
    assert t.shape == (10, 5) and torch.equal(t.view(-1), data[2049:2099])
    with pytest.raises(ValueError, match="past the end of the file"):
        map_tensor(str(path), 9000, (1000,), torch.int16)
    with pytest.raises(ValueError, match="cannot map"):
        map_tensor(str(path), 3, (4,), torch.int16)
    with pytest.raises(ValueError, match="cannot map"):
        map_tensor(str(path), 0, (0,), torch.int16)
