"""ramstream.disk.DiskStore (the disk tier's mechanism, issue 29): bit-identical round trips of
float32/bfloat16 tensors of odd sizes over many records with reads and writes interleaved (direct
and buffered); the file's life (exclusive, 0600, removed on close, after an exception, on garbage
collection, at exit, never left by a kill); a file-size limit (full disk) raising OSError with the
errno while earlier records stay readable; bad directories, sizes and alignment; measure_disk."""

from __future__ import annotations

import gc
import os
import stat
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from ramstream import pinned_empty
from ramstream.disk import DiskStore, measure_disk

REPO = Path(__file__).resolve().parents[1]
DIRS = ["tmp"] + (["shm"] if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else [])


@pytest.fixture
def where(request, tmp_path):
    if getattr(request, "param", "tmp") == "shm":
        import tempfile

        d = tempfile.mkdtemp(dir="/dev/shm", prefix="rs-disk-")
        yield d
        os.rmdir(d)  # fails if the store left a file
    else:
        yield str(tmp_path)
        assert os.listdir(tmp_path) == [], "the store left a file behind"


def _random(n: int, dtype: torch.dtype, g: torch.Generator) -> torch.Tensor:
    t = pinned_empty(n, dtype)
    if dtype.is_floating_point:
        t.copy_(torch.randn(n, generator=g).to(dtype))
    return t


@pytest.mark.parametrize("where", DIRS, indirect=True)
@pytest.mark.parametrize("direct", [None, False])
@pytest.mark.parametrize("chunk_bytes", [3 * 4096, 8 << 20])
def test_round_trip_is_bit_identical_with_reads_and_writes_interleaved(where, direct, chunk_bytes):
    g = torch.Generator().manual_seed(0)
    numels = [1, 3, 1023, 1024, 1025, 4099, 0, 65_537, 100_003, 7, 262_147, 12_345]
    dtypes = [torch.float32 if i % 2 else torch.bfloat16 for i in range(len(numels))]
    sizes = [n * torch.tensor([], dtype=d).element_size() for n, d in zip(numels, dtypes)]
    with DiskStore(where, sizes, chunk_bytes=chunk_bytes, io_threads=3, direct=direct) as s:
        if direct is False:
            assert s.direct is False
        truth = [_random(n, d, g) for n, d in zip(numels, dtypes)]
        for r in [s.write_from(i, t) for i, t in enumerate(truth)]:
            r.wait()
        order = torch.randperm(len(numels), generator=g).tolist()
        for step in range(4):
            pending = []
            for k, i in enumerate(order):  # reads of some records while others are written
                if (k + step) % 3 == 0:
                    truth[i] = _random(numels[i], dtypes[i], g)
                    pending.append((None, s.write_from(i, truth[i])))
                else:
                    out = pinned_empty(numels[i], dtypes[i]).fill_(7)
                    pending.append((i, s.read_into(i, out)))
            for i, r in pending:
                t = r.wait()
                if i is not None:
                    assert torch.equal(t.view(torch.uint8), truth[i].view(torch.uint8)), f"record {i}"
        st = s.stats()
        assert st["errors"] == 0 and st["bytes_written"] > 0 and st["bytes_read"] > 0
        assert st["read_seconds"] > 0 and st["write_seconds"] > 0
        assert st["alignment"] % 4096 == 0 and st["file_bytes"] % st["alignment"] == 0


def test_an_unwritten_record_reads_zeros_and_stats_count_bytes(tmp_path):
    with DiskStore(tmp_path, [40_000, 400]) as s:
        out = pinned_empty(10_000, torch.float32).fill_(1.0)
        assert s.read_into(0, out).wait() is out
        assert torch.count_nonzero(out) == 0
        src = pinned_empty(100, torch.float32).fill_(2.5)
        r = s.write_from(1, src)
        r.wait()
        assert r.done() and r.wait() is src  # a second wait returns at once
        st = s.stats()
        assert (st["bytes_read"], st["bytes_written"], st["reads"], st["writes"]) == (40_000, 400, 1, 1)


