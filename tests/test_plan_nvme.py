"""The planner's disk tier (issue 29): nvme_offload's share of the host-updated optimizer state,
checked against float64 hand arithmetic on injected profiles; its step term; the PlanError and
suggestion texts; `ramstream plan --nvme-*`; old profiles without the disk fields."""

from __future__ import annotations

import json
import math
from dataclasses import replace

import pytest

import ramstream
from ramstream.cli import main
from ramstream.planner import HardwareProfile, ModelShape, PlanError, measure, plan_training
from ramstream.planner import profile as prof_mod
from ramstream.planner.policy import BUCKET_BYTES
from ramstream.planner.rules import DISK_FREE_SHARE, NVME_RAM_MARGIN
from ramstream.planner.rules import HOST_RAM_SHARE as SHARE

G = 2**30
V, D = 50304, 2048
P = 32 * (12 * D * D + 13 * D) + 2 * V * D + 1024 * D + 2 * D  # the 1.8B GPT's parameters
# optimizer_mode="cpu": no VRAM share, nothing mapped, no refinement: every parameter is updated on
# the host, so host RAM is exactly master 4 + fp32 moments 8 + fp32 gradient landing 4 B/param
# (tests/test_planner_plan.py test_bf16_moments_by_hand_and_the_error_without_them)
OPTS = dict(optimizer_mode="cpu", moment_dtype="float32")


def prof(vram_gib=24, ram_gib=15.0, **kw):
    base = dict(device="cuda:0", vram_total=int(vram_gib * G), vram_free=int(vram_gib * G), ram_total=int(ram_gib * G),
                ram_available=int(ram_gib * G), pin_budget=int(ram_gib * G) // 2, h2d_gbps=55.0, d2h_gbps=55.0,
                duplex_gbps=50.0, adamw_gbps=115.0, matmul_tflops=790.0)  # fmt: skip
    base.update(kw)
    return HardwareProfile(**base)


def disk(read=3.0, write=2.0, free=None, **kw):
    return prof(disk_read_gbps=read, disk_write_gbps=write, disk_free=free, disk_dir="/nvme", **kw)


def gpt18():
    return ModelShape.gpt("1.8b", batch=1, seq=1024, dtype="fp32")


def hand_share(ram_gib=15.0):
    """The smallest share, float64: RAM 16 P + the margin - the budget freed from 12 P of state."""
    budget = int(SHARE * ram_gib * G)
    share = (16.0 * P + NVME_RAM_MARGIN - budget) / (12.0 * P)
    return share, math.ceil(share * 12 * P), budget


def test_ram_that_fits_keeps_nothing_on_disk_and_the_plan_unchanged():
    big = prof(ram_gib=64)
    assert 16 * P < SHARE * 64 * G
    base = plan_training(gpt18(), big, **OPTS)
    assert base.optimizer["nvme_share"] == 0.0 and "disk" not in base.memory and "disk_s" not in base.bounds
    assert plan_training(gpt18(), big, nvme_offload=False, **OPTS).to_dict() == base.to_dict()
    with_disk = plan_training(gpt18(), replace(big, disk_read_gbps=3.0, disk_write_gbps=2.0), **OPTS)
    a, b = with_disk.to_dict(), base.to_dict()
    extra = a.pop("reasons")[len(b["reasons"]) :]
    b.pop("reasons")
    assert a == b and extra == ["disk: none of the optimizer state on disk (nvme_offload='auto': RAM fits)"]


def test_ram_twice_too_small_puts_the_smallest_share_on_disk():
    share, d, budget = hand_share()
    assert 16 * P > 1.9 * budget and 0 < share < 1  # RAM about 2x too small
    p = plan_training(gpt18(), disk(), **OPTS)
    assert p.optimizer["nvme_share"] == pytest.approx(share, rel=1e-12)
    m = p.memory
    assert m["disk"]["optimizer_state"] == d and m["disk"]["written_per_step"] == d
    assert m["ram"]["optimizer_state"] == 12 * P - d and m["ram"]["disk_staging"] == NVME_RAM_MARGIN
    assert m["ram"]["gradient_landing"] == 4 * P  # landing stays in RAM
    assert m["ram"]["total"] == 16 * P - d + NVME_RAM_MARGIN <= budget == m["ram"]["budget"]
    assert m["disk"]["ram_saved"] == d
    # a smaller share does not fit
    with pytest.raises(PlanError) as e:
        plan_training(gpt18(), disk(), nvme_offload=share - 1e-7, **OPTS)
    assert sum(v for k, v in e.value.arithmetic["ram"].items() if k != "budget") > budget
    # the same share given as a number is the same plan
    assert plan_training(gpt18(), disk(), nvme_offload=p.optimizer["nvme_share"], **OPTS).memory == m
    text = p.explain()
    (line,) = [r for r in p.reasons if r.startswith("disk:")]
    assert f"{share:.1%} of the host-updated optimizer state" in line and f"{d / G:.2f} GiB" in line
    assert f"{d / 1e9:.1f} GB written per step (SSD wear)" in line and "read 3 GB/s + write 2 GB/s" in line
    assert f"  disk: {d / G:.2f} GiB of the optimizer state" in text and "disk " in text.split("step:")[1]


