"""`ramstream doctor` and the no-GPU messages of info, demo and wrap(): checked against what this
machine really has (the driver library, /proc/meminfo, the arena's budget, torch's AdamW)."""

from __future__ import annotations

import ctypes
import json
import os
import subprocess
import sys

import pytest
import torch

import ramstream
import ramstream.functional as F
from ramstream import doctor
from ramstream.cli import main

NAMES = ["torch", "driver", "gpu", "build", "pinned", "copy", "adamw", "isa", "ram", "env"]


def _driver_loads() -> bool:
    try:
        ctypes.CDLL("libcuda.so.1")
        return True
    except OSError:
        return False


def _doctor_json(capsys) -> tuple[int, dict]:
    rc = main(["doctor", "--json"])
    return rc, {c["name"]: c for c in json.loads(capsys.readouterr().out)}


def test_doctor_prints_one_line_per_check_and_exits_0_when_nothing_is_broken(capsys):
    rc = main(["doctor"])
    out = capsys.readouterr().out
    lines = [
        ln.split() for ln in out.splitlines()[1:] if ln.split() and ln.split()[0] in ("OK", "WARN", "FAIL")
    ]
    assert [ln[1] for ln in lines] == NAMES
    fails = [ln[1] for ln in lines if ln[0] == "FAIL"]
    assert rc == (1 if fails else 0)
    assert not fails, out  # nothing is broken on the CI machine
    assert len(out.splitlines()) <= 25  # one screen
    # every WARN says what to do on the next line
    text = out.splitlines()
    for i, ln in enumerate(text):
        if ln.split()[:1] == ["WARN"]:
            assert text[i + 1].strip().startswith("->"), ln


def test_doctor_findings_match_the_machine(capsys, monkeypatch):
    for k in [k for k in os.environ if k.startswith("RAMSTREAM_")]:
        monkeypatch.delenv(k)
    rc, c = _doctor_json(capsys)
    assert rc == 0
    assert (c["driver"]["status"] == "OK") == _driver_loads()
    if not torch.cuda.is_available():
        assert c["gpu"]["status"] == "WARN" and "device='cpu'" in c["gpu"]["fix"]
    if not _driver_loads():
        assert "no NVIDIA driver or GPU was found" in c["driver"]["detail"]
    budget = F.pin_budget()
    assert f"budget {budget / 2**30:.1f} GiB" in c["pinned"]["detail"]
    with open("/proc/meminfo") as f:
        total = int(f.readline().split()[1]) * 1024
    assert c["ram"]["detail"].startswith(f"{total / 2**30:.1f} GiB total")
    isa = ramstream._native.lib().active_isa()
    assert c["isa"]["detail"].startswith(isa) and c["isa"]["status"] == "OK"
    assert c["adamw"]["status"] in ("OK", "WARN") and "bit-identical" in c["adamw"]["detail"]
    rate = float(c["adamw"]["detail"].split()[2])
    assert rate > 0
    assert c["env"] == {"name": "env", "status": "OK", "detail": "no RAMSTREAM_* variables set", "fix": ""}


def test_doctor_warns_about_unknown_and_lists_known_variables(capsys, monkeypatch):
    monkeypatch.setenv("RAMSTREAM_NUM_THREAD", "4")  # a typo
    monkeypatch.setenv("RAMSTREAM_POOL_SPIN_US", "10")
    rc, c = _doctor_json(capsys)
    assert rc == 0
    env = c["env"]
    assert env["status"] == "WARN"
    assert "RAMSTREAM_NUM_THREAD=4" in env["detail"]
    assert "RAMSTREAM_POOL_SPIN_US=10" in env["detail"]
    assert "unknown, ignored: RAMSTREAM_NUM_THREAD " in env["fix"]
    assert "RAMSTREAM_POOL_SPIN_US" not in env["fix"].split("(known")[0]


def test_a_wrong_host_adamw_is_a_failure_and_exit_code_1(capsys, monkeypatch):
    real = F.adamw_

    def off_by_one_ulp(p, *a, **k):
        real(p, *a, **k)
        p[0] = torch.nextafter(p[0], torch.tensor(float("inf")))

    monkeypatch.setattr(F, "adamw_", off_by_one_ulp)
    rc, c = _doctor_json(capsys)
    assert rc == 1
    assert c["adamw"]["status"] == "FAIL" and "in 1 of" in c["adamw"]["detail"]


