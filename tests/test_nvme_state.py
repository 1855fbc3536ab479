"""The NVMe tier of the host optimizer state (wrap(nvme_offload=..., nvme_dir=...), engine/disk_tier.py,
issue 29 item 1) on the CPU engine: 10 steps with the state on disk are bit-identical to the same run
in RAM (fp32 and bf16 moments, clipping, accumulation, a partial share, delayed_update) and to
torch.optim.AdamW(fused=True); a checkpoint resumes into a fresh wrapped model; the scratch file is
gone after close(), an exception in a `with` block and garbage collection; a full disk is an OSError
at wrap() that leaves the model as it was; a failed write-back raises from synchronize() and keeps the
state; bad options; stats() counts the bytes read and written per step."""

from __future__ import annotations

import contextlib
import errno
import gc
import os
import subprocess
import sys
import textwrap

import pytest
import torch

import ramstream
from ramstream.checkpoint import load_checkpoint, save_checkpoint

from _models import batches, make_model, open_files_in, train_torch

LR, WD = 3e-3, 0.05
SHM = "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else None


@pytest.fixture
def nvme(tmp_path):
    """A folder for the scratch file (tmpfs when there is one: fast); checked empty afterwards."""
    if SHM is None:
        yield str(tmp_path)
        assert os.listdir(tmp_path) == []
        return
    import tempfile

    d = tempfile.mkdtemp(dir=SHM, prefix="rs-nvme-")
    yield d
    os.rmdir(d)  # fails if a file was left


def _wrap(model, device="cpu", **options):
    return ramstream.wrap(
        model,
        torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WD),
        device=device,
        bucket_bytes=4096,  # one bucket per weight: many buckets, paged through 3 staging buffers
        **options,
    )


def _train(model, opt, data, accumulation=1):
    for i in range(len(data) // accumulation):
        for j in range(accumulation):
            x, y = data[i * accumulation + j]
            model(x, y).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)


def _same_state(a: dict, b: dict, names=("step", "exp_avg", "exp_avg_sq", "master")) -> None:
    assert a["state"].keys() == b["state"].keys() and a["state"]
    for k in a["state"]:
        for name in names:
            x, y = a["state"][k][name], b["state"][k][name]
            assert torch.equal(x, y), (k, name)


def _same_weights(m1, m2) -> None:
    for (n, p), q in zip(m1.named_parameters(), m2.parameters()):
        assert torch.equal(p.detach(), q.detach()), n


CASES = {
    "fp32": dict(moment_dtype="float32"),
    "bf16 moments": dict(moment_dtype="bfloat16"),
    "clipping": dict(moment_dtype="float32", max_grad_norm=0.05),
    "accumulation": dict(moment_dtype="float32", accumulation_steps=2),
    "half on disk": dict(moment_dtype="float32", nvme_offload=0.5),
    "delayed update": dict(moment_dtype="float32", delayed_update=2),
    "no eager updates": dict(moment_dtype="bfloat16", eager_updates=False),
}


@pytest.mark.parametrize("case", list(CASES))
def test_ten_steps_with_the_state_on_disk_equal_the_run_in_ram(case, nvme):
    options = dict(CASES[case])
    share = options.pop("nvme_offload", True)
    acc = options.get("accumulation_steps", 1)
    data = batches(10 * acc)
    ram_model, ram_opt = _wrap(make_model(0), nvme_offload=False, **options)
    _train(ram_model, ram_opt, data, acc)
    model, opt = _wrap(make_model(0), nvme_offload=share, nvme_dir=nvme, **options)
    st = opt.stats()
    n = len(opt._engine.buckets)
    assert 0 < st["nvme_buckets"] <= n and (st["nvme_buckets"] < n) == (share != 1.0)
    assert st["host_state_bytes"] < ram_opt.stats()["host_state_bytes"]
    _train(model, opt, data, acc)
    _same_state(opt.state_dict(), ram_opt.state_dict())
    _same_weights(model, ram_model)
    for a, b in zip(opt.master_weights(), ram_opt.master_weights()):
        assert torch.equal(a, b)
    ramstream.unwrap(model)
    ramstream.unwrap(ram_model)
    assert open_files_in(nvme) == []


