"""wrap() on CUDA turns on the caching allocator's expandable segments once per process, unless the
user configured the allocator (runtime/allocator.py). The decision is tested on the CPU with the
allocator's settings call replaced by a recorder; the cuda test checks a real segment."""

from __future__ import annotations

import os
import subprocess
import sys
import warnings

import pytest
import torch

from ramstream.runtime import allocator


@pytest.fixture
def fresh(monkeypatch):
    calls = []
    monkeypatch.setattr(allocator, "_done", [])
    monkeypatch.setattr(torch.cuda.memory, "_set_allocator_settings", calls.append, raising=False)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: calls.append("empty_cache"))
    for v in allocator.USER_VARS + ("RAMSTREAM_EXPANDABLE_SEGMENTS",):
        monkeypatch.delenv(v, raising=False)
    return calls


CUDA = torch.device("cuda:0")


def test_on_by_default_once_per_process_and_logged_once(fresh):
    log = []
    assert allocator.use_expandable_segments(CUDA, log.append) is True
    assert fresh == ["expandable_segments:True", "empty_cache"]
    assert len(log) == 1 and "expandable segments on" in log[0]
    assert allocator.use_expandable_segments(CUDA, log.append) is True
    assert fresh == ["expandable_segments:True", "empty_cache"] and len(log) == 1


@pytest.mark.parametrize("var", allocator.USER_VARS)
def test_a_user_setting_of_the_allocator_is_left_alone(fresh, monkeypatch, var):
    monkeypatch.setenv(var, "max_split_size_mb:256")
    log = []
    assert allocator.use_expandable_segments(CUDA, log.append) is False
    assert fresh == [] and var in log[0] and "left as configured" in log[0]


def test_switched_off_by_the_variable(fresh, monkeypatch):
    monkeypatch.setenv("RAMSTREAM_EXPANDABLE_SEGMENTS", "0")
    log = []
    assert allocator.use_expandable_segments(CUDA, log.append) is False
    assert fresh == [] and "RAMSTREAM_EXPANDABLE_SEGMENTS=0" in log[0]


def test_a_bad_value_warns_and_the_default_applies(fresh, monkeypatch):
    monkeypatch.setenv("RAMSTREAM_EXPANDABLE_SEGMENTS", "yes")
    with pytest.warns(RuntimeWarning, match="RAMSTREAM_EXPANDABLE_SEGMENTS='yes' is not accepted"):
        assert allocator.use_expandable_segments(CUDA, [].append) is True
    assert fresh[0] == "expandable_segments:True"


def test_torchs_deprecation_warning_of_the_call_is_not_passed_on(fresh, monkeypatch):
    def deprecated(value):
        warnings.warn("torch.cuda._set_allocator_settings is deprecated", FutureWarning, stacklevel=2)
        fresh.append(value)

    monkeypatch.setattr(torch.cuda.memory, "_set_allocator_settings", deprecated)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert allocator.use_expandable_segments(CUDA, [].append) is True
    assert fresh[0] == "expandable_segments:True"


def test_a_torch_that_refuses_changes_nothing_and_says_why(fresh, monkeypatch):
    def refuse(_):
        raise RuntimeError("not supported on this platform")

    monkeypatch.setattr(torch.cuda.memory, "_set_allocator_settings", refuse)
    log = []
    assert allocator.use_expandable_segments(CUDA, log.append) is False
    assert "not supported on this platform" in log[0] and "empty_cache" not in fresh


def test_nothing_for_the_cpu(fresh):
    log = []
    assert allocator.use_expandable_segments(torch.device("cpu"), log.append) is False
    assert fresh == [] and log == [] and allocator._done == []


_CHILD = """
import torch, ramstream
m = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 64))
m, opt = ramstream.wrap(m, torch.optim.AdamW(m.parameters()), device="cuda:0")
x = torch.empty(64 << 20, dtype=torch.uint8, device="cuda:0")
segs = [s for s in torch.cuda.memory._snapshot()["segments"] if s["total_size"] >= x.numel()]
print("EXPANDABLE", any(s.get("is_expandable") for s in segs))
print("LOGGED", any("expandable segments on" in e for e in ramstream.memory_report(m)["events"]))
"""


@pytest.mark.cuda
def test_on_the_gpu_wrap_makes_later_segments_expandable():
    e = {k: v for k, v in os.environ.items() if k not in allocator.USER_VARS}
    r = subprocess.run([sys.executable, "-c", _CHILD], capture_output=True, text=True, timeout=200, env=e)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "EXPANDABLE True" in r.stdout and "LOGGED True" in r.stdout, r.stdout