def test_auto_moments_try_bf16_first_with_the_disk():
    # bf16 moments alone (12 P) do not fit either; with the disk bf16 needs the fewer bytes
    budget = int(SHARE * 15 * G)
    assert 12 * P > budget
    p = plan_training(gpt18(), disk(), optimizer_mode="cpu")
    assert p.optimizer["moment_dtype"] == "bfloat16"
    share = (12.0 * P + NVME_RAM_MARGIN - budget) / (8.0 * P)  # master 4 + bf16 moments 4
    assert p.optimizer["nvme_share"] == pytest.approx(share, rel=1e-12)


def test_true_puts_all_of_it_on_disk_and_false_none():
    p = plan_training(gpt18(), disk(), nvme_offload=True, **OPTS)
    assert p.optimizer["nvme_share"] == 1.0 and p.memory["disk"]["optimizer_state"] == 12 * P
    assert p.memory["ram"]["optimizer_state"] == 0
    with pytest.raises(PlanError) as e:
        plan_training(gpt18(), disk(), nvme_offload=False, **OPTS)
    assert "disk" not in e.value.arithmetic


def test_a_disk_too_small_is_not_chosen_and_the_error_names_its_bytes():
    share, d, _ = hand_share()
    free = int(d / DISK_FREE_SHARE) - G
    with pytest.raises(PlanError) as e:
        plan_training(gpt18(), disk(free=free), **OPTS)
    a = e.value.arithmetic["disk"]
    assert a["optimizer_state"] == d and a["budget"] == int(free * DISK_FREE_SHARE) and a["free"] == free
    msg = str(e.value)
    assert f"disk: needs {d / G:.2f} GiB ({share:.1%} of the host-updated optimizer state" in msg
    assert f"vs {int(free * DISK_FREE_SHARE) / G:.2f} GiB allowed" in msg and "too small" in msg
    # ... and the suggestion names the free space it would take
    assert (
        f"nvme_dir= on a disk with {d / DISK_FREE_SHARE / G:.2f} GiB free (this one: {free / G:.2f} GiB)"
        in msg
    )
    ok = plan_training(gpt18(), disk(free=int(d / DISK_FREE_SHARE) + G), **OPTS)
    assert ok.memory["disk"]["budget"] >= d and ok.memory["disk"]["free"] == int(d / DISK_FREE_SHARE) + G


def test_without_a_disk_the_suggestion_names_nvme_dir_and_its_bytes():
    _, d, _ = hand_share()
    with pytest.raises(PlanError) as e:
        plan_training(gpt18(), prof(), **OPTS)
    msg = str(e.value)
    assert "disk" not in e.value.arithmetic
    assert f"nvme_dir= on a disk with {d / DISK_FREE_SHARE / G:.2f} GiB free for" in msg
    assert f"{d / 1e9:.1f} GB read and written per step" in msg and "the disk's time" in msg
    assert any(o.startswith("nvme_dir=") for o in e.value.options)


