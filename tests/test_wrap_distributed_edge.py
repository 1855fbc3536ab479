"""Data parallel edge cases (gloo, CPU engine) against one process on the full batch.

The ranks' scenarios are in _dist_edge_helpers.py; one spawn of 2 ranks and one of 3 run them
all (module fixtures). An fp32 model is compared with torch.optim.AdamW on the full batch; a
bf16/fp16 model (whose ranks' gradients are summed in its own dtype) with the same arithmetic
done in one process: fp32 masters, torch's fused AdamW on (g_0 + g_1) / 2.
"""

from __future__ import annotations

import pytest
import torch

import ramstream

from _dist_edge_helpers import (
    ACCUM_MICRO,
    ACCUM_STEP_AFTER,
    BRANCH_RUNS,
    LR,
    REFROZEN,
    WD,
    Branchy,
    accum_model,
    branch_data,
    branch_extra,
    groups_of,
    params,
    run_ranks,
    sched_lambda,
    shard,
)
from _models import batches, make_model

TWO = [
    "accum",
    "branch",
    "resume",
    "resume_bf16_moments",
    "torch_state",
    "lowp",
    "convert",
    "unwrap",
    "refreeze",
]
THREE = ["three", "one_bucket"]


@pytest.fixture(scope="module")
def two(tmp_path_factory):
    return run_ranks(tmp_path_factory.mktemp("dp2"), 2, TWO)


@pytest.fixture(scope="module")
def three(tmp_path_factory):
    return run_ranks(tmp_path_factory.mktemp("dp3"), 3, THREE)


def _get(res, name) -> list[dict]:
    out = [r[name] for r in res]
    for rank, r in enumerate(out):
        assert "error" not in r, f"rank {rank}, {name}:\n{r.get('error')}"
    return out


def _close(a, b, tol=1e-5) -> None:
    a, b = list(a), list(b)
    assert len(a) == len(b)
    for x, y in zip(a, b):
        assert (x.float() - y.detach().float().cpu()).abs().max() < tol


def _identical(a, b) -> None:
    a, b = list(a), list(b)
    assert len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))


def _same_state(s0: dict, s1: dict) -> None:
    assert s0["param_groups"] == s1["param_groups"] and s0["state"].keys() == s1["state"].keys()
    for k in s0["state"]:
        for n in ("step", "exp_avg", "exp_avg_sq"):
            assert torch.equal(s0["state"][k][n], s1["state"][k][n])


def _torch_full_batch(steps, b, *, clip=None, accumulation=1, seed=0):
    ref = make_model(seed, n_blocks=2)
    opt = torch.optim.AdamW(ref.parameters(), lr=LR, weight_decay=WD, foreach=False)
    norms = []
    data = batches(steps * accumulation, b=b)
    for i in range(steps):
        for x, y in data[i * accumulation : (i + 1) * accumulation]:
            ref(x, y).backward()
        if clip is not None:
            norms.append(float(torch.nn.utils.clip_grad_norm_(ref.parameters(), clip)))
        opt.step()
        opt.zero_grad()
    return ref, norms, opt


def _dp_master_reference(dtype, data, world, convert_at=None):
    """One process doing what data parallel does to a low-precision model: each rank's
    gradient in the model's dtype, their sum in that dtype, fused AdamW on fp32 masters with
    the mean (fused AdamW is what ramstream's host update equals bit for bit)."""
    model = make_model(0, dtype=dtype, n_blocks=2)
    masters = [p.detach().float().clone().requires_grad_(True) for p in model.parameters()]
    opt = torch.optim.AdamW(masters, lr=LR, weight_decay=WD, fused=True)
    for i, (x, y) in enumerate(data):
        if i == convert_at:
            model.bfloat16()
        total = None
        for r in range(world):
            model(shard(x, r, world), shard(y, r, world)).backward()
            g = [p.grad for p in model.parameters()]
            model.zero_grad()
            total = g if total is None else [a + b for a, b in zip(total, g)]
        for m, g in zip(masters, total):
            m.grad = g.float() / world
        opt.step()
        with torch.no_grad():
            for m, p in zip(masters, model.parameters()):
                p.copy_(m)
    return masters


