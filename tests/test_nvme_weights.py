"""wrap(nvme_weights=...): streamed blocks' frozen weights at home on disk (issue 29; runtime/
disk_weights.py over weights/disk_slab.py). Training equals the run with them in RAM and plain
torch bit for bit (CPU engine); state dicts, checkpoints and unwrap() see the real weights; the
scratch file is gone after unwrap, a failed wrap and garbage collection; a full disk is an OSError
at wrap() that leaves the model; bad values name the option."""

from __future__ import annotations

import copy
import gc
import os
import subprocess
import sys
import textwrap

import pytest
import torch
import torch.nn as nn

import ramstream
from ramstream.checkpoint import load_checkpoint, save_checkpoint
from ramstream.planner.disk_weights import reads_per_step

from _models import Block, TinyGPT, batches, open_files_in, scratch_folder

LR, WD = 3e-3, 0.05


@pytest.fixture
def folder(tmp_path, monkeypatch):
    """A folder for the scratch file (tmpfs when there is one); nothing left open or named in it."""
    yield from scratch_folder(tmp_path, monkeypatch, "rs-nvw-")


class LoraBlock(Block):
    """A frozen base block with a small trained adapter beside it (LoRA's shape)."""

    def __init__(self, d: int) -> None:
        super().__init__(d)
        self.requires_grad_(False)
        self.a = nn.Linear(d, 4, bias=False)
        self.b = nn.Linear(4, d, bias=False)
        nn.init.normal_(self.b.weight, std=0.05)

    def forward(self, x):
        return super().forward(x) + self.b(self.a(x))


def lora_model(seed=0, dtype=torch.float32, n_blocks=4) -> TinyGPT:
    torch.manual_seed(seed)
    m = TinyGPT(n_blocks=n_blocks, tied=False)
    m.blocks = nn.ModuleList(LoraBlock(32) for _ in range(n_blocks))
    m.emb.requires_grad_(False)
    return m.to(dtype)


def _opt(m):
    return torch.optim.AdamW([p for p in m.parameters() if p.requires_grad], lr=LR, weight_decay=WD)


def _wrap(m, **kw):
    return ramstream.wrap(m, _opt(m), device="cpu", param_offload=True, weight_window=1, **kw)


def _train(model, opt, data):
    losses = []
    for x, y in data:
        loss = model(x, y)
        loss.backward()
        losses.append(loss.item())
        opt.step()
        opt.zero_grad(set_to_none=True)
    return losses


def _weights(model) -> dict:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _equal(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]), k


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_lora_training_with_the_base_on_disk_equals_ram_and_torch(folder, dtype):
    data = batches(4)
    base = lora_model(dtype=dtype)
    ref = copy.deepcopy(base)
    ram, ram_opt = _wrap(copy.deepcopy(base))
    disk, disk_opt = _wrap(copy.deepcopy(base), nvme_weights=True, nvme_dir=folder)
    rep = ramstream.memory_report(disk)["params"]["nvme_weights"]
    assert rep["blocks"] == [0, 1, 2, 3] and rep["bytes_on_disk"] >= sum(
        p.nbytes for b in base.blocks for p in b.parameters() if not p.requires_grad
    )
    # at rest the frozen base is an empty stand-in; the adapters stay real (in RAM)
    assert all(p.numel() == 0 for b in disk.blocks for p in b.parameters() if not p.requires_grad)
    assert all(p.numel() > 0 for b in disk.blocks for p in b.parameters() if p.requires_grad)
    got = _train(disk, disk_opt, data)
    want = _train(ram, ram_opt, data)
    assert got == want
    _equal(_weights(disk), _weights(ram))
    if dtype == torch.float32:  # the host AdamW equals torch's fused AdamW on the CPU, bit for bit
        ref_opt = torch.optim.AdamW(
            [p for p in ref.parameters() if p.requires_grad], lr=LR, weight_decay=WD, fused=True
        )
        assert _train(ref, ref_opt, data) == got
        _equal(_weights(disk), _weights(ref))
    # reads per step: the planner's count (two loads per block, one for the last weight_window + 1)
    rep = ramstream.memory_report(disk)["params"]["nvme_weights"]
    sizes = dict(zip(rep["blocks"], disk._ramstream.disk_weights.store.sizes))  # the records' bytes
    # weight_window=1: the running block and one ahead stay loaded from the forward into the backward
    assert rep["bytes_read_last_step"] == reads_per_step([0, 1, 2, 3], [0, 1, 2, 3], sizes, window=2)
    assert rep["bytes_read_last_step"] == 2 * (sizes[0] + sizes[1]) + sizes[2] + sizes[3]
    assert rep["bytes_written_per_step"] == 0
    ramstream.unwrap(disk)
    ramstream.unwrap(ram)