@pytest.mark.parametrize("r, w", [(3.0, 2.0), (6.0, 4.0), (1.5, 7.0)])
def test_the_step_grows_by_the_disk_bytes_over_its_rates(r, w):
    share, d, _ = hand_share()
    big = prof(ram_gib=64)  # the same candidate with and without the share: only the disk differs
    base = plan_training(gpt18(), big, **OPTS).bounds
    b = plan_training(gpt18(), replace(big, disk_read_gbps=r, disk_write_gbps=w), nvme_offload=share, **OPTS)
    disk_s = d / (r * 1e9) + d / (w * 1e9)
    edge = min(d, BUCKET_BYTES // 4 * 12) * (1 / (r * 1e9) + 1 / (w * 1e9))  # first read, last write
    assert b.bounds["disk_s"] == pytest.approx(disk_s, rel=1e-12)
    lane = base["host_lane_s"] + max(0.0, disk_s - base["host_adamw_s"]) + edge
    assert b.bounds["host_lane_s"] == pytest.approx(lane, rel=1e-12)
    assert disk_s > base["host_adamw_s"] and lane > base["gpu_lane_s"]  # the disk bounds these steps
    assert b.predicted["step_s"] == pytest.approx(lane + base["activation_copy_s"], rel=1e-12)
    assert b.predicted["bound"] == "disk"
    assert {k: v for k, v in b.bounds.items() if k not in ("disk_s", "host_lane_s", "exposed_s")} == {
        k: v for k, v in base.items() if k not in ("host_lane_s", "exposed_s")
    }


def test_a_cpu_profile_puts_moments_on_disk_too():
    cpu = HardwareProfile(ram_available=26 * G, ram_total=26 * G, adamw_gbps=10.0)
    with pytest.raises(PlanError):
        plan_training(gpt18(), cpu)
    p = plan_training(gpt18(), replace(cpu, disk_read_gbps=2.0, disk_write_gbps=2.0), moment_dtype="float32")
    assert p.mode == "cpu" and 0 < p.optimizer["nvme_share"] <= 1
    assert p.memory["ram"]["total"] <= p.memory["ram"]["budget"]
    # an fp32 model's weights are its masters: the state on disk is moments only, 8 B/param
    assert p.memory["disk"]["optimizer_state"] == math.ceil(p.optimizer["nvme_share"] * 8 * P)


@pytest.mark.parametrize("value", ["yes", 1.5, -0.1, float("nan"), None, [0.5]])
def test_nvme_offload_errors_name_the_argument_and_the_values(value):
    with pytest.raises(
        ValueError, match=r"nvme_offload=.* accepted: 'auto', True, False or a share in \[0, 1\]"
    ):
        plan_training(gpt18(), disk(), nvme_offload=value)


def test_bad_disk_fields_are_named():
    with pytest.raises(ValueError, match="profile.disk_read_gbps=-1"):
        plan_training(gpt18(), disk(read=-1))


# ---- profiles ----------------------------------------------------------------------------------


def test_an_old_profile_without_disk_fields_loads(monkeypatch, tmp_path):
    old = {k: v for k, v in prof().to_dict().items() if not k.startswith("disk_")}
    p = HardwareProfile.from_dict(json.loads(json.dumps(old)))
    assert (
        p.disk_read_gbps is None and p.disk_write_gbps is None and p.disk_free is None and p.disk_dir is None
    )
    assert plan_training(gpt18(), replace(p, ram_available=64 * G)).optimizer["nvme_share"] == 0.0
    # a cache file as the older versions wrote it ({"key", "rates"}) is read, not measured again
    calls = []
    rates = {
        "h2d_gbps": 12.5,
        "d2h_gbps": 11.0,
        "duplex_gbps": 9.5,
        "adamw_gbps": 30.0,
        "matmul_tflops": None,
    }
    monkeypatch.setenv("RAMSTREAM_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(prof_mod, "measure_rates", lambda device, quick=True: calls.append(1) or dict(rates))
    ramstream.profile_hardware("cpu")
    (f,) = tmp_path.glob("profile-*.json")
    assert set(json.loads(f.read_text())) == {"key", "rates"}
    again = ramstream.profile_hardware("cpu")
    assert again.source == "cache" and len(calls) == 1 and again.disk_read_gbps is None


def test_profile_hardware_measures_the_disk_only_when_asked(monkeypatch, tmp_path):
    monkeypatch.setenv("RAMSTREAM_CACHE_DIR", str(tmp_path / "cache"))
    rates = {
        "h2d_gbps": 12.5,
        "d2h_gbps": 11.0,
        "duplex_gbps": 9.5,
        "adamw_gbps": 30.0,
        "matmul_tflops": None,
    }
    monkeypatch.setattr(prof_mod, "measure_rates", lambda device, quick=True: dict(rates))
    seen = []

    def fake_measure_disk(directory, size):
        seen.append((directory, size))
        return {"read_gbps": 3.5, "write_gbps": 2.5, "direct": True, "bytes": size, "alignment": 4096}

    import ramstream.disk.store as store

    monkeypatch.setattr(store, "measure_disk", fake_measure_disk)
    assert ramstream.profile_hardware("cpu").disk_read_gbps is None and seen == []
    p = ramstream.profile_hardware("cpu", nvme_dir=str(tmp_path))
    assert seen == [(str(tmp_path), 256 << 20)]
    assert (p.disk_read_gbps, p.disk_write_gbps, p.disk_dir) == (3.5, 2.5, str(tmp_path))
    assert isinstance(p.disk_free, int) and p.disk_free > 0
    assert measure.disk_rates(tmp_path, quick=False)["disk_free"] > 0 and seen[-1][1] == 1 << 30
    with pytest.raises(TypeError, match="nvme_dir must be None or a folder path"):
        ramstream.profile_hardware("cpu", nvme_dir=3)


# ---- ramstream plan ----------------------------------------------------------------------------


@pytest.fixture
def no_cache(monkeypatch, tmp_path):
    monkeypatch.setenv("RAMSTREAM_CACHE_DIR", str(tmp_path / "empty-cache"))


# the 6.85B GPT in bf16 on a 24 GiB GPU: 48 GiB of RAM is too little even with bf16 moments, 100 fit
ARGS = [
    "plan",
    "--gpt",
    "6.85b",
    "--vram-gb",
    "24",
    "--batch",
    "8",
    "--seq",
    "512",
    "--chunked-loss",
    "--ram-gb",
    "48",
]


def test_cli_nvme_gbps_shows_the_disk_choice(capsys, no_cache):
    assert main(ARGS + ["--nvme-gbps", "3,2"]) == 0
    out = capsys.readouterr().out
    assert "\n  disk: " in out and "GB written per step (SSD wear)" in out and "bound by disk" in out
    assert "disk: rates given, free space assumed enough" in out and "disk read 3 GB/s, write 2" in out
    assert main(ARGS + ["--nvme-gbps", "3,2", "--json"]) == 0
    j = json.loads(capsys.readouterr().out)
    assert j["fits"] and 0 < j["plan"]["optimizer"]["nvme_share"] < 1
    d = j["plan"]["memory"]["disk"]
    assert d["optimizer_state"] > 0 and d["budget"] is None and j["plan"]["bounds"]["disk_s"] > 0
    assert j["profile"]["disk_read_gbps"] == 3.0 and j["profile"]["disk_write_gbps"] == 2.0
    assert main(ARGS + ["--nvme-gbps", "3", "--nvme-free-gb", "1", "--json"]) == 2
    j = json.loads(capsys.readouterr().out)
    assert not j["fits"] and j["arithmetic"]["disk"]["budget"] == int(0.9 * G)


def test_cli_without_disk_options_suggests_nvme_dir(capsys, no_cache):
    assert main(ARGS + ["--json"]) == 2
    j = json.loads(capsys.readouterr().out)
    assert "disk" not in j["sources"] and j["profile"]["disk_read_gbps"] is None
    assert any(o.startswith("nvme_dir= on a disk with") for o in j["options"])
    assert main(ARGS[:-1] + ["100"]) == 0
    out = capsys.readouterr().out
    assert "disk" not in out  # RAM fits: no disk line, term or rate


@pytest.mark.parametrize(
    "extra, says",
    [
        (["--nvme-gbps", "fast"], "--nvme-gbps 'fast' is not accepted; accepted: READ or READ,WRITE"),
        (["--nvme-gbps", "3,0"], "--nvme-gbps '3,0' is not accepted"),
        (["--nvme-offload", "maybe"], "--nvme-offload 'maybe' is not accepted; accepted: auto, true, false"),
        (["--nvme-free-gb", "5"], "--nvme-free-gb needs --nvme-gbps READ[,WRITE] or --nvme-dir PATH"),
        (["--nvme-gbps", "3", "--nvme-free-gb", "-1"], "--nvme-free-gb must be a finite number >= 0"),
    ],
)
def test_cli_bad_disk_options_exit_2_naming_the_flag(capsys, no_cache, extra, says):
    assert main(ARGS + extra) == 2
    assert says in capsys.readouterr().err


def test_cli_nvme_offload_values(capsys, no_cache):
    for value, share in (("true", 1.0), ("0.9", 0.9)):
        assert main(ARGS + ["--nvme-gbps", "3", "--nvme-offload", value, "--json"]) == 0
        assert json.loads(capsys.readouterr().out)["plan"]["optimizer"]["nvme_share"] == share
    assert main(ARGS + ["--nvme-gbps", "3", "--nvme-offload", "false"]) == 2
