"""A disk store opened between steps (issue 29): wrap(nvme_dir=..., nvme_weights="auto") on a run
whose plan needed no disk at wrap() opens no store; a larger step's re-plan that streams more blocks
whose pinned homes RAM cannot hold (planner/disk_weights.py, applied = (no block on disk, the
streamed blocks placed)) puts their frozen weights on disk, and the runtime opens the store then
(runtime/disk_weights.py open_mid_run): the file created 0600 in the folder, removed by unwrap().
The run equals torch's fused AdamW bit for bit (CPU engine, fp32); a folder that became unwritable
is an OSError naming it with the run exactly as before; without a folder the step is refused as
before; a disk too small for the blocks is a refusal with the arithmetic."""

from __future__ import annotations

import dataclasses
import errno
import os
import stat

import pytest
import torch

import ramstream
from ramstream.planner.replan import replan_stream
from ramstream.planner.result import PlanError
from ramstream.planner.rules import DISK_FREE_SHARE, NVME_WEIGHTS_WINDOW
from ramstream.runtime.apply import check_steps
from ramstream.runtime.inspect import model_shape, plan_for
from ramstream.runtime.tokens import PlanOutOfMemoryError
from test_restream_disk import wrapped as wrapped_with_check

from _models import batches, clone, gpu_profile, make_model, open_files_in, scratch_folder, train_torch

LR = 3e-3
SMALL, BIG = 2, 24  # batch x seq 8: the plan's step (blocks 0-1 stream), and one that streams 8-11 too
N = 12
NEW = [8, 9, 10, 11]


@pytest.fixture
def folder(tmp_path, monkeypatch):
    yield from scratch_folder(tmp_path, monkeypatch, "rs-rso-")


def lora_like():
    """12 blocks whose fc1 is frozen (a LoRA-like base: 1 MiB of frozen weights per block)."""
    m = make_model(0, n_blocks=N, d=256)
    for b in m.blocks:
        b.fc1.requires_grad_(False)
    return m


def profile(disk_free=None, rates=True):
    """The injected GPU of 32 MiB free and 60 MiB of RAM (54 MiB usable): the plan for 2 x 8 with
    fp32 moments streams blocks 0-1, every block recomputing, every frozen weight in RAM (50.4 MiB);
    the 24 x 8 step streams 8-11 too, whose homes do not fit (54.4 MiB needed), and fits with their
    frozen weights on disk (53.4 MiB; hand-checked in test_the_planner_opens_the_disk_between_steps_by_hand)."""
    ram = 60 << 20
    p = dataclasses.replace(gpu_profile(32), ram_total=ram, ram_available=ram, disk_free=disk_free)
    if rates:
        p = dataclasses.replace(p, disk_read_gbps=3.0, disk_write_gbps=2.0, disk_dir="/nvme")
    return p


def wrapped(ref, prof, folder, option="auto"):
    model, opt, plan = wrapped_with_check(ref, prof, folder, option, moment_dtype="float32")
    assert plan.weights["streamed"] == [0, 1] and not plan.weights.get("disk")
    assert getattr(model._ramstream, "disk_weights", None) is None  # no store at wrap()
    return model, opt


def reference(ref, data):
    m = clone(ref)
    return m, train_torch(
        m, torch.optim.AdamW([p for p in m.parameters() if p.requires_grad], lr=LR, fused=True), data
    )


def scratch_modes(folder: str) -> list[int]:
    """The mode of each file this process holds open in `folder` (unlinked at open: by its fd)."""
    out = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            if os.readlink(f"/proc/self/fd/{fd}").startswith(folder + os.sep):
                out.append(stat.S_IMODE(os.stat(f"/proc/self/fd/{fd}").st_mode))
        except OSError:
            continue
    return out


def unchanged(model, opt, weights: dict) -> None:
    """The run as before the refused step: blocks 0-1 stream, 8-11 keep their buckets and frozen
    weights where they were, no store, no file, the same weights."""
    w = model._ramstream
    assert sorted(b.index for b in w.streamer.blocks) == [0, 1]
    assert not any(
        b.streamed for b in opt._engine.buckets if opt._engine.block_of.get(id(b.slots[0].param)) in NEW
    )
    assert all(t.numel() > 0 for k in NEW for t in model.blocks[k].fc1.parameters())
    assert (
        getattr(w, "disk_weights", None) is None
        and ramstream.memory_report(model)["params"]["nvme_weights"] is None
    )
    for k, v in model.state_dict().items():
        assert torch.equal(v, weights[k]), k


