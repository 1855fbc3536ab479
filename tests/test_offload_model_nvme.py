"""OffloadModel(nvme=, nvme_layers=, nvme_path=): frozen chunks' weights at home on disk
(weights/disk_slab.py). Outputs and trained weights equal the run without disk and plain torch
bit for bit (CPU copier); the scratch file is closed by close() and by garbage collection; the
staging ring is window-sized; errors name the option."""

from __future__ import annotations

import copy
import gc
import os

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from ramstream import OffloadModel
from ramstream.weights.disk_slab import DiskWeights
from ramstream.weights.slab import make_copier

from _models import open_files_in, scratch_folder

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)]


@pytest.fixture
def folder(tmp_path, monkeypatch):
    """A folder for the scratch file (tmpfs when there is one); nothing left open in it after."""
    yield from scratch_folder(tmp_path, monkeypatch, "rs-omnvme-")


def _chunks(n=5, d=16, trained=()):
    """A LoRA-like stack: frozen base chunks (Linear, GELU, LayerNorm, Linear; a bf16 Linear in
    chunk 1: two dtypes in one record), and small trained adapters in the chunks `trained`."""
    torch.manual_seed(0)
    out = []
    for i in range(n):
        c = nn.Sequential(nn.Linear(d, 2 * d), nn.GELU(), nn.LayerNorm(2 * d), nn.Linear(2 * d, d))
        c.requires_grad_(False)
        if i in trained:
            c.append(nn.Linear(d, d, bias=False))
            nn.init.normal_(c[-1].weight, std=0.02)
        if i == 1:
            c.append(_Bf16Linear(d))
        out.append(c)
    return out


class _Bf16Linear(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.lin = nn.Linear(d, d).to(torch.bfloat16).requires_grad_(False)

    def forward(self, x):
        return x + self.lin(x.to(torch.bfloat16)).float()


def _data(steps=3, d=16):
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(4, d, generator=g), torch.randn(4, d, generator=g)) for _ in range(steps)]


def test_forward_equals_without_disk_and_plain_torch(folder):
    chunks = _chunks()
    ref = nn.Sequential(*copy.deepcopy(chunks))
    plain = OffloadModel(copy.deepcopy(chunks), device="cpu")
    disk = OffloadModel(copy.deepcopy(chunks), device="cpu", nvme=2, nvme_path=folder)
    assert disk.nvme_layers == frozenset({1, 4})  # RamTorch's placement
    for x, _ in _data():
        want = ref(x)
        assert torch.equal(plain(x), want)
        assert torch.equal(disk(x), want)
        with torch.no_grad():
            assert torch.equal(disk(x), want)
    # at rest a disk chunk's parameters are empty stand-ins; state_dict() reads the weights
    assert disk.chunks[1][0].weight.numel() == 0
    sd, want = disk.state_dict(), plain.state_dict()
    assert sd.keys() == want.keys() and all(torch.equal(sd[k], want[k]) for k in want)
    plain.close()
    disk.close()


@pytest.mark.parametrize("window", [1, 2, 3])
def test_training_with_frozen_disk_chunks_equals_the_run_without_disk(folder, window):
    chunks = _chunks(trained=(0, 2))
    runs = []
    for kw in ({}, dict(nvme_layers=[1, 3, 4], nvme_path=folder)):
        model = OffloadModel(copy.deepcopy(chunks), device="cpu", window=window, keep_activations=True, **kw)
        opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
        outs = []
        for x, y in _data():
            outs.append(model.step(x, y).output)
            opt.step()
            opt.zero_grad()
        runs.append((outs, [p.detach().clone() for p in model.parameters() if p.requires_grad], model))
    (o0, w0, m0), (o1, w1, m1) = runs
    assert all(torch.equal(a, b) for a, b in zip(o0, o1))
    assert len(w0) == len(w1) == 2 and all(torch.equal(a, b) for a, b in zip(w0, w1))
    assert not any(torch.equal(a, chunks[i][4].weight) for a, i in zip(w1, (0, 2)))  # trained
    st = m1.stats
    assert st["nvme_staging_bytes"] > 0 and st["nvme_loads"] >= 2 * 3
    m0.close()
    m1.close()


