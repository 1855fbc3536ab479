"""Per-rank scenarios of the data-parallel edge tests (test_wrap_distributed_edge.py).

Every scenario runs in spawned gloo ranks (CPU engine); each rank returns a dict of plain tensors
that run_ranks() collects, and the test compares it with one process on the full batch. Several
scenarios share one spawn (starting processes dominates the cost); each wraps a fresh model and
closes it again.
"""

from __future__ import annotations

import io
import os
import time
import traceback

import torch
import torch.multiprocessing as mp
import torch.nn as nn
import torch.nn.functional as F

from _dist_helpers import init_group, new_store
from _models import batches, make_model

LR, WD = 3e-3, 0.05


def _entry(
    rank: int, world: int, store: str, out_dir: str, names: list[str], module: str, backend: str
) -> None:
    import importlib

    import torch.distributed as dist

    init_group(rank, world, store, backend)
    scenarios = importlib.import_module(module).SCENARIOS
    out = {}
    try:
        for name in names:
            try:
                out[name] = scenarios[name](rank, world)
            except Exception:  # noqa: BLE001 - reported by the test, the next scenario runs
                out[name] = {"error": traceback.format_exc()}
        torch.save(out, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


def run_ranks(
    tmp_path,
    world: int,
    names: list[str],
    timeout_s: float = 120,
    module: str = __name__,
    backend: str = "gloo",
) -> list[dict]:
    """Runs the named scenarios (of `module`'s SCENARIOS), in order, on `world` ranks (gloo, or
    NCCL with one GPU per rank); returns each rank's results. Ranks stuck in mismatched
    collectives are killed after timeout_s (the engine's process groups wait 30 minutes)."""
    ctx = mp.start_processes(
        _entry,
        args=(world, new_store(tmp_path), str(tmp_path), names, module, backend),
        nprocs=world,
        start_method="spawn",
        join=False,
    )
    deadline = time.monotonic() + timeout_s
    while not ctx.join(timeout=1):
        if time.monotonic() > deadline:
            for p in ctx.processes:
                p.kill()
            raise TimeoutError(f"data-parallel ranks still running after {timeout_s} s: {names}")
    return [torch.load(tmp_path / f"rank{r}.pt") for r in range(world)]


def shard(t: torch.Tensor, rank: int, world: int) -> torch.Tensor:
    return t[rank::world].contiguous()


def params(model) -> list[torch.Tensor]:
    return [p.detach().float().cpu().clone() for p in model.parameters()]


def groups_of(model, lrs=(LR, 1e-3), wds=(WD, 0.0)) -> list[dict]:
    """Two param groups: the blocks (lr, weight decay) and the rest (another lr, no decay)."""
    blocks = [p for n, p in model.named_parameters() if n.startswith("blocks.")]
    rest = [p for n, p in model.named_parameters() if not n.startswith("blocks.")]
    return [
        {"params": blocks, "lr": lrs[0], "weight_decay": wds[0]},
        {"params": rest, "lr": lrs[1], "weight_decay": wds[1]},
    ]


def accum_model(seed: int = 0) -> nn.Module:
    """TinyGPT with blocks[0].ln frozen (it stays in the optimizer)."""
    m = make_model(seed, n_blocks=2)
    m.blocks[0].ln.requires_grad_(False)
    return m


ACCUM_MICRO, ACCUM_STEP_AFTER = 7, (1, 3, 5, 6)


def sched_lambda(step: int) -> float:
    return 1.0 / (1 + step)


class Branchy(nn.Module):
    """`branch` is used only when forward is told so (data-dependent: one rank, not the other);
    `unused` never. Each Linear fills its own 4 KiB bucket."""

    def __init__(self, d: int = 32, classes: int = 8) -> None:
        super().__init__()
        self.a = nn.Linear(d, d)
        self.branch = nn.Linear(d, d)
        self.unused = nn.Linear(d, d)
        self.b = nn.Linear(d, d)
        self.head = nn.Linear(d, classes)

    def forward(self, x, y, extra: bool):
        h = torch.tanh(self.a(x))
        if extra:
            h = h + torch.tanh(self.branch(h))
        return F.cross_entropy(self.head(torch.tanh(self.b(h))), y)


def branch_data(steps: int, world: int):
    g = torch.Generator().manual_seed(3)
    return [
        (torch.randn(4 * world, 32, generator=g), torch.randint(0, 8, (4 * world,), generator=g))
        for _ in range(steps)
    ]


def branch_extra(i: int, rank: int) -> bool:
    return i == rank  # backward r: only rank r takes the branch; later ones: none


# ---- scenarios (each rank) ------------------------------------------------------------------
def _wrap(model, opt=None, **kw):
    import ramstream

    model, opt = ramstream.wrap(model, opt, device="cpu", distributed=True, **kw)
    assert opt._engine.dp is not None
    return model, opt


def _train(model, opt, data, rank, world, accumulation=1, norms=None):
    """Each rank trains on its shard of every batch."""
    for i in range(len(data) // accumulation):
        for j in range(accumulation):
            x, y = data[i * accumulation + j]
            model(shard(x, rank, world), shard(y, rank, world)).backward()
        opt.step()
        opt.zero_grad()
        if norms is not None:
            norms.append(opt._engine.last_grad_norm)


def sc_accum(rank, world):
    """accumulation_steps=2 (the last window one micro-batch short), clipping, two param groups,
    an LR scheduler, a frozen parameter."""
    model = accum_model(0 if rank == 0 else 5)
    model, opt = _wrap(
        model,
        torch.optim.AdamW(groups_of(model)),
        accumulation_steps=2,
        max_grad_norm=0.3,
        bucket_bytes=1 << 13,
    )
    sched = torch.optim.lr_scheduler.LambdaLR(opt, sched_lambda)
    norms = []
    for i, (x, y) in enumerate(batches(ACCUM_MICRO, b=8)):
        model(shard(x, rank, world), shard(y, rank, world)).backward()
        if i in ACCUM_STEP_AFTER:
            opt.step()
            opt.zero_grad()
            sched.step()
            norms.append(opt._engine.last_grad_norm)
    out = {
        "params": params(model),
        "norms": norms,
        "state": opt.state_dict(),
        "lr": [g["lr"] for g in opt.param_groups],
    }
    opt.close()
    return out


def sc_branch(rank, world):
    """A parameter with a gradient on one rank only, one with none on any rank: eager updates;
    then clipping with updates deferred to step() and two micro-batches a step."""
    out = {}
    for name, kw in BRANCH_RUNS.items():
        torch.manual_seed(0 if rank == 0 else 5)
        model = Branchy()
        model, opt = _wrap(
            model, torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WD), bucket_bytes=4096, **kw
        )
        k = kw.get("accumulation_steps", 1)
        for i, (x, y) in enumerate(branch_data(4, world)):
            model(shard(x, rank, world), shard(y, rank, world), branch_extra(i, rank)).backward()
            if (i + 1) % k == 0:
                opt.step()
                opt.zero_grad()
        out[name] = params(model)
        opt.close()
    return out


BRANCH_RUNS = {"eager": {}, "clip": dict(max_grad_norm=0.05, eager_updates=False, accumulation_steps=2)}


def _fresh(seed, dtype=torch.float32, **kw):
    model = make_model(seed, dtype=dtype, n_blocks=2)
    return _wrap(
        model, torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WD), bucket_bytes=1 << 13, **kw
    )


