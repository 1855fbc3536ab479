"""wrap()'s host-RAM arithmetic (planner/host_fit.py): moment_dtype="auto" and the MemoryError that shows
each component, from injected RAM figures; and through wrap() with a patched available RAM."""

from __future__ import annotations

import pytest
import torch

import ramstream
from ramstream.planner.host_fit import pick_moment_dtype

GIB = 2**30
N = 1_000_000_000  # trained elements


def _pick(option, avail, streamed=0, check=True, accumulate=False, log=None):
    lines = [] if log is None else log
    out = pick_moment_dtype(
        option,
        numel=N,
        working_bytes=2,
        accumulate=accumulate,
        streamed=streamed,
        check=check,
        log=lines.append,
        ram={"available": avail, "cgroup_limit": None},
    )
    return out, lines


def test_auto_takes_fp32_when_it_fits_and_bf16_when_only_that_does():
    fp32 = N * (4 + 8 + 2)  # master, two fp32 moments, bf16 landing buffer
    bf16 = N * (4 + 4 + 2)
    assert _pick("auto", int(fp32 / 0.9) + 1)[0] == torch.float32
    dtype, log = _pick("auto", int(bf16 / 0.9) + 1)
    assert dtype == torch.bfloat16 and "moment_dtype=auto -> bfloat16" in log[0]


def test_streamed_weights_count_in_the_host_budget():
    bf16 = N * (4 + 4 + 2)
    streamed = 20 * GIB
    avail = int((bf16 + streamed) / 0.9) - 1  # one byte short
    with pytest.raises(MemoryError) as e:
        _pick("auto", avail, streamed=streamed)
    msg = str(e.value)
    assert f"streamed weights {streamed / GIB:.2f}" in msg
    assert f"fp32 master {N * 4 / GIB:.2f}" in msg and f"moments {N * 4 / GIB:.2f}" in msg
    assert f"= {(bf16 + streamed) / GIB:.2f} GiB" in msg
    assert "quantize='int8' or 'nf4'" in msg


def test_explicit_fp32_that_does_not_fit_names_bf16_and_its_bytes():
    bf16 = N * (4 + 4 + 2 + 4)  # with the accumulator
    with pytest.raises(MemoryError, match=r"moment_dtype='bfloat16' \(needs .* = %.2f GiB\)" % (bf16 / GIB)):
        _pick("float32", int(N * 18 / 0.9) - 1, accumulate=True)


def test_check_memory_false_goes_on_and_logs_the_arithmetic():
    dtype, log = _pick("float32", GIB, check=False)
    assert dtype == torch.float32 and "check_memory=False" in log[-1]


def test_wrap_refuses_with_the_arithmetic_and_check_memory_false_trains(monkeypatch):
    from ramstream.planner import profile

    monkeypatch.setattr(profile, "available_ram", lambda *a: {"available": 1 << 20, "cgroup_limit": 1 << 21})
    m = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.Linear(256, 256))
    with pytest.raises(MemoryError, match=r"cgroup limit 0\.00 GiB"):
        ramstream.wrap(m, device="cpu")
    assert getattr(m, "_ramstream", None) is None
    model, opt = ramstream.wrap(m, device="cpu", check_memory=False)
    model(torch.randn(4, 256)).sum().backward()
    opt.step()
    opt.synchronize()
    assert any("check_memory=False" in e for e in ramstream.memory_report(model)["events"])


def test_the_hardware_profile_seeds_the_optimizer_split_rates(monkeypatch):
    """profile=True on a GPU: the profile's rates (here injected) become optimizer_mode="auto"'s
    host AdamW and PCIe rates (params/s = GB/s of fp32 state / 28 B), and its figures the plan's."""
    import importlib

    from ramstream import planner
    from ramstream.engine import rates as split

    wrap = importlib.import_module("ramstream.wrap")  # the module (ramstream.wrap is the function)
    from ramstream.options import WrapOptions

    prof = planner.HardwareProfile(
        device="cuda:0", h2d_gbps=50.0, d2h_gbps=51.0, adamw_gbps=112.0, source="given"
    )
    monkeypatch.setattr(planner, "profile_hardware", lambda device=None, **k: prof)
    monkeypatch.setattr(split, "_MEASURED", {})
    lines: list[str] = []
    dev = torch.device("cuda", 0)
    out = wrap._use_profile(WrapOptions.parse(), dev, lines.append)
    assert out == prof.to_dict()
    assert split._MEASURED["cuda:0"] == {"host_params_per_s": 112e9 / 28, "pcie_bytes_per_s": 50e9}
    assert "H2D 50.0 GB/s" in lines[0]
    assert wrap._use_profile(WrapOptions.parse(profile=False), dev, lines.append) is None

    def broken(device=None, **k):
        raise RuntimeError("no GPU here")

    monkeypatch.setattr(planner, "profile_hardware", broken)
    assert wrap._use_profile(WrapOptions.parse(), dev, lines.append) is None
    assert "measures in-process" in lines[-1]
