"""load_model's threaded, bounded reader (integrations/tensor_reads.py): many workers and tiny
pieces give the same model bit for bit as one worker; an error inside a worker names the file and
the tensor and leaves no thread, mapping or model behind; the bytes in flight stay under the cap."""

from __future__ import annotations

import gc
import os
import threading
import time
import weakref

import pytest
import torch

transformers = pytest.importorskip("transformers")
from ramstream.integrations import hf_load, tensor_reads
from ramstream.integrations.hf_load import load_model
from ramstream.integrations.tensor_reads import read_into, run_bounded, with_range

pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning", "ignore::UserWarning")


def _save(tmp_path, dtype, sharded=True):
    cfg = transformers.LlamaConfig(
        vocab_size=96,
        hidden_size=64,
        intermediate_size=160,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg).to(dtype)
    folder = tmp_path / f"ckpt-{str(dtype)[6:]}"
    model.save_pretrained(folder, max_shard_size="60KB" if sharded else "10GB")
    return str(folder)


def _tensors(model):
    out = dict(model.named_parameters(remove_duplicate=False)) | dict(model.named_buffers())
    for n, m in model.named_modules():
        if hasattr(m, "quant_format"):
            out[n + ".quant"] = (m.quant_format, m.quant_block_size, m.quant_shape, m.quant_dtype)
    return out


def _same(a, b):
    ta, tb = _tensors(a), _tensors(b)
    assert ta.keys() == tb.keys()
    for k, x in ta.items():
        y = tb[k]
        if isinstance(x, tuple):
            assert x == y, k
        else:
            assert x.dtype == y.dtype and x.shape == y.shape and torch.equal(x, y), k


def _tiny_pieces(monkeypatch, workers):
    """Pieces of a few hundred bytes, every range mapped (not read), every tensor kept as stored a
    mapping of the file (the reference copies them): each code path, many jobs."""
    monkeypatch.setattr(hf_load, "_WORKERS", workers)
    monkeypatch.setattr(hf_load, "_MIN_CAP", 4096)
    monkeypatch.setattr(hf_load, "_MIN_PIECE", 64)
    monkeypatch.setattr(hf_load, "_WORKING_SHARE", 1 << 40)
    monkeypatch.setattr(hf_load, "_SHARE_MIN", 0)
    monkeypatch.setattr(tensor_reads, "_MAP_MIN", 0)
    monkeypatch.setattr(tensor_reads, "usable_cores", lambda: 8)
    monkeypatch.setattr(hf_load, "usable_cores", lambda: 8)


@pytest.mark.parametrize("quantize", ["nf4", "int8", "none"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32-cast", "bf16"])
def test_many_workers_and_tiny_pieces_equal_one_worker_bit_for_bit(tmp_path, monkeypatch, quantize, dtype):
    folder = _save(tmp_path, dtype)
    monkeypatch.setattr(hf_load, "_WORKERS", 1)
    ref = load_model(folder, quantize=quantize, quant_block_size=32)
    with monkeypatch.context() as mp:
        _tiny_pieces(mp, 6)
        got = load_model(folder, quantize=quantize, quant_block_size=32)
    _same(got, ref)
    if quantize != "none":  # and both equal quantize_model of from_pretrained
        base = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16)
        base.requires_grad_(False)
        import ramstream

        ramstream.quantize_model(base, quantize, block_size=32)
        for (n, x), (n2, y) in zip(sorted(got.named_buffers()), sorted(base.named_buffers())):
            assert n == n2 and torch.equal(x, y), n


def _maps_of(folder) -> list[str]:
    with open("/proc/self/maps") as f:
        return [line for line in f if folder in line]


def _load_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("ramstream-load")]


@pytest.mark.parametrize("where", ["work", "done"])
def test_an_error_in_a_worker_names_file_and_tensor_and_leaves_nothing(tmp_path, monkeypatch, where):
    folder = _save(tmp_path, torch.bfloat16)
    _tiny_pieces(monkeypatch, 4)
    calls = []
    target = hf_load.quantize_into_ if where == "work" else hf_load.quantize_module_

    def boom(*a, **k):
        calls.append(1)
        if len(calls) == 5:
            raise RuntimeError("boom")
        if where == "work":
            time.sleep(0.002)  # others are in flight when the fifth fails
        return target(*a, **k)

    monkeypatch.setattr(hf_load, "quantize_into_" if where == "work" else "quantize_module_", boom)
    models = []
    skeleton = hf_load._skeleton
    monkeypatch.setattr(hf_load, "_skeleton", lambda *a: models.append(weakref.ref(m := skeleton(*a))) or m)
    named = r"load_model\(\): .*model-0000\d-of-0000\d\.safetensors, tensor 'model\.layers\.\d+\..*': boom"
    with pytest.raises(ValueError, match=named):
        load_model(folder, quantize="nf4")
    gc.collect()
    assert not _load_threads()
    assert not _maps_of(folder)
    assert models and models[0]() is None  # nothing half-loaded is kept


