"""Helpers of the host AdamW tests: bitwise comparison, a changing lr schedule, random problems,
torch's AdamW and ours run over the same gradients."""

from __future__ import annotations

import numpy as np
import torch

import ramstream.functional as F

STEPS = 20


def bits(t: torch.Tensor) -> np.ndarray:
    t = t.detach().contiguous().cpu()
    view = {torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float16: torch.int16}[t.dtype]
    return t.view(view).numpy().copy()


def assert_bits_equal(a: torch.Tensor, b: torch.Tensor, what: str = "") -> None:
    ba, bb = bits(a), bits(b)
    bad = np.flatnonzero(ba != bb)
    assert bad.size == 0, (
        f"{what}: {bad.size} of {ba.size} differ, first at {bad[:5]}: {a.flatten()[bad[:3]]} vs {b.flatten()[bad[:3]]}"
    )


def lr_at(s: int) -> float:
    """A schedule that changes every step (warm-up then decay)."""
    return 1e-3 * min(1.0, (s + 1) / 5) / (1 + 0.05 * s)


def make_problem(n: int, seed: int, steps: int = STEPS):
    g = torch.Generator().manual_seed(seed)
    p0 = torch.randn(n, generator=g)
    # gradients spanning several orders of magnitude, so rounding differences would show
    scales = torch.logspace(-4, 1, max(n, 1))[:n]
    grads = [torch.randn(n, generator=g) * scales for _ in range(steps)]
    return p0, grads


def torch_adamw(p0, grads, *, beta1=0.9, beta2=0.999, eps=1e-8, wd=1e-2, lr_fn=lr_at, **impl):
    p = torch.nn.Parameter(p0.clone())
    opt = torch.optim.AdamW([p], lr=lr_fn(0), betas=(beta1, beta2), eps=eps, weight_decay=wd, **impl)
    for s, gr in enumerate(grads):
        opt.param_groups[0]["lr"] = lr_fn(s)
        p.grad = gr.clone()
        opt.step()
    st = opt.state[p]
    return p.detach(), st["exp_avg"], st["exp_avg_sq"]


def ours(
    p0,
    grads,
    *,
    beta1=0.9,
    beta2=0.999,
    eps=1e-8,
    wd=1e-2,
    lr_fn=lr_at,
    moment_dtype=torch.float32,
    grad_dtype=None,
    grad_scale=1.0,
    seed=0,
):
    p = p0.clone()
    m = torch.zeros(p0.numel(), dtype=moment_dtype)
    v = torch.zeros(p0.numel(), dtype=moment_dtype)
    for s, gr in enumerate(grads):
        if grad_dtype is not None:
            gr = gr.to(grad_dtype)
        F.adamw_(
            p,
            gr,
            m,
            v,
            step=s + 1,
            lr=lr_fn(s),
            beta1=beta1,
            beta2=beta2,
            eps=eps,
            weight_decay=wd,
            grad_scale=grad_scale,
            seed=seed,
        )
    return p, m, v