@pytest.mark.parametrize("keep", [False, "checkpoint"])
def test_recompute_and_host_optimizer_with_disk_chunks(folder, keep):
    chunks = _chunks(trained=(0, 2))
    runs = []
    for kw in ({}, dict(nvme_layers=[1, 4], nvme_path=folder)):
        model = OffloadModel(copy.deepcopy(chunks), device="cpu", keep_activations=keep, **kw)
        opt = model.optimizer(lr=1e-2)  # rebuilds the streamer: the disk chunks are written again
        for x, y in _data():
            model.step(x, y)
            opt.step()
        runs.append(([p.detach().clone() for p in model.parameters() if p.requires_grad], model))
    (w0, m0), (w1, m1) = runs
    assert all(torch.equal(a, b) for a, b in zip(w0, w1))
    x = _data()[0][0]
    assert torch.equal(m0(x), m1(x))
    opt.close()
    m0.close()
    m1.close()


def test_stats_count_disk_loads_and_bytes(folder):
    model = OffloadModel(_chunks(), device="cpu", window=2, nvme_layers=[0, 3], nvme_path=folder)
    st = model.stats
    assert st["nvme_loads"] == st["nvme_bytes_read"] == 0 and st["nvme_direct"] in (True, False)
    records = model._hooks.disk.sizes
    model(_data()[0][0])
    st = model.stats
    assert st["nvme_loads"] == 2 and st["nvme_bytes_read"] == sum(records)
    expect = sum(p.numel() * p.element_size() for i in (0, 3) for p in _chunks()[i].parameters())
    assert expect <= sum(records) < expect + 512 * 8  # each tensor padded to 512 bytes at most
    model.close()


@pytest.mark.parametrize("window", [1, 2, 3])
def test_staging_ring_is_window_sized(folder, window):
    model = OffloadModel(
        _chunks(n=6, trained=(0,)), device="cpu", window=window, nvme=5, nvme_path=folder, pin_layers=[0]
    )
    assert model.nvme_layers == frozenset({1, 2, 3, 5})  # RamTorch's placement minus the pinned
    disk = model._hooks.disk
    for x, y in _data():
        model.step(x, y)
        model(x)
    assert disk.stats["staging_extra"] == 0
    assert model.stats["nvme_staging_bytes"] == window * disk.largest < sum(disk.sizes)
    model.close()


def test_file_closed_by_close_and_by_gc(folder):
    model = OffloadModel(_chunks(), device="cpu", nvme=1, nvme_path=folder)
    assert len(open_files_in(folder)) == 1 and os.listdir(folder) == []  # unlinked at open
    model.close()
    assert open_files_in(folder) == []
    model.close()  # idempotent
    model = OffloadModel(_chunks(), device="cpu", nvme=1, nvme_path=folder)
    model(_data()[0][0])
    del model
    gc.collect()
    assert open_files_in(folder) == []


def test_nvme_path_from_env_and_file_form(folder, monkeypatch):
    monkeypatch.setenv("RAMSTREAM_NVME_DIR", folder)
    model = OffloadModel(_chunks(), device="cpu", nvme=1)
    assert model._hooks.disk.directory == folder
    model.close()
    monkeypatch.delenv("RAMSTREAM_NVME_DIR")
    model = OffloadModel(_chunks(), device="cpu", nvme=1, nvme_path=os.path.join(folder, "w.bin"))
    assert model._hooks.disk.directory == folder and not os.path.exists(os.path.join(folder, "w.bin"))
    model.close()


def test_errors_name_the_option(folder):
    with pytest.raises(ValueError, match="nvme_path"):
        OffloadModel(_chunks(), device="cpu", nvme=1)
    with pytest.raises(NotImplementedError, match=r"nvme_layers=\[2\].*only frozen chunk weights"):
        OffloadModel(_chunks(trained=(2,)), device="cpu", nvme_layers=[2], nvme_path=folder)
    # a trained chunk that is pinned is not on disk: fine
    OffloadModel(
        _chunks(trained=(2,)), device="cpu", nvme_layers=[2], pin_layers=[2], nvme_path=folder
    ).close()