def _mode(path: str) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


def test_the_file_is_0600_exclusive_and_removed_on_close(tmp_path):
    s = DiskStore(tmp_path, [4096, 10], unlink_on_open=False)
    assert os.path.dirname(s.path) == str(tmp_path) and os.path.basename(s.path).startswith("ramstream-")
    assert _mode(s.path) == 0o600 and stat.S_ISREG(os.stat(s.path).st_mode)
    other = DiskStore(tmp_path, [4096], unlink_on_open=False)  # a second store: its own name
    assert other.path != s.path
    s.close()
    s.close()  # idempotent
    assert not os.path.exists(s.path) and s.closed
    with pytest.raises(ValueError, match="closed"):
        s.read_into(0, pinned_empty(1024, torch.float32))
    other.close()
    assert os.listdir(tmp_path) == []


def _open_files() -> list[str]:
    out = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            out.append(os.readlink(f"/proc/self/fd/{fd}"))
        except OSError:  # the descriptor listdir itself used, closed since
            pass
    return out


def test_by_default_the_name_is_gone_at_once_so_a_crash_leaves_nothing(tmp_path):
    with DiskStore(tmp_path, [8192]) as s:
        assert os.listdir(tmp_path) == []  # unlinked right after open
        assert any(p.startswith(s.path) and p.endswith("(deleted)") for p in _open_files())
        src = pinned_empty(2048, torch.float32).fill_(3.0)
        s.write_from(0, src).wait()
        out = pinned_empty(2048, torch.float32)
        assert torch.equal(s.read_into(0, out).wait(), src)


def test_removed_after_an_exception_in_the_with_block(tmp_path):
    with pytest.raises(RuntimeError, match="boom"):
        with DiskStore(tmp_path, [4096], unlink_on_open=False) as s:
            path = s.path
            assert os.path.exists(path)
            s.write_from(0, pinned_empty(1024, torch.float32).zero_())  # in flight: close waits
            raise RuntimeError("boom")
    assert not os.path.exists(path) and s.closed


def test_removed_when_garbage_collected(tmp_path):
    s = DiskStore(tmp_path, [4096], unlink_on_open=False)
    path = s.path
    r = s.write_from(0, pinned_empty(1024, torch.float32).zero_())
    del s
    gc.collect()
    assert not os.path.exists(path)
    r.wait()  # the request ended before the store closed
    assert os.listdir(tmp_path) == []


def _python(code: str, timeout: float = 120) -> subprocess.CompletedProcess:
    """`code` in a fresh interpreter that imports the same ramstream as this one (source install,
    editable install or wheel)."""
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def test_removed_at_exit_and_never_left_by_a_kill(tmp_path):
    p = _python(f"""
        from ramstream.disk import DiskStore
        s = DiskStore({str(tmp_path)!r}, [4096], unlink_on_open=False)
        print(s.path)
        """)
    assert p.returncode == 0, p.stderr
    assert not os.path.exists(p.stdout.strip())
    p = _python(f"""
        import os, signal
        from ramstream.disk import DiskStore
        s = DiskStore({str(tmp_path)!r}, [1 << 20])
        os.kill(os.getpid(), signal.SIGKILL)
        """)
    assert p.returncode == -9
    assert os.listdir(tmp_path) == []