def test_equal_to_torch_adamw_fused_on_the_cpu(nvme):
    data = batches(10)
    ref = make_model(0)
    train_torch(ref, torch.optim.AdamW(ref.parameters(), lr=LR, weight_decay=WD, fused=True), data)
    model, opt = _wrap(make_model(0), nvme_offload=True, nvme_dir=nvme, moment_dtype="float32")
    _train(model, opt, data)
    opt.synchronize()
    _same_weights(model, ref)
    opt.close()


def test_state_dict_of_disk_buckets_is_copies_and_loads_back(nvme):
    model, opt = _wrap(make_model(0), nvme_offload=True, nvme_dir=nvme, moment_dtype="float32")
    _train(model, opt, batches(3))
    sd = opt.state_dict()
    bufs = {b.data_ptr() for b in opt._engine.disk.free}
    for st in sd["state"].values():  # not views of a staging buffer that the next step rewrites
        for name in ("exp_avg", "exp_avg_sq", "master"):
            assert st[name].untyped_storage().data_ptr() not in bufs
    saved = {k: {n: t.clone() for n, t in v.items()} for k, v in sd["state"].items()}
    _train(model, opt, batches(2, seed=5))
    opt.load_state_dict({"state": saved, "param_groups": sd["param_groups"]})
    # the moments and steps are written to disk (the master stays: the weights moved on since)
    _same_state(opt.state_dict(), {"state": saved}, ("step", "exp_avg", "exp_avg_sq"))
    opt.close()


@pytest.mark.parametrize("moment_dtype", ["float32", "bfloat16"])
def test_a_checkpoint_resumes_into_a_fresh_model_with_disk(tmp_path, nvme, moment_dtype):
    data = batches(10)
    full, full_opt = _wrap(make_model(0), nvme_offload=False, moment_dtype=moment_dtype)
    _train(full, full_opt, data)
    first, first_opt = _wrap(make_model(0), nvme_offload=True, nvme_dir=nvme, moment_dtype=moment_dtype)
    _train(first, first_opt, data[:5])
    save_checkpoint(tmp_path / "ckpt", first, first_opt)
    ramstream.unwrap(first)
    second, second_opt = _wrap(make_model(7), nvme_offload=True, nvme_dir=nvme, moment_dtype=moment_dtype)
    load_checkpoint(tmp_path / "ckpt", second, second_opt)
    _train(second, second_opt, data[5:])
    _same_weights(second, full)
    _same_state(second_opt.state_dict(), full_opt.state_dict())
    ramstream.unwrap(second)


def _adamw(model, nvme, **kw):
    return ramstream.OffloadAdamW(
        model.parameters(), device="cpu", bucket_bytes=4096, nvme_offload=True, nvme_dir=nvme, **kw
    )


def test_the_scratch_file_is_gone_after_close_an_exception_and_gc(nvme):
    model = make_model(0)
    opt = _adamw(model, nvme)
    assert os.listdir(nvme) == []  # unlinked at open: a crash leaves nothing
    held = open_files_in(nvme)
    assert len(held) == 1 and held[0].endswith("(deleted)")
    opt.close()
    opt.close()
    assert open_files_in(nvme) == []
    with pytest.raises(RuntimeError, match="boom"):
        with _adamw(model, nvme) as opt:
            assert len(open_files_in(nvme)) == 1
            raise RuntimeError("boom")
    assert open_files_in(nvme) == []
    model = make_model(0)
    opt = _adamw(model, nvme)
    x, y = batches(1)[0]
    model(x, y).backward()
    opt.step()
    assert len(open_files_in(nvme)) == 1
    del model, opt
    gc.collect()
    assert open_files_in(nvme) == []


def test_stats_count_the_bytes_read_and_written_per_step(nvme):
    model, opt = _wrap(make_model(0), nvme_offload=True, nvme_dir=nvme, moment_dtype="bfloat16")
    n = sum(b.numel for b in opt._engine.buckets)
    state = n * (4 + 2 + 2)  # fp32 master + two bf16 moments
    st = opt.stats()
    assert st["nvme_state_bytes"] == state and st["nvme_dir"] == nvme
    assert st["nvme_bytes_written"] == state and st["nvme_bytes_read"] == 0  # written once at wrap()
    assert isinstance(st["nvme_direct"], bool) and st["nvme_staging_bytes"] > 0
    for k, (x, y) in enumerate(batches(4), start=1):
        model(x, y).backward()
        opt.step()
        opt.synchronize()  # every write-back ended: each step reads and writes the state once
        st = opt.stats()
        # every write exact (the SSD's wear); reads at least the state: a read ahead on a wrong guess
        # of the next bucket to update reads that bucket again later
        assert st["nvme_bytes_written"] == (k + 1) * state
        assert st["nvme_step_bytes_written"] == state
        assert k * state <= st["nvme_bytes_read"] <= k * state * 3  # <= 2 reads ahead per update
        assert state <= st["nvme_step_bytes_read"] <= state * 3
    assert st["nvme_reads_ahead"] > 0  # some updates found their state read ahead
    rep = ramstream.memory_report(model)["optimizer"]
    assert rep["nvme"]["state_bytes"] == state and rep["host_state_bytes"] == 0
    ramstream.unwrap(model)