def test_accumulation_clipping_groups_scheduler_and_frozen_parameter(two):
    r0, r1 = _get(two, "accum")
    ref = accum_model(0)
    opt = torch.optim.AdamW(groups_of(ref), foreach=False)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, sched_lambda)
    norms = []
    for i, (x, y) in enumerate(batches(ACCUM_MICRO, b=8)):
        ref(x, y).backward()
        if i in ACCUM_STEP_AFTER:  # the last window is one micro-batch short
            norms.append(
                float(torch.nn.utils.clip_grad_norm_([p for p in ref.parameters() if p.requires_grad], 0.3))
            )
            opt.step()
            opt.zero_grad()
            sched.step()
    _identical(r0["params"], r1["params"])
    _close(r0["params"], ref.parameters(), 2e-5)
    assert r0["norms"] == r1["norms"] and r0["norms"] == pytest.approx(norms, rel=1e-5)
    assert r0["lr"] == [g["lr"] for g in opt.param_groups]
    _same_state(r0["state"], r1["state"])
    # the frozen blocks[0].ln (indices 0 and 1 in the first group) has no state, as in torch
    assert set(r0["state"]["state"]) == set(opt.state_dict()["state"]) == set(range(2, 15))
    for k, st in opt.state_dict()["state"].items():
        assert float(r0["state"]["state"][k]["step"]) == float(st["step"]) == 4
        assert (r0["state"]["state"][k]["exp_avg"] - st["exp_avg"]).abs().max() < 1e-6


@pytest.mark.parametrize("run", list(BRANCH_RUNS))
def test_gradient_on_one_rank_only_and_on_none(two, run):
    """Buckets complete in another order on each rank (reduces are issued in one order all the
    same); a gradient missing everywhere counts as zero (weight decay still applies)."""
    r0, r1 = (r[run] for r in _get(two, "branch"))
    kw = BRANCH_RUNS[run]
    torch.manual_seed(0)
    ref = Branchy()
    init = params(ref)
    opt = torch.optim.AdamW(ref.parameters(), lr=LR, weight_decay=WD, foreach=False)
    k = kw.get("accumulation_steps", 1)
    for i, (x, y) in enumerate(branch_data(4, 2)):
        sum(ref(shard(x, r, 2), shard(y, r, 2), branch_extra(i, r)) for r in range(2)).div(2).backward()
        if (i + 1) % k == 0:
            for p in ref.parameters():
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
            if "max_grad_norm" in kw:
                torch.nn.utils.clip_grad_norm_(ref.parameters(), kw["max_grad_norm"])
            opt.step()
            opt.zero_grad()
    _identical(r0, r1)
    _close(r0, ref.parameters())
    unused = [i for i, (n, _) in enumerate(ref.named_parameters()) if n.startswith("unused")]
    assert all(not torch.equal(r0[i], init[i]) for i in unused)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_model_keeps_fp32_masters(two, dtype):
    r0, r1 = (r[str(dtype)] for r in _get(two, "lowp"))
    _identical(r0["params"], r1["params"])
    _identical(r0["masters"], r1["masters"])
    _identical(r0["masters"], _dp_master_reference(dtype, batches(4, b=8), 2))
    _identical(r0["params"], [m.to(dtype) for m in r0["masters"]])
    assert any(not torch.equal(m, m.to(dtype).float()) for m in r0["masters"])


def test_model_converted_to_bfloat16_between_steps(two):
    r0, r1 = _get(two, "convert")
    assert all(p.dtype == torch.bfloat16 for p in r0["params"])
    _identical(r0["params"], r1["params"])
    _identical(r0["masters"], _dp_master_reference(torch.float32, batches(4, b=8), 2, 2))


