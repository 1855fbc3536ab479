"""profile_hardware(): the rates cache (hit, force, corrupt file, RAMSTREAM_CACHE_DIR), the values
read on every call (RAM with a cgroup limit, LOCAL_WORLD_SIZE), and HardwareProfile's JSON."""

from __future__ import annotations

import json
import os

import pytest

import ramstream
from ramstream.planner import measure
from ramstream.planner import profile as prof_mod
from ramstream.planner.rules import HOST_RAM_SHARE

RATES = {"h2d_gbps": 12.5, "d2h_gbps": 11.0, "duplex_gbps": 9.5, "adamw_gbps": 30.0, "matmul_tflops": None}


@pytest.fixture
def counted(monkeypatch, tmp_path):
    """RAMSTREAM_CACHE_DIR in tmp_path and a measurement that counts its calls."""
    calls = []

    def fake(device, quick=True):
        calls.append((device, quick))
        return dict(RATES)

    monkeypatch.setenv("RAMSTREAM_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(prof_mod, "measure_rates", fake)
    return calls


def _files(tmp_path):
    d = tmp_path / "cache"
    return sorted(p for p in d.iterdir() if p.suffix == ".json") if d.exists() else []


def test_second_call_reads_the_cache_and_force_measures_again(counted, tmp_path):
    a = ramstream.profile_hardware("cpu")
    assert len(counted) == 1 and a.source == "measured"
    assert a.h2d_gbps == 12.5 and a.matmul_tflops is None and a.device == "cpu"
    (f,) = _files(tmp_path)  # one file, under RAMSTREAM_CACHE_DIR, named by a hash
    assert f.name.startswith("profile-") and "cpu" not in f.name
    b = ramstream.profile_hardware("cpu")
    assert len(counted) == 1 and b.source == "cache" and b.duplex_gbps == 9.5
    c = ramstream.profile_hardware("cpu", force=True)
    assert len(counted) == 2 and c.source == "measured"
    assert json.loads(f.read_text())["rates"]["adamw_gbps"] == 30.0
    assert not [p for p in (tmp_path / "cache").iterdir() if p.suffix == ".tmp"]  # renamed, none left


@pytest.mark.parametrize(
    "content", [b"{not json", b"\xff\xfe\x00", b'{"key": 1, "rates": {}}', b"[]", b""], ids=str
)
def test_a_corrupt_cache_file_is_measured_again_and_rewritten(counted, tmp_path, content):
    ramstream.profile_hardware("cpu")
    (f,) = _files(tmp_path)
    f.write_bytes(content)
    p = ramstream.profile_hardware("cpu")
    assert len(counted) == 2 and p.source == "measured"
    assert json.loads(f.read_text())["rates"]["h2d_gbps"] == 12.5


def test_a_cached_rate_that_is_not_a_positive_number_is_measured_again(counted, tmp_path):
    ramstream.profile_hardware("cpu")
    (f,) = _files(tmp_path)
    data = json.loads(f.read_text())
    data["rates"]["h2d_gbps"] = -1
    f.write_text(json.dumps(data))
    ramstream.profile_hardware("cpu")
    assert len(counted) == 2


def test_cache_dir_is_honoured_and_an_unwritable_one_is_no_error(counted, tmp_path, monkeypatch):
    other = tmp_path / "elsewhere"
    monkeypatch.setenv("RAMSTREAM_CACHE_DIR", str(other))
    ramstream.profile_hardware("cpu")
    assert len(list(other.glob("profile-*.json"))) == 1
    blocker = tmp_path / "a_file"
    blocker.write_text("x")
    monkeypatch.setenv("RAMSTREAM_CACHE_DIR", str(blocker / "sub"))  # cannot be created
    p = ramstream.profile_hardware("cpu")
    assert p.source == "measured"


def test_default_cache_dir(monkeypatch):
    monkeypatch.delenv("RAMSTREAM_CACHE_DIR", raising=False)
    assert prof_mod.cache_dir() == os.path.join(os.path.expanduser("~"), ".cache", "ramstream")


def test_cached_profile_never_measures(counted):
    assert prof_mod.cached_profile("cpu") is None and counted == []
    ramstream.profile_hardware("cpu")
    assert prof_mod.cached_profile("cpu").source == "cache" and len(counted) == 1


def test_ram_and_pin_budget_are_read_on_every_call_and_split_per_rank(counted, monkeypatch):
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    p = ramstream.profile_hardware("cpu")
    assert p.local_world_size == 4
    assert p.pin_budget == ramstream.pin_budget()
    assert (
        p.ram_per_rank == int(p.ram_available * HOST_RAM_SHARE) // 4 and p.pin_per_rank == p.pin_budget // 4
    )
    with open("/proc/meminfo") as f:
        total = next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemTotal:"))
    assert p.ram_total == total and 0 < p.ram_available <= total
    for bad in ("0", "x", ""):
        monkeypatch.setenv("LOCAL_WORLD_SIZE", bad)
        monkeypatch.delenv("SLURM_NTASKS_PER_NODE", raising=False)
        assert ramstream.profile_hardware("cpu").local_world_size == 1
    monkeypatch.delenv("LOCAL_WORLD_SIZE")
    monkeypatch.setenv("SLURM_NTASKS_PER_NODE", "2")
    assert prof_mod.local_world_size() == 2


def _cgroup(tmp_path, files: dict) -> str:
    root = tmp_path / "cg"
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    return str(root)


def test_cgroup_v2_and_v1_parsing(tmp_path):
    root = _cgroup(tmp_path, {"memory.max": "8589934592\n", "memory.current": "1073741824\n"})
    assert measure.cgroup_memory(root) == {"limit": 8 << 30, "usage": 1 << 30}
    root = _cgroup(tmp_path / "b", {"memory.max": "max\n", "memory.current": "5"})
    assert measure.cgroup_memory(root) == {"limit": None, "usage": 5}
    root = _cgroup(
        tmp_path / "c", {"memory/memory.limit_in_bytes": str(1 << 62), "memory/memory.usage_in_bytes": "7"}
    )
    assert measure.cgroup_limit(root) is None  # v1's "unlimited"
    root = _cgroup(
        tmp_path / "d", {"memory/memory.limit_in_bytes": "1073741824", "memory/memory.usage_in_bytes": "x"}
    )
    assert measure.cgroup_memory(root) == {"limit": 1 << 30, "usage": None}
    assert measure.cgroup_memory(str(tmp_path / "none")) == {"limit": None, "usage": None}


def test_available_ram_is_lowered_to_the_cgroup_limit_less_usage(tmp_path):
    from ramstream.hardware import host_memory

    mem_avail = host_memory()["available"]
    limit, usage = 3 << 30, 1 << 30
    root = _cgroup(tmp_path, {"memory.max": str(limit), "memory.current": str(usage)})
    r = prof_mod.available_ram(root)
    assert r["cgroup_limit"] == limit and abs(r["available"] - min(mem_avail, limit - usage)) < 64 << 20
    huge = _cgroup(tmp_path / "h", {"memory.max": str(1 << 59), "memory.current": "0"})
    assert abs(prof_mod.available_ram(huge)["available"] - mem_avail) < 64 << 20
    over = _cgroup(tmp_path / "o", {"memory.max": str(1 << 30), "memory.current": str(2 << 30)})
    assert prof_mod.available_ram(over)["available"] == 0


def test_profile_json_round_trip_and_errors():
    p = ramstream.HardwareProfile(device="cuda:0", gpu_name="X", vram_total=80 << 30, matmul_tflops=500.0)
    text = json.dumps(p.to_dict())
    assert ramstream.HardwareProfile.from_dict(json.loads(text)) == p
    with pytest.raises(ValueError, match="unknown key.*bogus"):
        ramstream.HardwareProfile.from_dict({"bogus": 1})
    with pytest.raises(TypeError, match="expected a dict"):
        ramstream.HardwareProfile.from_dict([1])


def test_profile_hardware_argument_errors():
    with pytest.raises(TypeError, match="quick"):
        ramstream.profile_hardware("cpu", quick=1)
    with pytest.raises(TypeError, match="device"):
        ramstream.profile_hardware(3.5)
    with pytest.raises(ValueError, match="accepted: None, 'cpu', 'cuda'"):
        ramstream.profile_hardware("nonsense")


def test_cpu_measurements_are_real_and_positive():
    """The shared measurement functions themselves, small and quick, on the CPU."""
    r = measure.copy_rates(1 << 20, "cpu", repeat=1)
    assert r["pinned"] is False and r["h2d_gbps"] == r["d2h_gbps"] == r["duplex_gbps"] > 0
    assert measure.host_adamw_gbps(10_000, repeat=1) > 0
    assert measure.matmul_tflops("cpu") is None