def test_a_step_whose_homes_do_not_fit_opens_the_disk_store_and_trains_as_torch(folder):
    ref = lora_like()
    model, opt = wrapped(ref, profile(), folder)
    assert open_files_in(folder) == [] and ramstream.memory_report(model)["params"]["nvme_weights"] is None
    data = batches(2, b=SMALL, t=8) + batches(2, b=BIG, t=8, seed=5)
    torch_model, want = reference(ref, data)
    got = train_torch(model, opt, data[:3])
    assert scratch_modes(folder) == [0o600]  # one file, created in the folder, 0600
    got += train_torch(model, opt, data[3:])
    assert got == want
    for p, q in zip(torch_model.parameters(), model.parameters()):
        if p.requires_grad:  # (the frozen ones on disk are empty stand-ins at rest)
            assert torch.equal(p.detach(), q.detach())
    w = model._ramstream
    assert sorted(b.index for b in w.streamer.blocks) == [0, 1, *NEW]
    rep = ramstream.memory_report(model)["params"]["nvme_weights"]
    assert rep["blocks"] == NEW and rep["added_mid_run"] == NEW and rep["opened_mid_run"] is True
    assert rep["dir"] == folder and rep["bytes_read_last_step"] > 0
    F = (1024 * 256 + 1024) * 4  # fc1's weight and bias, fp32: each record 512-byte aligned already
    assert rep["bytes_on_disk"] == 4 * F and w.disk_weights.store.staging_bytes() == NVME_WEIGHTS_WINDOW * F
    assert all(t.numel() == 0 for k in NEW for t in model.blocks[k].fc1.parameters())
    assert all(t.numel() > 0 for k in (0, 1) for t in model.blocks[k].fc1.parameters())  # pinned, in RAM
    events = ramstream.memory_report(model)["events"]
    assert any(
        f"blocks 8-11 start streaming with their frozen weights on disk in {folder}" in e
        and "the disk store opened now" in e
        for e in events
    )
    last = ramstream.memory_report(model)["plan"]["history"][-1]
    assert last["streamed"] == [0, 1, *NEW] and last["streamed_was"] == [0, 1]
    assert last["disk_weights"] == {"blocks": NEW, "store": "opened"}
    assert "the frozen weights of blocks 8-11 on disk (a disk store opened)" in last["change"]
    sd = model.state_dict()  # state dicts see the real weights
    for k, v in torch_model.state_dict().items():
        assert torch.equal(v, sd[k]), k
    ramstream.unwrap(model)
    for p, q in zip(torch_model.parameters(), model.parameters()):
        assert torch.equal(p.detach(), q.detach())
    assert open_files_in(folder) == [] and os.listdir(folder) == []


@pytest.mark.parametrize("how", ["removed", "permission"])
def test_a_folder_that_became_unwritable_is_an_oserror_and_the_run_is_unchanged(folder, monkeypatch, how):
    """The folder removed (a real OSError from the store) or refusing (PermissionError): the step
    that needed the store raises an OSError naming the folder before anything moved; once the folder
    is back the same step re-plans, opens the store and the run equals torch."""
    import ramstream.disk as rdisk

    ref = lora_like()
    model, opt = wrapped(ref, profile(), folder)
    data = batches(2, b=SMALL, t=8) + batches(2, b=BIG, t=8, seed=5)
    torch_model, want = reference(ref, data)
    got = train_torch(model, opt, data[:2])
    weights = {k: v.clone() for k, v in model.state_dict().items()}
    real = rdisk.DiskStore
    if how == "removed":
        os.rmdir(folder)
    else:

        def refuse(directory, sizes, **kw):
            raise PermissionError(errno.EACCES, "Permission denied")

        monkeypatch.setattr(rdisk, "DiskStore", refuse)
    x, y = data[2]
    with pytest.raises(OSError, match=f"nvme_dir={folder!r}: cannot hold the weights of 4 blocks") as e:
        model(x, y)
    assert e.value.errno == (errno.ENOENT if how == "removed" else errno.EACCES)
    unchanged(model, opt, weights)
    if how == "removed":
        os.mkdir(folder)
    monkeypatch.setattr(rdisk, "DiskStore", real)
    assert open_files_in(folder) == [] and os.listdir(folder) == []
    got += train_torch(model, opt, data[2:])
    assert got == want
    assert ramstream.memory_report(model)["params"]["nvme_weights"]["blocks"] == NEW
    ramstream.unwrap(model)
    assert open_files_in(folder) == []