def test_some_blocks_on_disk_an_int_and_a_list(folder):
    data = batches(3)
    base = lora_model()
    ram, ram_opt = _wrap(copy.deepcopy(base))
    want = _train(ram, ram_opt, data)
    for option, blocks in ((2, [2, 3]), ([0, 2], [0, 2])):
        m, opt = _wrap(copy.deepcopy(base), nvme_weights=option, nvme_dir=folder)
        assert ramstream.memory_report(m)["params"]["nvme_weights"]["blocks"] == blocks
        assert _train(m, opt, data) == want
        _equal(_weights(m), _weights(ram))
        ramstream.unwrap(m)


def test_auto_on_the_cpu_engine_and_false_put_nothing_on_disk(folder):
    for option in ("auto", False, 0, []):
        m, _ = _wrap(lora_model(), nvme_weights=option, nvme_dir=folder)
        assert ramstream.memory_report(m)["params"]["nvme_weights"] is None
        ramstream.unwrap(m)


def test_full_fine_tune_is_refused_naming_the_option(folder):
    torch.manual_seed(0)
    m = TinyGPT(n_blocks=3)
    before = _weights(m)
    with pytest.raises(NotImplementedError, match="nvme_weights=True.*no frozen weight"):
        _wrap(m, nvme_weights=True, nvme_dir=folder)
    assert getattr(m, "_ramstream", None) is None
    _equal(_weights(m), before)


def test_state_dict_round_trip_and_load_writes_the_records(folder):
    data = batches(3)
    a, a_opt = _wrap(lora_model(seed=0), nvme_weights=True, nvme_dir=folder)
    _train(a, a_opt, data[:1])
    other = lora_model(seed=5)
    sd = _weights(other)
    a.load_state_dict(sd)
    assert all(p.numel() == 0 for b in a.blocks for p in b.parameters() if not p.requires_grad)
    _equal(_weights(a), sd)  # read back from disk
    # state_dict entries are copies that outlive the paging
    got = a.state_dict()
    _train(a, a_opt, data[1:2])
    assert got["blocks.0.fc1.weight"].numel() > 0 and torch.equal(
        got["blocks.0.fc1.weight"], sd["blocks.0.fc1.weight"]
    )
    with pytest.raises(ValueError, match="assign=True"):
        a.load_state_dict(sd, assign=True)
    ramstream.unwrap(a)


def test_checkpoint_resumes_into_a_fresh_model_with_disk(tmp_path, folder):
    data = batches(4)
    ram, ram_opt = _wrap(lora_model())
    want = _train(ram, ram_opt, data)
    first, first_opt = _wrap(lora_model(), nvme_weights=True, nvme_dir=folder)
    _train(first, first_opt, data[:2])
    save_checkpoint(tmp_path / "ckpt", first, first_opt)
    ramstream.unwrap(first)
    second, second_opt = _wrap(lora_model(seed=9), nvme_weights=True, nvme_dir=folder)
    load_checkpoint(tmp_path / "ckpt", second, second_opt)
    got = _train(second, second_opt, data[2:])
    assert got == want[2:]
    _equal(_weights(second), _weights(ram))
    ramstream.unwrap(second)


