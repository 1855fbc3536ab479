"""save_checkpoint / load_checkpoint under data parallel (gloo, 2 ranks, the CPU engine): a
collective in which each rank writes the state of the buckets it owns; resuming equals the
uninterrupted run bit for bit, the checkpoint loads into one process with the state the ranks
held, and a save failing on one rank raises on every rank and leaves the previous checkpoint."""

from __future__ import annotations

import copy
import json
import os

import torch
import torch.multiprocessing as mp

from _dist_helpers import WORLD, _wrap_options, init_gloo, new_store
from _models import batches, make_model

STEPS = 6


def _steps(model, opt, data, rank):
    for x, y in data:
        model(x[rank::WORLD].contiguous(), y[rank::WORLD].contiguous()).backward()
        opt.step()
        opt.zero_grad()
    opt.synchronize()


def _wrapped():
    import ramstream

    model = make_model(0, n_blocks=3)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.05)
    return ramstream.wrap(model, opt, **_wrap_options("cpu"), distributed=True)


def _failing_save(ck, model, opt, rank) -> str:
    """A save over `ck` whose shard write fails on rank 1 (a full disk): every rank raises."""
    import ramstream
    import ramstream.checkpoint as ckm

    real = ckm.write_safetensors

    def broken(path, *a, **k):
        if rank == 1:
            raise OSError(28, "No space left on device")
        return real(path, *a, **k)

    ckm.write_safetensors = broken
    try:
        ramstream.save_checkpoint(ck, model, opt, step=6)
    except (OSError, RuntimeError) as e:
        return f"{type(e).__name__}: {e}"
    finally:
        ckm.write_safetensors = real
    return ""


def _rank_main(rank: int, store: str, out: str) -> None:
    import torch.distributed as dist

    import ramstream

    init_gloo(rank, WORLD, store)
    try:
        data = batches(STEPS, b=8)
        model, opt = _wrapped()
        _steps(model, opt, data[:3], rank)
        ck = os.path.join(out, "ck")
        assert ramstream.save_checkpoint(ck, model, opt, step=3, note="dp") == ck
        # gathered from the owners, in torch's format; copied (as torch's, it references live state)
        at_save = copy.deepcopy(opt.state_dict())
        e = opt._engine
        owned = sum(s.numel for s in e.slots if e.dp.owns(s.bucket))  # parameters' elements, no padding
        _steps(model, opt, data[3:], rank)
        full = [p.detach().clone() for p in model.parameters()]
        opt.close()

        model2, opt2 = _wrapped()
        extra = ramstream.load_checkpoint(ck, model2, opt2)
        _steps(model2, opt2, data[3:], rank)
        resumed = [p.detach().clone() for p in model2.parameters()]
        raised = _failing_save(ck, model2, opt2, rank)
        opt2.close()
        torch.save(
            {
                "full": full,
                "resumed": resumed,
                "extra": extra,
                "at_save": at_save,
                "owned": owned,
                "raised": raised,
            },
            os.path.join(out, f"rank{rank}.pt"),
        )
    finally:
        dist.destroy_process_group()


def test_data_parallel_checkpoint_resumes_exactly_and_loads_into_one_process(tmp_path):
    import ramstream
    from ramstream._tensorfile import read_safetensors

    mp.start_processes(
        _rank_main, args=(new_store(tmp_path), str(tmp_path)), nprocs=WORLD, start_method="spawn"
    )
    res = [torch.load(tmp_path / f"rank{r}.pt") for r in range(WORLD)]
    # the failed second save: rank 1 raised its error, rank 0 said which rank failed; nothing
    # was published (the checkpoint below still holds step 3's state) and no temporary folder is left
    assert res[1]["raised"] == "OSError: [Errno 28] No space left on device"
    assert res[0]["raised"].startswith("RuntimeError: save_checkpoint: not saved: rank(s) [1] failed")
    for r in res:
        assert r["extra"] == {"step": 3, "note": "dp"}
        assert all(torch.equal(a, b) for a, b in zip(r["full"], r["resumed"]))  # bit for bit
    assert all(torch.equal(a, b) for a, b in zip(res[0]["full"], res[1]["full"]))

    ck = tmp_path / "ck"
    names = sorted(os.listdir(ck))
    shards = [f"optimizer-{r:05d}-of-{WORLD:05d}" for r in range(WORLD)]
    assert names == sorted(
        ["extra.json", "extra.safetensors", "meta.json", "model.safetensors", "optimizer.json"]
        + [s + ext for s in shards for ext in (".json", ".safetensors")]
    )
    assert not [n for n in os.listdir(tmp_path) if n.startswith(".ck.tmp-")]
    assert json.loads((ck / "meta.json").read_text())["shards"] == WORLD
    # each rank wrote only what it owns: moments and masters of its buckets, no more
    for r, shard in enumerate(shards):
        tensors, _ = read_safetensors(str(ck / (shard + ".safetensors")))
        assert sum(t.numel() for t in tensors.values()) == 3 * res[r]["owned"] > 0
    assert sum(r["owned"] for r in res) == sum(p.numel() for p in make_model(0, n_blocks=3).parameters())

    # one process loads the sharded checkpoint: the state equals what the ranks held at the save
    model = make_model(0, n_blocks=3)
    model, opt = ramstream.wrap(model, torch.optim.AdamW(model.parameters(), lr=3e-3), **_wrap_options("cpu"))
    ramstream.load_checkpoint(ck, model, opt)
    got, want = opt.state_dict()["state"], res[0]["at_save"]["state"]
    assert got.keys() == want.keys() and got
    for k in want:
        for key in ("exp_avg", "exp_avg_sq", "master", "step"):
            assert torch.equal(got[k][key], want[k][key]), (k, key)
    opt.close()
