"""Data parallel over gloo with the CUDA engine: two processes sharing cuda:0 equal one process.

gloo reduces and broadcasts CUDA tensors through pinned host copies ordered against the caller's
current stream, so the engine's CUDA path runs unchanged on it; NCCL would need one GPU per rank.
"""
from __future__ import annotations

import os
import socket

import pytest
import torch
import torch.multiprocessing as mp

from _models import batches, make_model, train_torch

pytestmark = pytest.mark.cuda
WORLD = 2
DEV = "cuda:0"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_main(rank: int, port: int, out_dir: str, options: dict, steps: int) -> None:
    import torch.distributed as dist

    import ramstream

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.cuda.set_device(0)
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    try:
        model = make_model(0 if rank == 0 else 7, n_blocks=3).to(DEV)   # rank 1 starts elsewhere
        model, opt = ramstream.wrap(model, torch.optim.AdamW(model.parameters(), lr=3e-3,
                                                             weight_decay=0.05),
                                    offload=True, bucket_bytes=1 << 14, **options)
        engine = opt._engine
        assert engine.dev.type == "cuda" and engine.dp is not None and engine.mapped_numel == 0
        assert all(b.device_flat.is_cuda for b in engine.buckets)
        for x, y in batches(steps, b=8, device=DEV):
            model(x[rank::WORLD].contiguous(), y[rank::WORLD].contiguous()).backward()
            opt.step()
            opt.zero_grad()
        opt.synchronize()
        torch.cuda.synchronize()
        report = ramstream.memory_report(model)
        torch.save({"params": [p.detach().cpu().clone() for p in model.parameters()],
                    "state": opt.state_dict(),
                    "host_state_bytes": report["optimizer"]["host_state_bytes"]},
                   os.path.join(out_dir, f"rank{rank}.pt"))
        opt.close()
    finally:
        dist.destroy_process_group()


def _run(tmp_path, options, steps=8):
    mp.start_processes(_rank_main, args=(_free_port(), str(tmp_path), options, steps),
                       nprocs=WORLD, start_method="spawn")
    return [torch.load(tmp_path / f"rank{r}.pt") for r in range(WORLD)]


@pytest.mark.parametrize("options, clip", [({}, None), ({"max_grad_norm": 0.05}, 0.05)])
def test_two_processes_on_one_gpu_equal_one_process_and_stay_identical(tmp_path, options, clip):
    res = _run(tmp_path, options)
    ref = make_model(0, n_blocks=3).to(DEV)
    train_torch(ref, torch.optim.AdamW(ref.parameters(), lr=3e-3, weight_decay=0.05,
                                       foreach=False), batches(8, b=8, device=DEV),
                max_grad_norm=clip)
    for a, b, r in zip(res[0]["params"], res[1]["params"], ref.parameters()):
        assert torch.equal(a, b)                            # replicas bit-identical
        assert (a - r.detach().cpu()).abs().max() < 1e-5    # equal to one process
    s0, s1 = res[0]["state"]["state"], res[1]["state"]["state"]
    assert s0.keys() == s1.keys() and len(s0) == len(list(ref.parameters()))
    for k in s0:
        assert torch.equal(s0[k]["exp_avg"], s1[k]["exp_avg"])
        assert torch.equal(s0[k]["exp_avg_sq"], s1[k]["exp_avg_sq"])
        assert float(s0[k]["step"]) == 8.0


def test_each_process_holds_about_half_the_host_state(tmp_path):
    import ramstream

    res = _run(tmp_path, {}, steps=1)
    model, opt = ramstream.wrap(make_model(0, n_blocks=3).to(DEV), offload=True,
                                bucket_bytes=1 << 14)
    single = ramstream.memory_report(model)["optimizer"]["host_state_bytes"]
    opt.close()
    per_rank = [r["host_state_bytes"] for r in res]
    assert sum(per_rank) == single
    assert max(per_rank) < 0.7 * single