def test_a_memory_error_in_a_worker_stays_one_and_names_the_tensor(tmp_path, monkeypatch):
    folder = _save(tmp_path, torch.bfloat16, sharded=False)
    _tiny_pieces(monkeypatch, 3)

    def oom(*a, **k):
        raise MemoryError("no room")

    monkeypatch.setattr(hf_load, "quantize_into_", oom)
    with pytest.raises(MemoryError) as e:
        load_model(folder, quantize="nf4")
    assert any("model.safetensors, tensor 'model.layers." in n for n in getattr(e.value, "__notes__", []))
    assert not _load_threads()


def test_the_in_flight_cap_holds_in_load_model(tmp_path, monkeypatch):
    folder = _save(tmp_path, torch.bfloat16)
    _tiny_pieces(monkeypatch, 4)
    seen = []
    real = hf_load.run_bounded

    def observed(jobs, *, workers, cap):
        seen.append(cap)
        return real(jobs, workers=workers, cap=cap, on_admit=seen.append)

    monkeypatch.setattr(hf_load, "run_bounded", observed)
    load_model(folder, quantize="nf4")
    cap, peaks = seen[0], seen[1:]
    assert cap == 4096 and len(peaks) > 100
    assert max(peaks) <= cap


def test_run_bounded_caps_bytes_keeps_order_and_runs_an_oversized_job_alone():
    lock = threading.Lock()
    state = {"now": 0, "max": 0, "alone": True, "running": 0}
    order = []

    def job(i, size):
        def work():
            with lock:
                state["now"] += size
                state["running"] += 1
                state["max"] = max(state["max"], state["now"] if size <= 10 else 0)
                if size > 10 and state["running"] > 1:
                    state["alone"] = False
            time.sleep(0.001 * ((i * 7) % 5))  # finish out of order
            with lock:
                state["now"] -= size
                state["running"] -= 1

        return size, work, lambda: order.append(i)

    sizes = [3, 4, 2, 5, 50, 1, 6, 3, 3, 3, 4, 2] * 3
    run_bounded((job(i, s) for i, s in enumerate(sizes)), workers=5, cap=10)
    assert order == list(range(len(sizes)))
    assert 0 < state["max"] <= 10 and state["alone"]


def test_run_bounded_raises_the_first_error_in_job_order_and_starts_nothing_after():
    started = []

    def job(i):
        def work():
            started.append(i)
            if i in (3, 5):
                time.sleep(0.02 if i == 3 else 0)
                raise RuntimeError(f"job {i}")

        return 1, work, None

    with pytest.raises(RuntimeError, match="job 3"):
        run_bounded((job(i) for i in range(200)), workers=3, cap=3)
    assert max(started) < 20


def test_reads_of_a_file_that_shrank_are_refused(tmp_path):
    path = tmp_path / "f.bin"
    path.write_bytes(bytes(range(256)) * 16)
    out = torch.empty(16, dtype=torch.uint8)
    read_into(str(path), 100, out)
    assert out.tolist() == [(100 + i) % 256 for i in range(16)]
    assert with_range(str(path), 10, 4, lambda t: t.tolist()) == [10, 11, 12, 13]
    os.truncate(path, 50)
    with pytest.raises(ValueError, match="past the end of the file"):
        read_into(str(path), 40, out)
    with pytest.raises(ValueError, match="past the end of the file"):
        with_range(str(path), 40, 2 << 20, lambda t: None)