@pytest.mark.parametrize("name", ["resume", "resume_bf16_moments"])
def test_state_dicts_agree_on_every_rank_and_resume_exactly(two, name):
    r0, r1 = _get(two, name)
    _same_state(r0["osd"], r1["osd"])
    assert r0["msd"].keys() == r1["msd"].keys()
    assert all(torch.equal(r0["msd"][k], r1["msd"][k]) for k in r0["msd"])
    assert all(float(st["step"]) == 3 for st in r0["osd"]["state"].values())
    _identical(r0["resumed"], r0["full"])
    _identical(r1["resumed"], r1["full"])
    _identical(r0["full"], r1["full"])
    ref, _, _ = _torch_full_batch(5, 8)
    if name == "resume":
        _close(r0["full"], ref.parameters())
        return
    # bf16 moments (stochastic rounding): the same arithmetic in one ramstream process, the two
    # halves as micro-batches of half weight, is bit-identical
    model = make_model(0, n_blocks=2)
    model, opt = ramstream.wrap(
        model,
        torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WD),
        device="cpu",
        bucket_bytes=1 << 13,
        moment_dtype="bfloat16",
        accumulation_steps=2,
    )
    for x, y in batches(5, b=8):
        for r in range(2):
            (model(shard(x, r, 2), shard(y, r, 2)) * 0.5).backward()
        opt.step()
        opt.zero_grad()
    _identical(r0["full"], params(model))
    opt.close()
    _close(r0["full"], ref.parameters(), 1e-3)


def test_torch_adamw_state_into_a_data_parallel_wrap(two):
    r0, r1 = _get(two, "torch_state")
    ref, _, _ = _torch_full_batch(4, 8)
    for key in ("given", "loaded"):
        _identical(r0[key], r1[key])
        _close(r0[key], ref.parameters())


def test_unwrap_and_wrap_again(two):
    r0, r1 = _get(two, "unwrap")
    assert r0["plain"] and r1["plain"]
    _identical(r0["mid"], r1["mid"])
    _identical(r0["params"], r1["params"])
    ref, _, _ = _torch_full_batch(2, 8)
    _close(r0["mid"], ref.parameters())
    ref, _, _ = _torch_full_batch(4, 8)
    _close(r0["params"], ref.parameters())


def test_parameters_frozen_after_wrap_then_unfrozen(two):
    r0, r1 = _get(two, "refreeze")
    ref = make_model(0, n_blocks=2)
    opt = torch.optim.AdamW(ref.parameters(), lr=LR, weight_decay=WD, foreach=False)
    for i, (x, y) in enumerate(batches(4, b=8)):
        for name in REFROZEN:
            ref.get_parameter(name).requires_grad_(i >= 2)
        ref(x, y).backward()
        opt.step()
        opt.zero_grad()
    _identical(r0["params"], r1["params"])
    _close(r0["params"], ref.parameters())


def test_three_ranks_with_buckets_smaller_than_a_parameter(three):
    res = _get(three, "three")
    assert max(res[0]["bucket_numel"]) * 4 > 4096  # fc1/fc2 get a bucket each
    assert sorted(n for r in res for n in r["owned"]) == sorted(res[0]["bucket_numel"])
    assert all(r["owned"] for r in res)
    ref, norms, opt = _torch_full_batch(2, 12, clip=0.3, accumulation=2)
    for r in res:
        _identical(r["params"], res[0]["params"])
        _same_state(r["state"], res[0]["state"])
        assert r["norms"] == pytest.approx(norms, rel=1e-5)
    _close(res[0]["params"], ref.parameters())
    model, single = ramstream.wrap(
        make_model(0, n_blocks=2), device="cpu", bucket_bytes=4096, accumulation_steps=2
    )
    total = ramstream.memory_report(model)["optimizer"]["host_state_bytes"]
    single.close()
    assert sum(r["host_state_bytes"] for r in res) == total
    assert max(r["host_state_bytes"] for r in res) < 0.6 * total


def test_ranks_owning_no_bucket(three):
    res = _get(three, "one_bucket")
    assert sorted(r["host_state_bytes"] > 0 for r in res) == [False, False, True]
    ref, norms, _ = _torch_full_batch(2, 12, clip=0.3)
    for r in res:
        _identical(r["params"], res[0]["params"])
        assert r["norms"] == pytest.approx(norms, rel=1e-5)
    # data parallel sums three shards' gradients where the reference takes one full-batch
    # gradient: they differ by rounding, which Adam's normalisation lifts on elements whose
    # gradient is near zero (1.7e-5 measured on an AVX2 host; under 1e-5 where CI passed before);
    # still below 1 % of the two updates' size (2 x lr 3e-3)
    _close(res[0]["params"], ref.parameters(), tol=5e-5)
