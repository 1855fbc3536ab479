"""Per-rank scenarios of data parallel with streamed weights (test_wrap_distributed_stream*.py).

Each scenario trains fresh models with param_offload off, on for every block and on for one
block, the same steps on the same shards, so the test can compare the runs bit for bit. Names are
"<kind>@<where>": where is "cpu" (CPU engine, gloo), "cuda0" (both ranks on cuda:0, gloo: the
streamed homes are broadcast as host tensors) or "nccl" (rank r on cuda:r: homes staged through
the device). They run in the spawned ranks of _dist_edge_helpers.run_ranks.
"""

from __future__ import annotations

import torch

from _dist_edge_helpers import LR, WD, sc_resume, shard
from _models import batches, make_model

STEPS = 4
OFFLOADS = {"off": False, "all": True, "one": [1]}


def _device(where: str, rank: int) -> str:
    return {"cpu": "cpu", "cuda0": "cuda:0", "nccl": f"cuda:{rank}"}[where]


def train(rank, world, device, offload, *, dtype=torch.float32, steps=STEPS, slow_s=0.0, **options) -> dict:
    """One data-parallel run: rank r trains on shard r of every batch; returns what it ends with.
    slow_s: each weight broadcast starts that late (a load that did not wait for it would read
    the weights of the step before)."""
    import time

    import ramstream

    model = make_model(rank * 5, dtype=dtype, n_blocks=3)  # rank 1 starts elsewhere: wrap broadcasts
    where = {"device": "cpu"} if device == "cpu" else {"device": device, "offload": True}
    model, opt = ramstream.wrap(
        model,
        torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WD),
        distributed=True,
        optimizer_mode="cpu",
        bucket_bytes=1 << 13,
        param_offload=offload,
        **where,
        **options,
    )
    e, w = opt._engine, model._ramstream
    if slow_s:
        broadcast = e.dp._broadcast
        e.dp._broadcast = lambda b: (time.sleep(slow_s), broadcast(b))
    accum = options.get("accumulation_steps", 1)
    losses = []
    for i, (x, y) in enumerate(batches(steps * accum, b=8, device=device)):
        loss = model(shard(x, rank, world), shard(y, rank, world))
        loss.backward()
        losses.append(loss.detach().cpu())
        if (i + 1) % accum == 0:
            opt.step()
            opt.zero_grad()
    opt.synchronize()
    report = ramstream.memory_report(model)
    state = opt.state_dict()["state"]
    out = {
        "params": [p.detach().cpu().clone() for p in model.parameters()],
        "masters": opt.master_weights(),
        "state": {k: {n: torch.as_tensor(v).clone() for n, v in st.items()} for k, st in state.items()},
        "losses": losses,
        "streamed": sum(b.streamed for b in e.buckets),
        "owned_streamed": sum(b.streamed and e.dp.owns(b) for b in e.buckets),
        "host_state_bytes": report["optimizer"]["host_state_bytes"],
        "loads": w.streamer.stats["loads"] if w.streamer is not None else 0,
        "at_home": all(s.param.device.type == "cpu" for b in e.buckets if b.streamed for s in b.slots),
    }
    opt.close()
    return out


def _kind(kind: str, where: str):
    def run(rank, world):
        device = _device(where, rank)
        if kind == "fp32":
            return {k: train(rank, world, device, v) for k, v in OFFLOADS.items()}
        if kind == "bf16":
            return {k: train(rank, world, device, OFFLOADS[k], dtype=torch.bfloat16) for k in ("off", "all")}
        if kind == "clip_accum":
            kw = dict(max_grad_norm=0.05, accumulation_steps=2)
            return {k: train(rank, world, device, OFFLOADS[k], **kw) for k in ("off", "all")}
        if kind == "window1":
            return {k: train(rank, world, device, OFFLOADS[k], weight_window=1) for k in ("off", "all")}
        if kind == "slow":
            return {
                "off": train(rank, world, device, False),
                "all": train(rank, world, device, True, slow_s=0.02),
            }
        if kind == "resume":  # state dicts gathered from the owners, loaded into a fresh wrap
            return {k: sc_resume(rank, world, param_offload=OFFLOADS[k]) for k in ("off", "all")}
        if kind == "auto":
            return {"auto": train(rank, world, device, "auto", steps=1)}
        raise KeyError(kind)

    return run


KINDS = ("fp32", "bf16", "clip_accum", "window1", "slow", "resume", "auto")
SCENARIOS = {f"{k}@{w}": _kind(k, w) for k in KINDS for w in ("cpu", "cuda0", "nccl")}


# ---- checks (the tests) ---------------------------------------------------------------------
def get(res: list[dict], name: str) -> list[dict]:
    out = [r[name] for r in res]
    for rank, r in enumerate(out):
        assert "error" not in r, f"rank {rank}, {name}:\n{r.get('error')}"
    return out


def identical(a: dict, b: dict, keys=("params", "masters", "losses")) -> None:
    """Two runs ended with the same weights, masters, optimizer state (and losses), bit for bit."""
    for key in keys:
        assert len(a[key]) == len(b[key])
        for x, y in zip(a[key], b[key]):
            assert x.dtype == y.dtype and torch.equal(x, y), key
    assert a["state"].keys() == b["state"].keys()
    for k in a["state"]:
        for n in ("step", "exp_avg", "exp_avg_sq"):
            assert torch.equal(a["state"][k][n], b["state"][k][n]), (k, n)


def check_streamed_equals_resident(ranks: list[dict], streamed=("all",)) -> None:
    for r in ranks:
        for k in streamed:
            run = r[k]
            assert run["streamed"] > 0 and run["loads"] > 0 and run["at_home"]
            # every rank owns some streamed buckets (it broadcasts them) and receives others
            assert 0 < run["owned_streamed"] < run["streamed"]
            identical(run, r["off"])
        assert r["off"]["streamed"] == 0
    for k in ("off", *streamed):  # the replicas (their losses are of their own shards)
        identical(ranks[0][k], ranks[1][k], keys=("params", "masters"))