def test_a_failed_write_back_raises_and_keeps_the_state(nvme, monkeypatch):
    data = batches(6)
    ram_model, ram_opt = _wrap(make_model(0), nvme_offload=False, moment_dtype="float32")
    _train(ram_model, ram_opt, data)
    model, opt = _wrap(make_model(0), nvme_offload=True, nvme_dir=nvme, moment_dtype="float32")
    _train(model, opt, data[:3])
    tier = opt._engine.disk

    class Failed:
        def __init__(self, i, t):
            pass

        def wait(self):
            raise OSError(errno.EIO, "injected write failure")

        def done(self):
            return True

    real = tier.store.write_from
    monkeypatch.setattr(tier.store, "write_from", Failed)
    x, y = data[3]
    model(x, y).backward()
    with pytest.raises(OSError, match="nvme_dir") as info:
        opt.step()  # the step is taken (its updates ran during backward); the error is reported
        opt.synchronize()
    assert info.value.errno == errno.EIO and "kept in RAM" in str(info.value)
    with contextlib.suppress(OSError):  # the writes still in flight fail too, reported once
        opt.synchronize()
    opt.synchronize()
    assert all(p.dirty for p in tier.pages.values())  # every bucket's new state kept in RAM
    sd = opt.state_dict()  # a checkpoint still has it
    monkeypatch.setattr(tier.store, "write_from", real)
    _train(model, opt, data[4:])  # written again at their next update
    opt.synchronize()
    assert not any(p.dirty for p in tier.pages.values())
    _same_weights(model, ram_model)
    _same_state(opt.state_dict(), ram_opt.state_dict())
    assert sd["state"]
    ramstream.unwrap(model)


def test_a_full_disk_is_an_oserror_at_wrap_that_leaves_the_model(tmp_path):
    """RLIMIT_FSIZE stands for a full disk: the store's reservation fails at wrap()."""
    # the same interpreter finds the same ramstream (a wheel, or an editable install's finder)
    code = f"""
        import resource, signal, torch, sys
        sys.path.insert(0, {os.path.dirname(__file__)!r})
        import ramstream
        assert ramstream.__file__ == {ramstream.__file__!r}, ramstream.__file__
        from _models import make_model
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        model = make_model(0)
        before = [p.detach().clone() for p in model.parameters()]
        resource.setrlimit(resource.RLIMIT_FSIZE, (4096, 4096))
        try:
            ramstream.wrap(model, torch.optim.AdamW(model.parameters()), device="cpu",
                           nvme_offload=True, nvme_dir={str(tmp_path)!r})
            raise SystemExit("no error at wrap()")
        except OSError as e:
            assert {str(tmp_path)!r} in str(e) and "bytes needed" in str(e), e
            print("ERR", e)
        assert getattr(model, "_ramstream", None) is None
        assert all(torch.equal(a, p) for a, p in zip(before, model.parameters()))
        assert all(not hasattr(p, "_ramstream_slot") for p in model.parameters())
        print("OK")
        """
    p = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=120
    )
    assert p.returncode == 0 and "OK" in p.stdout, p.stdout + p.stderr
    assert os.listdir(tmp_path) == []