def test_a_check_that_raises_is_a_failure_naming_the_error(capsys, monkeypatch):
    def boom():
        raise OSError("no /proc here")

    monkeypatch.setattr(doctor, "CHECKS", (doctor.check_env, boom))
    rc = main(["doctor"])
    out = capsys.readouterr().out
    assert rc == 1 and "FAIL  boom" in out and "OSError: no /proc here" in out
    assert "broken: boom" in out


@pytest.mark.parametrize(
    "env,want",
    [
        ("RAMSTREAM_PIN_BUDGET=12x", ("pinned", "WARN")),
        ("RAMSTREAM_FORCE_ISA=avx9", ("isa", "WARN")),
        ("RAMSTREAM_FORCE_ISA=scalar", ("isa", "WARN")),
    ],
)
def test_bad_or_slow_settings_warn_in_a_fresh_process(env, want):
    k, v = env.split("=")
    if v == "scalar" and ramstream._native.lib().best_isa() == "scalar":
        pytest.skip("scalar is the best ISA here")
    r = subprocess.run(
        [sys.executable, "-m", "ramstream", "doctor", "--json"],
        env={**os.environ, k: v},
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert r.returncode == 0, r.stderr
    c = {x["name"]: x for x in json.loads(r.stdout)}
    assert c[want[0]]["status"] == want[1] and c[want[0]]["fix"]


def test_cgroup_limit_reads_v2_and_v1_files(tmp_path, monkeypatch):
    real_open = open
    files = {}

    def fake_open(path, *a, **k):
        if path in files:
            p = tmp_path / "f"
            p.write_text(files[path])
            return real_open(p, *a, **k)
        if str(path).startswith("/sys/fs/cgroup"):
            raise FileNotFoundError(path)
        return real_open(path, *a, **k)

    monkeypatch.setattr("builtins.open", fake_open)
    files["/sys/fs/cgroup/memory.max"] = "max\n"
    assert doctor.cgroup_limit() is None
    files["/sys/fs/cgroup/memory.max"] = "8589934592\n"
    assert doctor.cgroup_limit() == 8 << 30
    del files["/sys/fs/cgroup/memory.max"]
    files["/sys/fs/cgroup/memory/memory.limit_in_bytes"] = str(1 << 62)
    assert doctor.cgroup_limit() is None  # v1's "unlimited"
    files["/sys/fs/cgroup/memory/memory.limit_in_bytes"] = "1073741824"
    assert doctor.cgroup_limit() == 1 << 30


# ---- no GPU: short messages instead of tracebacks ---------------------------------------------
needs_no_gpu = pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU")


@needs_no_gpu
def test_demo_on_cuda_without_a_gpu_says_why_and_exits_2(capsys):
    assert main(["demo", "--device", "cuda", "--steps", "1"]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and "device='cpu'" in err
    assert ("no NVIDIA driver or GPU was found" in err) == (not _driver_loads())
    if torch.version.cuda is None and _driver_loads():
        assert "CPU-only build" in err


@needs_no_gpu
@pytest.mark.parametrize("device", ["cuda", "cuda:1"])
def test_wrap_on_cuda_without_a_gpu_raises_a_runtime_error_saying_why(device):
    model = torch.nn.Linear(4, 4)
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(
        RuntimeError, match=r"wrap\(\): .*device='?cuda.*torch sees no CUDA GPU.*device='cpu'"
    ):
        ramstream.wrap(model, device=device)
    assert getattr(model, "_ramstream", None) is None
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))


@needs_no_gpu
def test_info_says_no_driver_instead_of_a_cuda_error_code(capsys):
    assert main(["info"]) == 0
    out = capsys.readouterr().out
    assert "driver version is insufficient" not in out
    if not _driver_loads() and ramstream._native.lib().built_with_cuda():
        assert "no NVIDIA driver or GPU was found" in out
    if not ramstream._native.lib().built_with_cuda():
        assert "no CUDA kernels" in out and "RAMSTREAM_CUDA=ON pip install ." in out