def test_interleave_merges_streams_by_their_share_in_a_fixed_order():
    a = [(4, "a0"), (4, "a1"), (2, "a2")]
    b = [(1, f"b{i}") for i in range(5)]
    jobs = [(s, n, None) for s, n in a], [(s, n, None) for s, n in b]
    order = [j[1] for j in tensor_reads.interleave([(10, jobs[0]), (5, jobs[1])])]
    # shares: a after a0 0.4, a1 0.8; b after each 0.2 .. 1.0; ties go to the earlier stream
    assert order == ["a0", "b0", "b1", "a1", "b2", "b3", "a2", "b4"]
    assert list(tensor_reads.interleave([(0, iter(())), (3, [(3, "x", None)])])) == [(3, "x", None)]
    assert list(tensor_reads.interleave([])) == []


def test_copies_run_beside_the_packing_not_before_it(tmp_path, monkeypatch):
    """The embeddings and head (first in the file) are not copied before any weight is packed:
    the two streams advance together (and the result is the same model: the tests above)."""
    folder = _save(tmp_path, torch.bfloat16)
    _tiny_pieces(monkeypatch, 4)
    events = []
    real_place, real_pack = hf_load._place, hf_load.quantize_module_

    def place(entries, value, requires_grad):
        events.append(("copy", value.numel()))
        return real_place(entries, value, requires_grad)

    def pack(module, fmt, block, weight=None, **kw):
        events.append(("pack", weight.numel()))
        return real_pack(module, fmt, block, weight=weight, **kw)

    monkeypatch.setattr(hf_load, "_place", place)
    monkeypatch.setattr(hf_load, "quantize_module_", pack)
    model = load_model(folder, quantize="nf4", disable_mmap=True)  # copied, not mapped
    first_pack = next(i for i, (k, _) in enumerate(events) if k == "pack")
    dense = sum(n for k, n in events if k == "copy")
    assert sum(n for k, n in events[:first_pack] if k == "copy") < dense / 4
    assert model.lm_head.weight.numel() == 96 * 64 and not model.lm_head.weight.is_meta


@pytest.mark.parametrize("advice", ["real", "failing"])
def test_reads_into_fresh_memory_populate_it_first_and_get_the_file_bytes(tmp_path, monkeypatch, advice):
    data = torch.randint(0, 256, (3 << 20,), dtype=torch.uint8, generator=torch.Generator().manual_seed(1))
    path = tmp_path / "blob"
    path.write_bytes(data.numpy().tobytes())
    calls = []
    real = tensor_reads._populate

    def populate(dst, n):
        calls.append(n)
        if advice == "real":
            return real(dst, n)
        return None  # the advice did nothing: the read faults the pages in itself

    monkeypatch.setattr(tensor_reads, "_populate", populate)
    dst = torch.empty((3 << 20) - 4097, dtype=torch.uint8)
    read_into(str(path), 4097, dst)
    assert calls == [dst.numel()] and torch.equal(dst, data[4097:])
    small = torch.empty(100, dtype=torch.uint8)
    read_into(str(path), 5, small)  # below _POPULATE_MIN: read as it is
    assert calls == [dst.numel()] and torch.equal(small, data[5:105])


def test_mapped_ranges_are_populated_before_use_and_give_the_file_bytes(tmp_path, monkeypatch):
    # with_range maps a range's pages (MADV_POPULATE_READ) before its function runs; with the
    # advice on or off the function sees the file's bytes, and a load gives the same model.
    data = torch.randint(0, 256, (3 << 20,), dtype=torch.uint8, generator=torch.Generator().manual_seed(2))
    path = tmp_path / "blob"
    path.write_bytes(data.numpy().tobytes())
    advised = []
    real = tensor_reads._advise
    monkeypatch.setattr(tensor_reads, "_advise", lambda p, n, a: (advised.append((n, a)), real(p, n, a)))
    got = with_range(str(path), 8192 + 3, (2 << 20) + 5, lambda t: t.clone())
    assert torch.equal(got, data[8195 : 8195 + (2 << 20) + 5])
    assert advised == [((2 << 20) + 5, tensor_reads._MADV_POPULATE_READ)]
    folder = _save(tmp_path, torch.bfloat16)
    on = load_model(folder, quantize="nf4", dtype=torch.bfloat16)
    monkeypatch.setattr(tensor_reads, "_POPULATE_RANGES", False)
    advised.clear()
    got = with_range(str(path), 8192 + 3, (2 << 20) + 5, lambda t: t.clone())
    assert torch.equal(got, data[8195 : 8195 + (2 << 20) + 5]) and advised == []
    off = load_model(folder, quantize="nf4", dtype=torch.bfloat16)
    a, b = on.state_dict(), off.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