def test_a_full_disk_raises_oserror_and_loses_nothing(tmp_path):
    """RLIMIT_FSIZE stands for a full disk (no root needed): the reservation fails at open; without
    it the write past the limit fails at wait() with EFBIG, the records written before read back
    bit-identical, the failed record refuses reads (EIO) and the store goes on."""
    p = _python(f"""
        import errno, resource, signal, torch
        from ramstream import pinned_empty
        from ramstream.disk import DiskStore
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        d, k = {str(tmp_path)!r}, 1 << 18
        resource.setrlimit(resource.RLIMIT_FSIZE, (4 * k, 4 * k))
        try:
            DiskStore(d, [k, k, 4 * k])
            raise SystemExit("no error at open")
        except OSError as e:
            assert e.errno == errno.EFBIG and "EFBIG" in str(e) and "reserve" in str(e), e
        s = DiskStore(d, [k, k, 4 * k], preallocate=False)
        a = pinned_empty(k // 4, torch.float32).normal_()
        b = pinned_empty(k // 2, torch.bfloat16).normal_()
        c = pinned_empty(k, torch.float32).normal_()
        s.write_from(0, a).wait(); s.write_from(1, b).wait()
        try:
            s.write_from(2, c).wait()
            raise SystemExit("no error at the write past the limit")
        except OSError as e:
            assert e.errno in (errno.EFBIG, errno.ENOSPC) and "record 2" in str(e), e
            print("ERR", e)
        assert torch.equal(s.read_into(0, pinned_empty(k // 4, torch.float32)).wait(), a)
        assert torch.equal(s.read_into(1, pinned_empty(k // 2, torch.bfloat16)).wait().view(torch.int16),
                           b.view(torch.int16))
        try:
            s.read_into(2, pinned_empty(k, torch.float32))
            raise SystemExit("read of the failed record")
        except OSError as e:
            assert e.errno == errno.EIO and "last write failed" in str(e), e
        a.fill_(5.0); s.write_from(0, a).wait()
        assert torch.equal(s.read_into(0, pinned_empty(k // 4, torch.float32)).wait(), a)
        assert s.stats()["errors"] == 1
        s.close()
        print("OK")
        """)
    assert p.returncode == 0 and "OK" in p.stdout, p.stdout + p.stderr
    assert "EFBIG" in p.stdout
    assert os.listdir(tmp_path) == []


def test_a_bad_directory_is_an_oserror_naming_the_path(tmp_path):
    missing = tmp_path / "no" / "such"
    with pytest.raises(FileNotFoundError, match=str(missing)):
        DiskStore(missing, [4096])
    f = tmp_path / "plain"
    f.write_text("x")
    with pytest.raises(NotADirectoryError, match=str(f)):
        DiskStore(f, [4096])
    if os.geteuid() != 0:  # root writes anywhere
        ro = tmp_path / "ro"
        ro.mkdir(mode=0o500)
        with pytest.raises(PermissionError, match=str(ro)):
            DiskStore(ro, [4096])


def test_bad_buffers_and_arguments_are_value_errors(tmp_path):
    with DiskStore(tmp_path, [8192, 100]) as s:
        base = pinned_empty(4096, torch.float32)
        with pytest.raises(ValueError, match=f"aligned to {s.alignment} bytes"):
            s.write_from(0, base[16 : 16 + 2048])  # 64 bytes past an aligned block
        with pytest.raises(ValueError, match="holds 100 bytes, the tensor 96"):
            s.read_into(1, pinned_empty(24, torch.float32))
        with pytest.raises(ValueError, match=r"record must be an int in \[0, 2\)"):
            s.read_into(2, pinned_empty(25, torch.float32))
        with pytest.raises(ValueError, match="contiguous"):
            s.write_from(0, pinned_empty((64, 64), torch.float32)[:, :32])
        with pytest.raises(TypeError):
            s.write_from(0, [1.0])
    with pytest.raises(ValueError, match="record_bytes"):
        DiskStore(tmp_path, [-1])
    with pytest.raises(ValueError, match="chunk_bytes"):
        DiskStore(tmp_path, [4096], chunk_bytes=1000)
    with pytest.raises(ValueError, match="io_threads"):
        DiskStore(tmp_path, [4096], io_threads=0)


def test_measure_disk_reports_rates_and_the_mode(tmp_path):
    m = measure_disk(tmp_path, 8 << 20, record_bytes=2 << 20)
    assert m["read_gbps"] > 0 and m["write_gbps"] > 0 and isinstance(m["direct"], bool)
    assert m["bytes"] == 8 << 20 and m["alignment"] % 4096 == 0
    assert os.listdir(tmp_path) == []
    assert measure_disk(tmp_path, 1 << 20, direct=False)["direct"] is False
