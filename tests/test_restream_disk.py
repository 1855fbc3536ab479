"""Blocks that start streaming between steps with their frozen weights on disk (issue 29): with a
disk store open (wrap(nvme_weights=...)), a larger step's re-plan (planner/replan.py replan_stream)
puts the new blocks' frozen weights on disk by wrap()'s rule (planner/disk_weights.py: True every
one, "auto" the fewest from the back that RAM needs, an int or a list none), and the runtime writes
their records into a second file in the same folder (weights/disk_slab.py DiskWeights.grow). The run
equals torch's fused AdamW bit for bit (CPU engine, fp32); a disk or host memory that refuses
changes nothing; unwrap() and garbage collection leave no file."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import ramstream
from ramstream.planner.replan import replan_stream
from ramstream.runtime.apply import check_steps
from ramstream.runtime.inspect import model_shape, plan_for

from _models import batches, clone, gpu_profile, make_model, open_files_in, scratch_folder, train_torch

LR = 3e-3
SMALL, BIG = 2, 24  # batch x seq 8: the plan's step, and one that needs blocks 6-7 streaming too


@pytest.fixture
def folder(tmp_path, monkeypatch):
    yield from scratch_folder(tmp_path, monkeypatch, "rs-rsd-")


def lora_like():
    """8 blocks whose fc1 is frozen (a LoRA-like base: 1 MiB of frozen weights per block)."""
    m = make_model(0, n_blocks=8, d=256)
    for b in m.blocks:
        b.fc1.requires_grad_(False)
    return m


def profile(tight: bool):
    """The injected GPU of 20 MiB free: the plan for 2 x 8 streams blocks 0-3, every block
    recomputing; a 24 x 8 step needs blocks 6-7 streaming too. tight: 39.5 MiB of RAM and a disk,
    where the plan puts the frozen weights of blocks 0-3 on disk (nvme_weights="auto") and the
    24 x 8 step those of blocks 6-7 too (hand-checked in test_the_planner_s_choice_between_steps)."""
    p = gpu_profile(20)
    if not tight:
        return p
    ram = 40448 << 10
    return dataclasses.replace(p, ram_total=ram, ram_available=ram, disk_read_gbps=3.0, disk_write_gbps=2.0,
                               disk_free=None, disk_dir="/nvme")  # fmt: skip


def wrapped(ref, prof, folder, option, **plan_options):
    """ref's clone wrapped on the CPU engine with ref's plan for a SMALL x 8 step under `prof` and the
    step check of a GPU run (check_steps); (model, optimizer, plan)."""
    plan = plan_for(ref, profile=prof, batch=SMALL, seq=8, **plan_options)
    shape = model_shape(ref, list(ref.blocks), batch=SMALL, seq=8, loss="dense")
    model = clone(ref)
    params = [p for p in model.parameters() if p.requires_grad]
    model, opt = ramstream.wrap(
        model, torch.optim.AdamW(params, lr=LR), device="cpu", plan=plan, nvme_weights=option, nvme_dir=folder
    )
    w = model._ramstream
    check_steps(model, w, plan, shape, prof, w.options, w.log)
    return model, opt, plan


def reference(ref, data):
    m = clone(ref)
    return m, train_torch(
        m, torch.optim.AdamW([p for p in m.parameters() if p.requires_grad], lr=LR, fused=True), data
    )


@pytest.mark.parametrize(
    "option, tight, disk_after",
    [("auto", True, [0, 1, 2, 3, 6, 7]), (True, False, [0, 1, 2, 3, 6, 7]), (2, False, [2, 3])],
    ids=["auto", "true", "int"],
)
def test_blocks_that_start_streaming_go_to_disk_by_the_rule_and_train_as_torch(
    folder, option, tight, disk_after
):
    ref = lora_like()
    prof = profile(tight)
    model, opt, plan = wrapped(ref, prof, folder, option)
    assert plan.weights["streamed"] == [0, 1, 2, 3] and plan.activations == ["recompute"] * 8
    before = ramstream.memory_report(model)["params"]["nvme_weights"]
    assert before["blocks"] == ([2, 3] if option == 2 else [0, 1, 2, 3]) and before["added_mid_run"] == []
    data = batches(2, b=SMALL, t=8) + batches(2, b=BIG, t=8, seed=5)
    torch_model, want = reference(ref, data)
    got = train_torch(model, opt, data)
    assert got == want
    for p, q in zip(torch_model.parameters(), model.parameters()):
        if p.requires_grad:  # (the frozen ones on disk are empty stand-ins at rest)
            assert torch.equal(p.detach(), q.detach())
    w = model._ramstream
    assert sorted(b.index for b in w.streamer.blocks) == [0, 1, 2, 3, 6, 7]
    rep = ramstream.memory_report(model)["params"]["nvme_weights"]
    assert rep["blocks"] == disk_after and rep["added_mid_run"] == [k for k in disk_after if k > 3]
    frozen = {k: [blk.fc1.weight, blk.fc1.bias] for k, blk in enumerate(model.blocks)}
    for k in (6, 7):  # at rest: on disk, an empty stand-in; else in a pinned home in RAM
        assert all((t.numel() == 0) == (k in disk_after) for t in frozen[k])
    per_block = w.disk_weights.store.sizes[0]
    assert rep["bytes_on_disk"] == per_block * len(disk_after)
    assert len(open_files_in(folder)) == (2 if rep["added_mid_run"] else 1)  # a second file for the new ones
    events = ramstream.memory_report(model)["events"]
    if option == 2:
        assert any("blocks 6-7 start streaming with their frozen weights in RAM: nvme_weights=2 named" in e
                   for e in events)  # fmt: skip
    else:
        assert any("blocks 6-7 start streaming with their frozen weights on disk" in e for e in events)
    # the planner's revised plan is what was applied
    last = ramstream.memory_report(model)["plan"]["history"][-1]
    assert last["streamed"] == [0, 1, 2, 3, 6, 7] and last["streamed_was"] == [0, 1, 2, 3]
    # state dicts see the real weights; unwrap brings them home and removes both files
    sd = model.state_dict()
    for k, v in torch_model.state_dict().items():
        assert torch.equal(v, sd[k]), k
    ramstream.unwrap(model)
    for p, q in zip(torch_model.parameters(), model.parameters()):
        assert torch.equal(p.detach(), q.detach())
    assert open_files_in(folder) == []


def test_the_planner_s_choice_between_steps_by_hand():
    """replan_stream with the applied placement: blocks 0-3 on disk stay there; of the new blocks
    6-7, "auto" takes the fewest from the back whose frozen bytes, with those on disk already, less
    the staging ring of 3 cover what RAM lacks; True all; an int or a list none; no store: none."""
    from ramstream.planner.rules import NVME_WEIGHTS_WINDOW

    ref = lora_like()
    shape = model_shape(ref, list(ref.blocks), batch=BIG, seq=8, loss="dense")
    F = shape.blocks[0].frozen_bytes
    assert F == (1024 * 256 + 1024) * 4 and all(b.frozen_bytes == F for b in shape.blocks)
    fixed = dict(activation_checkpointing=list(range(8)), nvme_offload=0.0)

    def plan(prof, option, applied):
        return replan_stream(
            shape, prof, [0, 1, 2, 3], first=1, nvme_weights=option, _disk_applied=applied, **fixed
        )

    on = ((0, 1, 2, 3), (0, 1, 2, 3))
    p = plan(profile(True), "auto", on)
    assert p.weights["streamed"] == [0, 1, 2, 3, 6, 7]
    ram = p.memory["ram"]
    k = len(p.weights["disk"]) - 4
    assert p.weights["disk"] == [0, 1, 2, 3, 6, 7][: 4 + k] and k == 2  # from the back: 7, then 6
    assert ram["weight_staging"] == NVME_WEIGHTS_WINDOW * F and p.memory["disk"]["weights"] == (4 + k) * F
    # what RAM lacks without any frozen weight on disk, and the fewest new blocks that cover it
    need = ram["total"] - NVME_WEIGHTS_WINDOW * F + (4 + k) * F - ram["budget"]
    assert (4 + k) * F - NVME_WEIGHTS_WINDOW * F >= need > (4 + k - 1) * F - NVME_WEIGHTS_WINDOW * F
    assert ram["total"] <= ram["budget"]
    big = plan(profile(False), "auto", on)  # RAM fits: nothing new goes to disk
    assert big.weights["disk"] == [0, 1, 2, 3]
    assert plan(profile(False), True, on).weights["disk"] == [0, 1, 2, 3, 6, 7]
    assert plan(profile(False), 4, on).weights["disk"] == [0, 1, 2, 3]
    assert plan(profile(False), [0, 1], ((0, 1), (0, 1, 2, 3))).weights["disk"] == [0, 1]
    assert plan(profile(False), True, ((), tuple(range(8)))).weights["disk"] == []  # no store
    with pytest.raises(ValueError, match="_disk_applied=5 is not accepted"):
        plan(profile(True), "auto", 5)


def test_a_disk_that_refuses_the_second_file_changes_nothing_and_training_goes_on(folder, monkeypatch):
    """The second file's reservation fails (a full disk): an OSError naming the folder from the step
    that needed the change, before anything ran; nothing moved (no bucket streams, the frozen
    weights where they were, one file); the same step then re-plans and the run equals torch."""
    import errno

    import ramstream.disk as rdisk

    ref = lora_like()
    model, opt, _ = wrapped(ref, profile(False), folder, True)
    data = batches(2, b=SMALL, t=8) + batches(2, b=BIG, t=8, seed=5)
    torch_model, want = reference(ref, data)
    got = train_torch(model, opt, data[:2])
    weights = {k: v.clone() for k, v in model.state_dict().items()}
    real = rdisk.DiskStore

    def full(directory, sizes, **kw):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(rdisk, "DiskStore", full)
    x, y = data[2]
    with pytest.raises(OSError, match=f"nvme_dir={folder!r}: cannot hold the weights of 2 more blocks") as e:
        model(x, y)
    assert e.value.errno == errno.ENOSPC
    monkeypatch.setattr(rdisk, "DiskStore", real)
    w = model._ramstream
    assert sorted(b.index for b in w.streamer.blocks) == [0, 1, 2, 3]
    assert not any(
        b.streamed for b in opt._engine.buckets if opt._engine.block_of.get(id(b.slots[0].param)) in (6, 7)
    )
    assert all(t.numel() > 0 for k in (6, 7) for t in model.blocks[k].fc1.parameters())
    assert len(open_files_in(folder)) == 1 and w.disk_weights.report()["blocks"] == [0, 1, 2, 3]
    for k, v in model.state_dict().items():
        assert torch.equal(v, weights[k]), k
    got += train_torch(model, opt, data[2:])
    assert got == want
    assert ramstream.memory_report(model)["params"]["nvme_weights"]["added_mid_run"] == [6, 7]
    ramstream.unwrap(model)


def test_host_memory_refusing_a_trained_home_takes_the_new_records_back(folder, monkeypatch):
    """The new blocks' frozen weights are on disk already when host memory refuses a trained bucket's
    pinned home: the second file is removed, the frozen weights are back where they were, a
    MemoryError (the step refused, PlanOutOfMemoryError); training then goes on as torch's."""
    from ramstream.runtime.tokens import PlanOutOfMemoryError
    from ramstream.weights.slab import Copier

    ref = lora_like()
    model, opt, _ = wrapped(ref, profile(False), folder, True)
    small = batches(4, b=SMALL, t=8)
    torch_model, want = reference(ref, small)
    got = train_torch(model, opt, small[:2])
    weights = {k: v.clone() for k, v in model.state_dict().items()}
    real = Copier.host_buffer

    def refuse(self, numel, dtype):
        raise RuntimeError("CUDA error: out of memory (pinned host allocation)")

    monkeypatch.setattr(Copier, "host_buffer", refuse)
    x, y = batches(1, b=BIG, t=8, seed=5)[0]
    with pytest.raises(PlanOutOfMemoryError, match="streaming 2 more buckets needs"):
        model(x, y)
    monkeypatch.setattr(Copier, "host_buffer", real)
    w = model._ramstream
    assert sorted(b.index for b in w.streamer.blocks) == [0, 1, 2, 3]
    assert len(open_files_in(folder)) == 1 and w.disk_weights.report()["added_mid_run"] == []
    assert w.disk_weights.report()["blocks"] == [0, 1, 2, 3]
    assert all(t.numel() > 0 for k in (6, 7) for t in model.blocks[k].fc1.parameters())
    for k, v in model.state_dict().items():
        assert torch.equal(v, weights[k]), k
    got += train_torch(model, opt, small[2:])
    assert got == want
    for p, q in zip(torch_model.parameters(), model.parameters()):
        if p.requires_grad:
            assert torch.equal(p.detach(), q.detach())
    ramstream.unwrap(model)
