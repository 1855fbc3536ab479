"""The planner's disk share of the weights (nvme_weights, planner/disk_weights.py): which streamed
blocks' frozen weights go to disk, the RAM and pinned memory they free, the staging ring, the bytes
read per step and their disk time, checked against hand arithmetic on injected profiles."""

from __future__ import annotations

import pytest

from ramstream.planner import HardwareProfile, ModelShape, PlanError, plan_training
from ramstream.planner.rules import HOST_RAM_SHARE, NVME_WEIGHTS_WINDOW

G = 2**30
CFG = {"model_type": "llama", "hidden_size": 4096, "intermediate_size": 11008, "num_hidden_layers": 32,
       "num_attention_heads": 32, "num_key_value_heads": 32, "vocab_size": 32000}  # fmt: skip
OPTS = dict(optimizer_mode="cpu", moment_dtype="float32")


def lora7b():
    return ModelShape.from_hf_config(CFG, batch=1, seq=512, dtype="bfloat16", lora=16)


def prof(ram_gib, disk=True, read=3.0):
    kw = dict(disk_read_gbps=read, disk_write_gbps=2.0, disk_free=None, disk_dir="/nvme") if disk else {}
    return HardwareProfile(device="cuda:0", vram_total=12 * G, vram_free=12 * G, ram_total=int(ram_gib * G),
                           ram_available=int(ram_gib * G), pin_budget=int(ram_gib * G), h2d_gbps=55.0,
                           d2h_gbps=55.0, duplex_gbps=50.0, adamw_gbps=115.0, matmul_tflops=790.0, **kw)  # fmt: skip


def test_ram_that_fits_keeps_the_weights_in_ram():
    p = plan_training(lora7b(), prof(12), **OPTS)
    assert p.weights["streamed"] and p.weights["disk"] == [] and "disk" not in p.memory


def test_short_ram_puts_the_fewest_back_blocks_frozen_weights_on_disk_by_hand():
    sh = lora7b()
    free = plan_training(sh, prof(64), **OPTS)  # the same plan with room: RAM without the disk
    ss = free.weights["streamed"]
    need = free.memory["ram"]["total"] - int(HOST_RAM_SHARE * 5 * G)
    assert need > 0
    f = [sh.blocks[i].frozen_bytes for i in ss]
    assert len(set(f)) == 1  # identical blocks: F bytes of frozen weights each
    F = f[0]
    k = next(k for k in range(1, len(ss) + 1) if k * F - min(k, NVME_WEIGHTS_WINDOW) * F >= need)
    p = plan_training(sh, prof(5), **OPTS)
    assert p.weights["streamed"] == ss and p.weights["disk"] == ss[-k:]
    m = p.memory
    assert m["ram"]["streamed_weights"] == free.memory["ram"]["streamed_weights"] - k * F
    assert m["ram"]["weight_staging"] == m["pinned"]["weight_staging"] == NVME_WEIGHTS_WINDOW * F
    assert (
        m["ram"]["total"]
        == free.memory["ram"]["total"] - k * F + NVME_WEIGHTS_WINDOW * F
        <= m["ram"]["budget"]
    )
    assert p.optimizer["nvme_share"] == 0.0 and m["disk"]["optimizer_state"] == 0  # weights first
    # each disk block read in the forward and again in the backward, but the last 3 streamed (kept)
    reads = F * (2 * k - min(k, NVME_WEIGHTS_WINDOW))
    assert (
        m["disk"]["weights"] == k * F
        and m["disk"]["weights_read_per_step"] == reads == m["disk"]["read_per_step"]
    )
    assert m["disk"]["written_per_step"] == 0
    assert p.bounds["disk_s"] == pytest.approx(reads / 3e9, rel=1e-12)
    assert p.bounds["disk_weights_read_s"] == pytest.approx(reads / 3e9, rel=1e-12)
    assert p.predicted["step_s"] >= free.predicted["step_s"] + F / 3e9 * (1 - 1e-9)  # the first read shows
    text = p.explain()
    assert "frozen weights on disk" in text and "GB read per step, none written" in text
    assert any("as RAM needs" in r and "read only (no write wear)" in r for r in p.reasons)