@pytest.mark.parametrize("given", ["no folder", "nvme_weights=False"])
def test_without_a_folder_the_step_is_refused_as_before(folder, given):
    """No folder (nvme_dir unset, RAMSTREAM_NVME_DIR unset by the fixture), or nvme_weights=False:
    no store is opened; the step's pinned homes do not fit, so it is refused (PlanOutOfMemoryError)
    with the run unchanged, and the plan's steps go on as torch's."""
    ref = lora_like()
    model, opt = wrapped(ref, profile(), None if given == "no folder" else folder,
                         "auto" if given == "no folder" else False)  # fmt: skip
    small = batches(4, b=SMALL, t=8)
    torch_model, want = reference(ref, small)
    got = train_torch(model, opt, small[:2])
    weights = {k: v.clone() for k, v in model.state_dict().items()}
    x, y = batches(1, b=BIG, t=8, seed=5)[0]
    with pytest.raises(PlanOutOfMemoryError, match="does not fit") as e:
        model(x, y)
    assert "RAM" in str(e.value)
    unchanged(model, opt, weights)
    assert open_files_in(folder) == [] and os.listdir(folder) == []
    got += train_torch(model, opt, small[2:])
    assert got == want
    ramstream.unwrap(model)


def test_a_disk_too_small_for_the_blocks_is_a_refusal_with_the_arithmetic(folder):
    """2 MiB free: the budget (DISK_FREE_SHARE of it) holds fewer than the 4 blocks' frozen bytes,
    so no candidate fits: the step is refused with the disk's line (planner/revise.py reports the
    stream lever's arithmetic when it tried the disk: needs vs allowed, too small), no file is
    opened and the run is unchanged."""
    free = 2 << 20
    ref = lora_like()
    model, opt = wrapped(ref, profile(disk_free=free), folder)
    train_torch(model, opt, batches(1, b=SMALL, t=8))
    weights = {k: v.clone() for k, v in model.state_dict().items()}
    x, y = batches(1, b=BIG, t=8, seed=5)[0]
    with pytest.raises(PlanOutOfMemoryError) as e:
        model(x, y)
    msg = str(e.value)  # the disk's line: the frozen weights of blocks that may go there vs its budget
    assert "every block it may stream streaming its weights" in msg and "  disk: needs " in msg
    assert "of frozen weights (blocks " in msg and ", nvme_weights) vs " in msg
    assert f"allowed ({DISK_FREE_SHARE:.0%} of {free / 2**30:.2f} GiB free): too small" in msg
    unchanged(model, opt, weights)
    assert open_files_in(folder) == []
    ramstream.unwrap(model)