def test_unwrap_gives_real_tensors_and_removes_the_file(folder):
    m, opt = _wrap(lora_model(), nvme_weights=True, nvme_dir=folder)
    _train(m, opt, batches(2))
    want = _weights(m)
    assert open_files_in(folder) != []  # the store's file (unlinked at open) is held open
    ramstream.unwrap(m)
    assert open_files_in(folder) == []
    got = {k: v.detach().clone() for k, v in m.state_dict().items()}
    _equal(got, want)
    assert all(p.numel() > 0 for p in m.parameters())


def test_a_wrap_that_fails_after_the_disk_opened_loses_nothing(folder, monkeypatch):
    wrap_mod = sys.modules["ramstream.wrap"]

    def boom(*a, **k):
        raise RuntimeError("injected")

    m = lora_model()
    before = _weights(m)
    monkeypatch.setattr(wrap_mod, "build_streamer", boom)
    with pytest.raises(RuntimeError, match="injected"):
        _wrap(m, nvme_weights=True, nvme_dir=folder)
    gc.collect()
    assert open_files_in(folder) == []
    assert getattr(m, "_ramstream", None) is None
    _equal(_weights(m), before)


def test_garbage_collection_removes_the_file(folder):
    m, opt = _wrap(lora_model(), nvme_weights=True, nvme_dir=folder)
    _train(m, opt, batches(1))
    del m, opt
    gc.collect()
    assert open_files_in(folder) == []


@pytest.mark.parametrize("value", ["x", -1, 1.5, [True], [-1], {"a": 1}, None])
def test_bad_values_name_the_option_and_the_accepted_ones(folder, value):
    with pytest.raises(ValueError, match=r"nvme_weights=.*accepted: 'auto'.*True.*False.*int k"):
        _wrap(lora_model(), nvme_weights=value, nvme_dir=folder)


def test_choices_that_cannot_apply_are_refused_before_anything_moved(folder):
    m = lora_model()
    before = _weights(m)
    cases = [
        (dict(nvme_weights=True), "nvme_dir"),  # no folder
        (dict(nvme_weights=True, nvme_dir=folder, param_offload=False), "no block streams"),
        (dict(nvme_weights=[5], nvme_dir=folder), "do not stream"),
        (dict(nvme_weights=9, nvme_dir=folder), "more than the 4 streamed blocks"),
    ]
    for kw, text in cases:
        opts = dict(param_offload=True, weight_window=1) | kw
        with pytest.raises(ValueError, match=text):
            ramstream.wrap(m, _opt(m), device="cpu", **opts)
        assert getattr(m, "_ramstream", None) is None
        _equal(_weights(m), before)
    missing = os.path.join(folder, "missing")
    with pytest.raises(OSError, match="nvme_dir=.*missing"):
        _wrap(m, nvme_weights=True, nvme_dir=missing)
    _equal(_weights(m), before)


def test_a_full_disk_is_an_oserror_at_wrap_that_leaves_the_model(tmp_path):
    """RLIMIT_FSIZE stands for a full disk: the store's reservation fails before any weight moved."""
    code = f"""
        import resource, signal, sys
        sys.path.insert(0, {os.path.dirname(__file__)!r})
        import torch, ramstream
        assert ramstream.__file__ == {ramstream.__file__!r}, ramstream.__file__  # the same ramstream
        from test_nvme_weights import lora_model, _opt
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        model = lora_model()
        before = [p.detach().clone() for p in model.parameters()]
        resource.setrlimit(resource.RLIMIT_FSIZE, (4096, 4096))
        try:
            ramstream.wrap(model, _opt(model), device="cpu", param_offload=True, nvme_weights=True,
                           nvme_dir={str(tmp_path)!r})
            raise SystemExit("no error at wrap()")
        except OSError as e:
            assert "nvme_dir=" in str(e) and {str(tmp_path)!r} in str(e) and "bytes needed" in str(e), e
            print("ERR", e)
        assert getattr(model, "_ramstream", None) is None
        assert all(p.numel() and torch.equal(a, p) for a, p in zip(before, model.parameters()))
        print("OK")
        """
    p = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=120
    )
    assert p.returncode == 0 and "OK" in p.stdout, p.stdout + p.stderr
    assert os.listdir(tmp_path) == []