def _roundtrip(obj):
    buf = io.BytesIO()
    torch.save(obj, buf)
    buf.seek(0)
    return torch.load(buf)


def sc_resume(rank, world, moment_dtype="float32", **kw):
    """state_dict() on every rank, saved, loaded into a fresh wrap: resumes exactly (kw: more
    wrap() options)."""
    data = batches(5, b=8)
    model, opt = _fresh(rank * 5, moment_dtype=moment_dtype, **kw)
    _train(model, opt, data, rank, world)
    full = params(model)
    opt.close()
    model, opt = _fresh(rank * 5, moment_dtype=moment_dtype, **kw)
    _train(model, opt, data[:3], rank, world)
    osd, msd = _roundtrip(opt.state_dict()), _roundtrip(model.state_dict())
    opt.close()
    model, opt = _fresh(9 + rank, moment_dtype=moment_dtype, **kw)
    model.load_state_dict(msd)
    opt.load_state_dict(osd)
    _train(model, opt, data[3:], rank, world)
    out = {"full": full, "resumed": params(model), "osd": osd, "msd": msd}
    opt.close()
    return out


def sc_resume_bf16_moments(rank, world):
    return sc_resume(rank, world, "bfloat16")


def sc_torch_state(rank, world):
    """A torch AdamW's state goes into a DP wrap: given to wrap(), or by load_state_dict()."""
    data = batches(4, b=8)
    model = make_model(0, n_blocks=2)
    topt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WD, foreach=False)
    for x, y in data[:2]:  # one process on the full batch, on every rank
        model(x, y).backward()
        topt.step()
        topt.zero_grad()
    tsd, msd = _roundtrip(topt.state_dict()), _roundtrip(model.state_dict())
    model, opt = _wrap(model, topt, bucket_bytes=1 << 13)
    _train(model, opt, data[2:], rank, world)
    given = params(model)
    opt.close()
    model, opt = _fresh(9 + rank)
    model.load_state_dict(msd)
    opt.load_state_dict(tsd)
    _train(model, opt, data[2:], rank, world)
    out = {"given": given, "loaded": params(model)}
    opt.close()
    return out