def test_the_planner_opens_the_disk_between_steps_by_hand():
    """replan_stream with no block on disk and blocks 0-1 placed: "auto" takes the fewest new blocks
    from the back whose frozen bytes less a new staging ring of 3 cover what RAM lacks (all four:
    3 or fewer free nothing), needs the disk's rates as at wrap(); True all; every block placed (no
    folder): none, and the step does not fit; a disk too small: PlanError with the arithmetic."""
    ref = lora_like()
    shape = model_shape(ref, list(ref.blocks), batch=BIG, seq=8, loss="dense")
    F = shape.blocks[0].frozen_bytes
    assert F == (1024 * 256 + 1024) * 4 and all(b.frozen_bytes == F for b in shape.blocks)
    fixed = dict(activation_checkpointing=list(range(N)), nvme_offload=0.0, moment_dtype="float32")

    def plan(prof, option, applied):
        return replan_stream(
            shape, prof, [0, 1], first=1, nvme_weights=option, _disk_applied=applied, **fixed
        )

    open_ = ((), (0, 1))
    p = plan(profile(), "auto", open_)
    assert p.weights["streamed"] == [0, 1, *NEW] and p.weights["disk"] == NEW
    ram = p.memory["ram"]
    assert ram["weight_staging"] == NVME_WEIGHTS_WINDOW * F and p.memory["disk"]["weights"] == 4 * F
    without = ram["total"] - NVME_WEIGHTS_WINDOW * F + 4 * F  # every frozen weight in RAM
    assert ram["total"] <= ram["budget"] < without and ram["total"] == without - F
    assert plan(profile(), True, open_).weights["disk"] == NEW
    assert plan(profile(rates=False), True, open_).weights["disk"] == NEW  # True: rates not needed
    for prof, applied in ((profile(rates=False), open_), (profile(), ((), tuple(range(N))))):
        with pytest.raises(PlanError, match="RAM"):  # "auto" without the disk's rates, or no folder
            plan(prof, "auto", applied)
    free = 2 << 20
    with pytest.raises(PlanError) as e:
        plan(profile(disk_free=free), "auto", open_)
    disk = e.value.arithmetic["disk"]  # blocks 0-1 stay in RAM (placed); the others do not fit the disk
    assert disk["weights"] == len(disk["weight_blocks"]) * F and not set(disk["weight_blocks"]) & {0, 1}
    assert disk["budget"] == int(free * DISK_FREE_SHARE) < 4 * F <= disk["total"]
    assert "too small" in str(e.value)


@pytest.mark.cuda
def test_on_a_gpu_the_resident_frozen_weights_go_to_disk_or_stay_on_the_device(folder, monkeypatch):
    """CUDA: blocks 8-11 are resident (their frozen weights on the device) until the 24 x 8 step. A
    refused store leaves those very tensors on the device (the same storage); once the store opens,
    they are read back from disk into the GPU while their block runs, and the run follows torch's
    fused AdamW on the GPU (the host AdamW rounds otherwise: atol 1e-5); unwrap() brings them home
    and removes the file."""
    import ramstream.disk as rdisk

    ref = lora_like()
    prof = profile()
    plan = plan_for(ref, profile=prof, batch=SMALL, seq=8, moment_dtype="float32")
    shape = model_shape(ref, list(ref.blocks), batch=SMALL, seq=8, loss="dense")
    model = clone(ref).to("cuda")
    params = [p for p in model.parameters() if p.requires_grad]
    model, opt = ramstream.wrap(
        model, torch.optim.AdamW(params, lr=LR), device="cuda", plan=plan, offload=True,
        nvme_weights="auto", nvme_dir=folder,
    )  # fmt: skip
    w = model._ramstream
    check_steps(model, w, plan, shape, prof, w.options, w.log)
    data = [(x.cuda(), y.cuda()) for x, y in batches(2, b=SMALL, t=8) + batches(2, b=BIG, t=8, seed=5)]
    torch_model = clone(ref).to("cuda")
    tparams = [p for p in torch_model.parameters() if p.requires_grad]
    train_torch(torch_model, torch.optim.AdamW(tparams, lr=LR, fused=True), data)
    train_torch(model, opt, data[:2])
    frozen = {k: [t for t in model.blocks[k].fc1.parameters()] for k in NEW}
    ptrs = {k: [t.data_ptr() for t in ts] for k, ts in frozen.items()}
    assert all(t.device.type == "cuda" for ts in frozen.values() for t in ts)

    def refuse(directory, sizes, **kw):
        raise PermissionError(errno.EACCES, "Permission denied")

    real = rdisk.DiskStore
    monkeypatch.setattr(rdisk, "DiskStore", refuse)
    with pytest.raises(PermissionError, match=f"nvme_dir={folder!r}"):
        model(*data[2])
    assert {k: [t.data_ptr() for t in ts] for k, ts in frozen.items()} == ptrs  # where they were
    assert getattr(w, "disk_weights", None) is None
    monkeypatch.setattr(rdisk, "DiskStore", real)
    train_torch(model, opt, data[2:])
    assert ramstream.memory_report(model)["params"]["nvme_weights"]["blocks"] == NEW
    assert all(t.numel() == 0 for ts in frozen.values() for t in ts)  # at rest: on disk
    ramstream.unwrap(model)
    for p, q in zip(torch_model.parameters(), model.parameters()):
        torch.testing.assert_close(p.detach(), q.detach().to(p.device), rtol=0, atol=1e-5)
    assert open_files_in(folder) == []