def test_explicit_values_and_the_options_off():
    sh = lora7b()
    ss = plan_training(sh, prof(64), **OPTS).weights["streamed"]
    assert plan_training(sh, prof(64), nvme_weights=True, **OPTS).weights["disk"] == ss
    assert plan_training(sh, prof(64), nvme_weights=2, **OPTS).weights["disk"] == ss[-2:]
    assert plan_training(sh, prof(64), nvme_weights=[0, 1, 31], **OPTS).weights["disk"] == [0, 1]
    # without a disk in the profile "auto" puts nothing there, nor with both options off (the plan
    # finds another way: fewer streamed blocks, or refuses)
    for p in (prof(5, disk=False), prof(5)):
        kw = {} if p.disk_read_gbps is None else dict(nvme_weights=False, nvme_offload=False)
        try:
            plan = plan_training(sh, p, **OPTS, **kw)
        except PlanError:
            continue
        assert plan.weights["disk"] == [] and "disk" not in plan.memory
    with pytest.raises(ValueError, match="nvme_weights='x' is not accepted"):
        plan_training(sh, prof(5), nvme_weights="x", **OPTS)


def test_cli_shows_the_weights_on_disk_and_refuses_a_bad_flag(tmp_path, monkeypatch, capsys):
    import json

    from ramstream.cli import main

    monkeypatch.setenv("RAMSTREAM_CACHE_DIR", str(tmp_path / "empty-cache"))
    (tmp_path / "config.json").write_text(json.dumps(CFG))
    args = ["plan", "--config", str(tmp_path / "config.json"), "--lora", "16", "--seq", "512", "--vram-gb", "12",
            "--ram-gb", "4", "--nvme-gbps", "3,2"]  # fmt: skip
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "frozen weights on disk:" in out and "none written" in out and "read only (no write wear)" in out
    assert main(args + ["--nvme-weights", "x"]) == 2
    assert "--nvme-weights 'x' is not accepted" in capsys.readouterr().err


def test_no_plan_fitting_with_weights_and_state_on_disk_lists_both_by_hand():
    """nvme "auto" with a disk too small: the frozen weights of the streamed blocks and the whole
    host-updated optimizer state go to disk and still nothing fits; the error's disk line and
    arithmetic list both, their blocks and their sum against the disk's budget."""
    import dataclasses

    from ramstream.planner.rules import DISK_FREE_SHARE

    sh = ModelShape.from_hf_config(CFG, batch=1, seq=512, dtype="bfloat16", lora=256)
    free = 4 * G
    with pytest.raises(PlanError) as e:
        plan_training(sh, dataclasses.replace(prof(8), disk_free=free), **OPTS)
    a = e.value.arithmetic["disk"]
    blocks = a["weight_blocks"]
    F = sh.blocks[0].frozen_bytes
    assert all(b.frozen_bytes == F for b in sh.blocks) and blocks == list(range(len(blocks))) and blocks
    assert a["weights"] == len(blocks) * F  # every streamed block's frozen weights, from the back
    host = sh.trained_numel * (4 + 2 * 4)  # fp32 master + two fp32 moments per trained parameter
    share = a["optimizer_state"] / host
    assert 0 < a["optimizer_state"] <= host and a["total"] == a["weights"] + a["optimizer_state"]
    budget = int(free * DISK_FREE_SHARE)
    assert a["budget"] == budget < a["total"] and a["free"] == free
    msg = str(e.value)
    assert (
        f"  disk: needs {a['total'] / G:.2f} GiB: {a['optimizer_state'] / G:.2f} GiB ({share:.1%} of the "
        f"host-updated optimizer state {host / G:.2f} GiB) + {a['weights'] / G:.2f} GiB of frozen weights "
        f"(blocks 0-{blocks[-1]}, nvme_weights) vs {budget / G:.2f} GiB allowed (90% of 4.00 GiB free): too small"
    ) in msg
    # the same plan with the weights kept in RAM: the line has the state alone, as before
    with pytest.raises(PlanError) as e:
        plan_training(sh, dataclasses.replace(prof(8), disk_free=free), nvme_weights=False, **OPTS)
    assert "frozen weights" not in str(e.value) and e.value.arithmetic["disk"]["weights"] == 0