def sc_lowp(rank, world):
    """bf16 and fp16 models (fp32 masters on the owners)."""
    out = {}
    for dtype in (torch.bfloat16, torch.float16):
        model, opt = _fresh(rank * 5, dtype=dtype)
        _train(model, opt, batches(4, b=8), rank, world)
        out[str(dtype)] = {
            "params": [p.detach().clone() for p in model.parameters()],
            "masters": opt.master_weights(),
        }
        opt.close()
    return out


def sc_unwrap(rank, world):
    """unwrap() between steps, then wrap() again with the same optimizer."""
    import ramstream

    data = batches(4, b=8)
    model, opt = _fresh(rank * 5)
    _train(model, opt, data[:2], rank, world)
    ramstream.unwrap(model)
    plain = all(type(p) is nn.Parameter and not hasattr(p, "_ramstream_slot") for p in model.parameters())
    mid = params(model)
    model, opt = _wrap(model, opt, bucket_bytes=1 << 13)
    _train(model, opt, data[2:], rank, world)
    out = {"plain": plain, "mid": mid, "params": params(model)}
    ramstream.unwrap(model)
    return out


def sc_three(rank, world):
    """An odd world, buckets smaller than some parameters, accumulation, clipping."""
    import ramstream

    model = make_model(rank * 5, n_blocks=2)
    model, opt = _wrap(
        model,
        torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WD),
        bucket_bytes=4096,
        accumulation_steps=2,
        max_grad_norm=0.3,
    )
    norms = []
    _train(model, opt, batches(4, b=12), rank, world, accumulation=2, norms=norms)
    e = opt._engine
    out = {
        "params": params(model),
        "norms": norms,
        "state": opt.state_dict(),
        "owned": [b.numel for b in e.buckets if e.dp.owns(b)],
        "bucket_numel": [b.numel for b in e.buckets],
        "host_state_bytes": ramstream.memory_report(model)["optimizer"]["host_state_bytes"],
    }
    opt.close()
    return out


def sc_convert(rank, world):
    """model.bfloat16() between steps: the owners' fp32 masters become every rank's weights."""
    data = batches(4, b=8)
    model, opt = _fresh(rank * 5)
    _train(model, opt, data[:2], rank, world)
    model.bfloat16()
    _train(model, opt, data[2:], rank, world)
    out = {"params": [p.detach().clone() for p in model.parameters()], "masters": opt.master_weights()}
    opt.close()
    return out


def sc_one_bucket(rank, world):
    """One bucket: the other ranks own nothing (no host state), clipping still sees it all."""
    import ramstream

    model = make_model(rank * 5, n_blocks=2)
    model, opt = _wrap(
        model, torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WD), max_grad_norm=0.3
    )
    norms = []
    _train(model, opt, batches(2, b=12), rank, world, norms=norms)
    out = {
        "params": params(model),
        "norms": norms,
        "host_state_bytes": ramstream.memory_report(model)["optimizer"]["host_state_bytes"],
    }
    opt.close()
    return out


REFROZEN = ("blocks.0.ln.bias", "blocks.1.fc2.bias")


def sc_refreeze(rank, world):
    """Parameters frozen after wrap() (no updates), then unfrozen: they train again, and their
    buckets wait for them (their gradients arrive after the rest of the bucket's)."""
    model, opt = _fresh(rank * 5)
    data = batches(4, b=8)
    for name in REFROZEN:
        model.get_parameter(name).requires_grad_(False)
    _train(model, opt, data[:2], rank, world)
    for name in REFROZEN:
        model.get_parameter(name).requires_grad_(True)
    _train(model, opt, data[2:], rank, world)
    out = {"params": params(model)}
    opt.close()
    return out


SCENARIOS = {
    "accum": sc_accum,
    "branch": sc_branch,
    "resume": sc_resume,
    "resume_bf16_moments": sc_resume_bf16_moments,
    "torch_state": sc_torch_state,
    "lowp": sc_lowp,
    "convert": sc_convert,
    "unwrap": sc_unwrap,
    "refreeze": sc_refreeze,
    "three": sc_three,
    "one_bucket": sc_one_bucket,
}