def test_bad_options_name_the_option_and_the_accepted_values(tmp_path, monkeypatch):
    monkeypatch.delenv("RAMSTREAM_NVME_DIR", raising=False)
    model = make_model(0)
    for bad in (2, 0, -0.5, "yes", None, float("nan")):
        with pytest.raises(ValueError, match=r"nvme_offload=.*accepted: 'auto'"):
            _wrap(model, nvme_offload=bad)
    with pytest.raises(ValueError, match="nvme_dir"):
        _wrap(model, nvme_dir=3)
    for share in (True, 0.5):
        with pytest.raises(ValueError, match="nvme_offload.*nvme_dir.*RAMSTREAM_NVME_DIR"):
            _wrap(model, nvme_offload=share)
        with pytest.raises(ValueError, match="nvme_offload.*optimizer_mode='gpu'"):
            _wrap(model, nvme_offload=share, nvme_dir=str(tmp_path), optimizer_mode="gpu")
        with pytest.raises(ValueError, match="nvme_offload.*distributed"):
            _wrap(model, nvme_offload=share, nvme_dir=str(tmp_path), distributed=True)
    with pytest.raises(ValueError, match="nvme_offload.*mode='gpu'"):
        ramstream.OffloadAdamW(
            model.parameters(), device="cpu", mode="gpu", nvme_offload=True, nvme_dir=tmp_path
        )
    missing = tmp_path / "missing"
    with pytest.raises(FileNotFoundError, match="missing"):
        _wrap(model, nvme_offload=True, nvme_dir=missing)
    (tmp_path / "f").write_text("")
    with pytest.raises(NotADirectoryError, match="nvme_dir"):
        _wrap(model, nvme_offload=True, nvme_dir=tmp_path / "f")
    assert getattr(model, "_ramstream", None) is None
    # the variable stands for nvme_dir; "auto" without a plan (the CPU engine) puts nothing on disk
    monkeypatch.setenv("RAMSTREAM_NVME_DIR", str(tmp_path))
    m, opt = _wrap(make_model(0), nvme_offload=True)
    assert opt.stats()["nvme_dir"] == str(tmp_path)
    ramstream.unwrap(m)
    m, opt = _wrap(make_model(0))
    assert opt._engine.disk is None and "nvme_state_bytes" not in opt.stats()
    ramstream.unwrap(m)


def test_the_share_is_taken_from_the_back_of_the_stack(nvme):
    from ramstream.engine.disk_tier import choose_disk_buckets, record_bytes

    model, opt = _wrap(make_model(0), nvme_offload=0.3, nvme_dir=nvme)
    e = opt._engine
    on_disk = [b.index for b in e.buckets if b.disk is not None]
    assert on_disk == list(range(len(e.buckets) - len(on_disk), len(e.buckets)))
    total = sum(record_bytes(b, e.moment_dtype) for b in e.buckets)
    got = sum(record_bytes(b, e.moment_dtype) for b in e.buckets if b.disk is not None)
    assert 0 < got and got - record_bytes(e.buckets[on_disk[0]], e.moment_dtype) / 2 <= 0.3 * total
    assert choose_disk_buckets(e.buckets, 0.0, e.moment_dtype) == []
    assert all(b.exp_avg is not None and b.exp_avg.device.type == "meta" for b in e.buckets if b.disk)
    ramstream.unwrap(model)


@pytest.mark.cuda
@pytest.mark.parametrize("moment_dtype", ["float32", "bfloat16"])
def test_on_the_gpu_the_state_on_disk_equals_the_run_in_ram(nvme, moment_dtype):
    """The GPU engine: gradients land in pinned buffers, the host AdamW pages the disk buckets in,
    the new weights go back by H2D; bit-identical to the same run with the state in RAM."""
    data = batches(10, device="cuda")
    runs = []
    for share in (False, True):
        model, opt = _wrap(
            make_model(0).cuda(),
            device="cuda",  # the GPU engine (device="cpu" would move the model back to the host)
            nvme_offload=share,
            nvme_dir=nvme if share else None,
            moment_dtype=moment_dtype,
            optimizer_mode="cpu",
            offload=True,
        )
        _train(model, opt, data)
        runs.append((model, opt))
    (ram_model, ram_opt), (model, opt) = runs
    _same_weights(model, ram_model)
    _same_state(opt.state_dict(), ram_opt.state_dict())
    ramstream.unwrap(model)
    ramstream.unwrap(ram_model)


def test_the_host_memory_check_counts_the_disk_share_out_and_the_staging_buffers_in():
    from ramstream.planner.host_fit import host_components

    ram = host_components(10**9, 2, 4, False, 0)
    disk = host_components(10**9, 2, 4, False, 0, nvme_share=1.0, bucket_bytes=32 << 20)
    half = host_components(10**9, 2, 4, False, 0, nvme_share=0.5)
    assert disk["fp32 master"] == disk["moments"] == 0 and half["moments"] == ram["moments"] // 2
    assert disk["nvme staging buffers"] == 3 * (16 << 20) * 12
    assert disk["landing buffer"] == ram["landing buffer"]
