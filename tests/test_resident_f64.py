"""Each optimizer step of a wrapped bf16 model, offloaded (host AdamW) and resident (offload="auto"
after the switch: fused AdamW or ramstream's CUDA kernel), against a float64 AdamW computed from
the same state and the same gradients: how close each is to the exact update, and which is closer.

Why per step and not whole trajectories: a bf16 model's working copy is its fp32 master rounded to
bf16, so a 1-ulp difference in an fp32 master (two correct AdamW implementations differ this much)
can flip a bf16 weight, change the next gradients by about a bf16 ulp, and Adam's normalisation turns
that into an update difference of order lr * 2**-8 (a few 1e-5 at lr 3e-3). Trajectories of two
exact-to-rounding optimizers therefore drift apart by rounding, not by error; what must hold is that
every step is exact to fp32 rounding from its own state, which this file checks."""

from __future__ import annotations

import math

import pytest
import torch

import ramstream
import ramstream.runtime.measure as measure_mod

from _models import batches, make_model

LR = 3e-3
MAX_NORM = 0.05


@pytest.fixture(autouse=True)
def roomy(monkeypatch):
    """The CPU engine switches to the resident optimizer only when device memory looks roomy."""
    monkeypatch.setattr(measure_mod, "device_memory", lambda d: {"usable": 1 << 40, "peak": 0, "now": 0})


def _groups(model):
    decay = [p for p in model.parameters() if p.dim() >= 2]
    rest = [p for p in model.parameters() if p.dim() < 2]
    return [
        {"params": decay, "weight_decay": 0.1},
        {"params": rest, "weight_decay": 0.0, "lr": 2 * LR, "betas": (0.8, 0.99)},
    ]


def _grads(plain, wrapped, micro):
    """The gradients of one step, summed over its micro-batches in float64, from a plain copy of
    the wrapped model's current working weights (same bf16 weights, same data: same gradients)."""
    plain.load_state_dict(wrapped.state_dict())
    plain.zero_grad(set_to_none=True)
    sums = None
    for x, y in micro:
        for p in plain.parameters():
            p.grad = None
        plain(x, y).backward()
        g = [p.grad.double().cpu() for g in _groups(plain) for p in g["params"]]
        sums = g if sums is None else [a + b for a, b in zip(sums, g)]
    return sums


def _f64_step(opt, masters, grads, step, clip):
    """torch AdamW's update in float64 from the optimizer's fp32 state before the step, and per
    element the scale of what fp32 rounding may cost: the weight plus the update computed from
    |b1 m| + |(1 - b1) g| (the moment's terms can cancel; their rounding does not)."""
    sd = opt.state_dict()
    if clip:
        norm = math.sqrt(sum(float((g * g).sum()) for g in grads))
        coef = min(1.0, MAX_NORM / (norm + 1e-6))
        grads = [g * coef for g in grads]
    out, scale, i = [], [], 0
    for group in sd["param_groups"]:
        lr, (b1, b2), eps, wd = group["lr"], group["betas"], group["eps"], group["weight_decay"]
        bc1, bc2 = 1 - b1**step, 1 - b2**step
        for idx in group["params"]:
            p, g = masters[i].double().cpu(), grads[i]
            st = sd["state"].get(idx)
            m = st["exp_avg"].double().cpu() if st else torch.zeros_like(p)
            v = st["exp_avg_sq"].double().cpu() if st else torch.zeros_like(p)
            p = p * (1 - lr * wd)
            m_terms = (b1 * m).abs() + ((1 - b1) * g).abs()
            m = b1 * m + (1 - b1) * g
            v = b2 * v + (1 - b2) * g * g
            denom = (v / bc2).sqrt() + eps
            out.append(p - lr / bc1 * m / denom)
            scale.append(p.abs() + lr / bc1 * m_terms / denom)
            i += 1
    return out, scale


def _ulps(got, ref):
    """The largest |got - ref| over all parameters, in fp32 rounding units (eps x scale)."""
    worst = 0.0
    for a, r, sc in zip(got, *ref):
        spacing = torch.finfo(torch.float32).eps * sc.clamp_min(2.0**-40)
        worst = max(worst, float(((a.double().cpu() - r).abs() / spacing).max()))
    return worst


def _run(device, offload, options, steps):
    """Per step: (fp32 units of this run's new masters from the float64 update, whether the
    step ran on the resident optimizer with torch's fused CUDA AdamW)."""
    k = options.get("accumulation_steps", 1)
    data = batches(steps * k, device=device)
    model = make_model(0, dtype=torch.bfloat16, n_blocks=2).to(device)
    plain = make_model(0, dtype=torch.bfloat16, n_blocks=2).to(device)
    model, opt = ramstream.wrap(
        model, torch.optim.AdamW(_groups(model), lr=LR), offload=offload, device=device, **options
    )
    out = []
    for s in range(steps):
        micro = data[s * k : (s + 1) * k]
        masters = opt.master_weights()
        grads = _grads(plain, model, micro)
        fused_cuda = opt.resident and device == "cuda"
        ref = _f64_step(opt, masters, grads, s + 1, "max_grad_norm" in options)
        for x, y in micro:
            model(x, y).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        out.append((_ulps(opt.master_weights(), ref), fused_cuda))
    assert opt.resident == (offload == "auto")  # the switch happened (after two steps)
    return out


# torch's fused CUDA AdamW (the resident optimizer's fp32 path) measured up to 81 units from the
# exact update in the first steps after the switch (H200, torch 2.11: its float32 bias
# corrections and arithmetic); ramstream's host AdamW stays within 2.4. Bound: twice that.
TORCH_FUSED_CUDA_UNITS = 160.0


def _check(device, options, bound):
    """Every step of the offloaded run is within `bound` fp32 units of the exact update; a step
    of the resident run on the GPU within what torch's fused CUDA AdamW is measured to keep."""
    steps = 6
    runs = {off: _run(device, off, options, steps) for off in ("auto", True)}
    assert any(f for _, f in runs["auto"]) == (device == "cuda")
    for off, per_step in runs.items():
        print(
            f"offload={off!r}: fp32 units from float64 per step "
            f"{[round(u, 1) for u, _ in per_step]} (resident: {[f for _, f in per_step]})"
        )
        for u, fused in per_step:
            assert u <= (TORCH_FUSED_CUDA_UNITS if fused else bound), (off, per_step)
    return runs


_CASES = [(dict(accumulation_steps=2, max_grad_norm=MAX_NORM), 8.0), (dict(max_grad_norm=MAX_NORM), 8.0)]


@pytest.mark.parametrize("options, bound", _CASES, ids=["accumulate+clip", "clip"])
def test_every_step_is_exact_to_fp32_rounding_on_the_cpu(options, bound):
    with torch.random.fork_rng():
        _check("cpu", options, bound)


@pytest.mark.cuda
@pytest.mark.parametrize("options, bound", _CASES, ids=["accumulate+clip", "clip"])
def test_every_step_is_exact_to_fp32_rounding_on_the_gpu(options, bound):
    """The host AdamW (offloaded) is within a few fp32 units of the exact update at every step,
    torch's fused CUDA AdamW (resident, after the switch) within TORCH_FUSED_CUDA_UNITS (printed
    with -s): of the two runs, the offloaded one is the closer to float64, and the trajectories
    of a bf16 model drift apart by rounding (module docstring)."""
    torch.use_deterministic_algorithms(True, warn_only=True)
    try:
        _check("cuda", options, bound)
    finally:
        torch.use_deterministic_algorithms(False)
