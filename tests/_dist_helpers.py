"""Two-rank data-parallel runs of the engine (spawned processes, gloo) and their checks, shared
by the CPU test and the test of two processes sharing one GPU."""

from __future__ import annotations

import os
import uuid

import torch
import torch.multiprocessing as mp

from _models import batches, make_model, train_torch

WORLD = 2


def new_store(tmp_path) -> str:
    """A fresh file for torch.distributed's FileStore: no TCP port to pick, so no race with other
    processes for one."""
    return "file://" + os.path.join(str(tmp_path), f"store-{uuid.uuid4().hex}")


def init_gloo(rank: int, world: int, store: str, timeout_s: float = 60) -> None:
    import datetime

    import torch.distributed as dist

    dist.init_process_group(
        "gloo", init_method=store, rank=rank, world_size=world, timeout=datetime.timedelta(seconds=timeout_s)
    )


def init_group(rank: int, world: int, store: str, backend: str = "gloo") -> None:
    """gloo, or NCCL with rank r on cuda:r."""
    if backend == "gloo":
        return init_gloo(rank, world, store)
    import datetime

    import torch.distributed as dist

    torch.cuda.set_device(rank)
    dist.init_process_group(
        backend, init_method=store, rank=rank, world_size=world, timeout=datetime.timedelta(seconds=60)
    )


def _wrap_options(device: str) -> dict:
    extra = {"device": "cpu"} if device == "cpu" else {"offload": True}
    return dict(bucket_bytes=1 << 14, optimizer_mode="cpu", **extra)  # (data parallel: the host)


def _rank_main(rank: int, store: str, out_dir: str, device: str, options: dict, steps: int) -> None:
    import torch.distributed as dist

    import ramstream

    if device != "cpu":
        torch.cuda.set_device(torch.device(device))
    init_gloo(rank, WORLD, store)
    try:
        model = make_model(0 if rank == 0 else 7, n_blocks=3).to(device)  # rank 1 starts elsewhere
        model, opt = ramstream.wrap(
            model,
            torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.05),
            **_wrap_options(device),
            **options,
        )
        engine = opt._engine
        assert engine.dp is not None and engine.mapped_numel == 0
        assert all(b.device_flat.device.type == torch.device(device).type for b in engine.buckets)
        for x, y in batches(steps, b=8, device=device):
            model(x[rank::WORLD].contiguous(), y[rank::WORLD].contiguous()).backward()
            opt.step()
            opt.zero_grad()
        opt.synchronize()
        report = ramstream.memory_report(model)
        torch.save(
            {
                "params": [p.detach().cpu().clone() for p in model.parameters()],
                "state": opt.state_dict(),
                "host_state_bytes": report["optimizer"]["host_state_bytes"],
            },
            os.path.join(out_dir, f"rank{rank}.pt"),
        )
        opt.close()
    finally:
        dist.destroy_process_group()


def run_two_ranks(tmp_path, device: str, options: dict, steps: int = 8) -> list[dict]:
    """Each rank trains on its half of every batch; returns what each rank saved."""
    mp.start_processes(
        _rank_main,
        args=(new_store(tmp_path), str(tmp_path), device, options, steps),
        nprocs=WORLD,
        start_method="spawn",
    )
    return [torch.load(tmp_path / f"rank{r}.pt") for r in range(WORLD)]


def check_equals_one_process(res: list[dict], device: str, clip, steps: int = 8) -> None:
    """Replicas bit-identical, equal to torch AdamW on the full batch, the same state dict (in
    torch's format, gathered from the owners) on every rank."""
    ref = make_model(0, n_blocks=3).to(device)
    train_torch(
        ref,
        torch.optim.AdamW(ref.parameters(), lr=3e-3, weight_decay=0.05, foreach=False),
        batches(steps, b=8, device=device),
        max_grad_norm=clip,
    )
    for a, b, r in zip(res[0]["params"], res[1]["params"], ref.parameters()):
        assert torch.equal(a, b)
        assert (a - r.detach().cpu()).abs().max() < 1e-5
    s0, s1 = res[0]["state"]["state"], res[1]["state"]["state"]
    assert s0.keys() == s1.keys() and len(s0) == len(list(ref.parameters()))
    for k in s0:
        assert torch.equal(s0[k]["exp_avg"], s1[k]["exp_avg"])
        assert torch.equal(s0[k]["exp_avg_sq"], s1[k]["exp_avg_sq"])
        assert float(s0[k]["step"]) == float(steps)


def check_half_the_host_state(res: list[dict], device: str) -> None:
    """Each rank holds its share of the single-process host state; the shares add up to it."""
    import ramstream

    model, opt = ramstream.wrap(make_model(0, n_blocks=3).to(device), **_wrap_options(device))
    single = ramstream.memory_report(model)["optimizer"]["host_state_bytes"]
    opt.close()
    per_rank = [r["host_state_bytes"] for r in res]
    assert sum(per_rank) == single
    assert max(per_rank) < 0.7 * single