def test_unwritable_folder_raises_oserror_naming_it_before_any_weight_moved(folder):
    chunks = _chunks()
    ref = nn.Sequential(*copy.deepcopy(chunks))
    before = [p.data_ptr() for c in chunks for p in c.parameters()]
    missing = os.path.join(folder, "no", "such")
    with pytest.raises(OSError, match="no/such"):
        OffloadModel(chunks, device="cpu", nvme=2, nvme_path=missing + os.sep)
    with pytest.raises(OSError, match=r"nvme_path='.*/no'"):  # a file path: its folder
        OffloadModel(
            chunks, device="cpu", nvme=2, nvme_path=missing, keep_activations=True, activation_offload=True
        )
    assert [p.data_ptr() for c in chunks for p in c.parameters()] == before
    x = _data()[0][0]
    assert torch.equal(nn.Sequential(*chunks)(x), ref(x))  # the chunks run as before, no hook left
    assert not any(m._forward_hooks or m._forward_pre_hooks for c in chunks for m in c.modules())


def test_load_state_dict_writes_the_disk_records(folder):
    model = OffloadModel(_chunks(), device="cpu", nvme=2, nvme_path=folder)
    other = _chunks()
    for c in other:
        with torch.no_grad():
            for p in c.parameters():
                p.mul_(0.5)
    ref = nn.Sequential(*other)
    model.load_state_dict({f"chunks.{k}": v for k, v in ref.state_dict().items()})
    x = _data()[0][0]
    assert torch.equal(model(x), ref(x))
    model.close()


def test_set_pinned_moves_a_disk_chunk_to_the_device(folder):
    chunks = _chunks()
    ref = nn.Sequential(*copy.deepcopy(chunks))
    model = OffloadModel(chunks, device="cpu", nvme_layers=[1, 4], nvme_path=folder)
    model.set_pinned([1])
    assert model.nvme_layers == frozenset({4}) and model.chunks[1][0].weight.numel() > 0
    x = _data()[0][0]
    assert torch.equal(model(x), ref(x))
    model.set_pinned([])
    assert model.nvme_layers == frozenset({1, 4})
    assert torch.equal(model(x), ref(x))
    model.close()


@pytest.mark.parametrize("device", DEVICES)
def test_forward_and_loss_on_device(folder, device):
    chunks = _chunks(trained=(1,))
    ref = nn.Sequential(*copy.deepcopy(chunks)).to(device)
    model = OffloadModel(chunks, device=device, window=2, nvme=3, nvme_path=folder)
    x, y = _data()[0]
    assert torch.equal(model(x), ref(x.to(device)))
    res = model.step(x, y)
    assert torch.equal(res.loss, F.mse_loss(ref(x.to(device)), y.to(device)))
    model.close()


def test_disk_slab_reads_ahead_and_evicts_before_use(folder):
    g = torch.Generator().manual_seed(2)
    values = [[torch.randn(3, 5, generator=g), torch.randn(7, generator=g).to(torch.bfloat16)]]
    values.append([torch.randn(4, 4, generator=g)])
    params = [[nn.Parameter(v.clone(), requires_grad=False) for v in vs] for vs in values]
    disk = DiskWeights(params, folder, copier=make_copier(torch.device("cpu")), ahead=1)
    a, b = disk.slabs(params)
    assert [p.numel() for vs in params for p in vs] == [0, 0, 0] and disk.ring_size == 2
    a.load()
    b.load()  # both reads in flight (or done); filled at wait() at the latest
    b.wait()
    a.wait()
    assert all(torch.equal(p, v) for ps, vs in zip(params, values) for p, v in zip(ps, vs))
    b.evict()
    b.load()
    b.evict()  # evicted before its read was waited for: the buffer comes back after the read
    a.evict()
    assert len(disk.free) == 2 and disk.pending == [] and disk.stats["nvme_loads"] == 3
    assert disk.stats["staging_extra"] == 0 and disk.staging_bytes() == 2 * disk.largest
    with a.paged(write_back=True):
        params[0][0].mul_(2)
    a.load()
    a.wait()
    assert torch.equal(params[0][0], values[0][0] * 2)
    a.evict()
    disk.close()
