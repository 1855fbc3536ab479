"""nvme_offload="auto" end to end (issue 29): the planner's share of the host optimizer state on disk
(plan.optimizer["nvme_share"], planner/disk.py) is what wrap() applies (engine/disk_tier.py), and
the run equals torch's fused AdamW bit for bit; wrap()'s profile takes the folder's measured disk
(runtime/apply.py with_disk). CPU engine, plans made on injected GPU profiles."""

from __future__ import annotations

from dataclasses import replace

import torch

import ramstream
from ramstream.options import WrapOptions
from ramstream.planner.rules import HOST_RAM_SHARE
from ramstream.runtime.apply import with_disk
from ramstream.runtime.inspect import plan_for

from _models import batches, clone, gpu_profile, make_model, train_torch

LR = 3e-3
MARGIN = 1 << 16  # rules.NVME_RAM_MARGIN (1 GiB of staging room) scaled to this tiny model
OPTS = dict(batch=2, seq=8, optimizer_mode="cpu", moment_dtype="float32")


def _short_of_ram(ref, share_wanted: float):
    """A profile whose RAM holds the plan only with about `share_wanted` of the state on disk."""
    prof = gpu_profile(64)
    base = plan_for(ref, profile=prof, **OPTS)
    ram, state = base.memory["ram"]["total"], base.memory["ram"]["optimizer_state"]
    budget = ram + MARGIN - share_wanted * state
    avail = int(budget / HOST_RAM_SHARE)
    return replace(
        prof, ram_total=avail, ram_available=avail, disk_read_gbps=2.0, disk_write_gbps=1.0,
        disk_free=64 << 30, disk_dir="/nvme",
    ), state  # fmt: skip


def test_wrap_applies_the_plans_disk_share_and_trains_as_torch(tmp_path, monkeypatch):
    monkeypatch.setattr("ramstream.planner.disk.NVME_RAM_MARGIN", MARGIN)
    ref = make_model(0, n_blocks=6, d=64)
    prof, state = _short_of_ram(ref, 0.5)
    plan = plan_for(ref, profile=prof, **OPTS)
    share = plan.optimizer["nvme_share"]
    assert 0.4 < share < 0.6 and plan.memory["disk"]["optimizer_state"] > 0
    model = clone(ref)
    model, opt = ramstream.wrap(
        model, torch.optim.AdamW(model.parameters(), lr=LR), device="cpu", plan=plan, nvme_dir=str(tmp_path),
        optimizer_mode="cpu", bucket_bytes=1 << 16,
    )  # fmt: skip
    engine = opt._engine
    assert engine.disk is not None
    on_disk = opt.stats()["nvme_state_bytes"]
    # whole buckets from the back of the stack: within one bucket's state of the planned share
    assert abs(on_disk - share * state) <= 12 * (1 << 16) // 4 + 4096
    data = batches(4, b=2, t=8, seed=2)
    torch_model = clone(ref)
    want = train_torch(torch_model, torch.optim.AdamW(torch_model.parameters(), lr=LR, fused=True), data)
    assert train_torch(model, opt, data) == want
    for p, q in zip(torch_model.parameters(), model.parameters()):
        assert torch.equal(p.detach(), q.detach())
    opt.close()
    assert list(tmp_path.iterdir()) == []  # the scratch file is gone


def test_without_a_folder_or_with_ram_to_spare_nothing_goes_to_disk(tmp_path):
    ref = make_model(0, n_blocks=4, d=64)
    plan = plan_for(ref, profile=gpu_profile(64), **OPTS)  # RAM to spare, no disk known
    assert plan.optimizer["nvme_share"] == 0.0
    model = clone(ref)
    _, opt = ramstream.wrap(
        model, torch.optim.AdamW(model.parameters(), lr=LR), device="cpu", plan=plan, nvme_dir=str(tmp_path),
        optimizer_mode="cpu",
    )  # fmt: skip
    assert opt._engine.disk is None
    opt.close()


def test_wraps_profile_measures_the_folder_only_for_auto(tmp_path):
    logs: list[str] = []
    prof = gpu_profile(64)
    opts = WrapOptions.parse(nvme_dir=str(tmp_path))
    got = with_disk(prof, opts, logs.append)
    assert got.disk_dir == str(tmp_path.resolve()) and got.disk_read_gbps > 0 and got.disk_write_gbps > 0
    assert got.disk_free > 0 and any("GB/s" in line for line in logs)
    assert list(tmp_path.iterdir()) == []  # the measurement's scratch file removed
    off = WrapOptions.parse(nvme_dir=str(tmp_path), nvme_offload=False, nvme_weights=False)
    assert with_disk(prof, off, print) is prof
    # nvme_weights="auto" alone (the frozen weights' disk share) measures the folder too
    weights_only = WrapOptions.parse(nvme_dir=str(tmp_path), nvme_offload=False)
    assert with_disk(prof, weights_only, print).disk_read_gbps > 0
    assert with_disk(prof, WrapOptions.parse(), print) is prof  # no folder (RAMSTREAM_NVME_DIR unset)
    missing = WrapOptions.parse(nvme_dir=str(tmp_path / "missing"))
    logs.clear()
    assert with_disk(prof, missing, logs.append) is prof
    assert "could not be measured" in logs[0] and "missing" in logs[0]
