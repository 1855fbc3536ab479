"""Systematic bad input for ramstream.functional's AdamW, sq_norm and accumulate_ (quantization
and memory: test_functional_fuzz_{quant,memory}.py): wrong types, every dtype, every layout,
aliasing, bad hyper-parameters, sizes and devices. Each case
either works (checked against a torch/float64 reference) or raises ValueError/TypeError/MemoryError
naming the function and the argument, leaving in-place arguments untouched."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

import ramstream.functional as F

ALL_DTYPES = [
    torch.bool,
    torch.uint8,
    torch.int8,
    torch.int16,
    torch.int32,
    torch.int64,
    torch.float16,
    torch.bfloat16,
    torch.float32,
    torch.float64,
    torch.complex64,
]
FLOATS = (torch.float32, torch.bfloat16, torch.float16)
BAD_OBJECTS = [None, [1.0, 2.0], np.zeros(12, np.float32), 3]
N = 12


def raises(exc, op, name, fn):
    with pytest.raises(exc) as info:
        fn()
    msg = str(info.value)
    assert op in msg and name in msg, f"{type(info.value).__name__} does not name {op}/{name}: {msg}"


LAYOUTS = {  # a tensor with x's 12 logical values in another memory layout
    "transposed": lambda x: torch.empty(4, 3, dtype=x.dtype).t().copy_(x.reshape(3, 4)),
    "stride2": lambda x: torch.empty(2 * N, dtype=x.dtype)[::2].copy_(x),
    "expanded": lambda x: x[:1].expand(N),
}


def layout(x, kind):
    return LAYOUTS[kind](x) if kind in LAYOUTS else x


def state(n=N):
    g = torch.Generator().manual_seed(0)
    return dict(
        param=torch.randn(n, generator=g),
        grad=torch.randn(n, generator=g),
        exp_avg=torch.randn(n, generator=g) * 0.1,
        exp_avg_sq=torch.rand(n, generator=g) * 0.01,
    )


def clone(s):
    return {k: t.clone() for k, t in s.items()}


HYPER = dict(step=3, lr=1e-2, beta1=0.9, beta2=0.99, eps=1e-8, weight_decay=0.1, grad_scale=0.5)


def adamw_ref(s, step, lr, beta1, beta2, eps, weight_decay, grad_scale):
    p, m, v = (s[k].double().reshape(-1) for k in ("param", "exp_avg", "exp_avg_sq"))
    g = s["grad"].double().reshape(-1) * grad_scale
    m, v = beta1 * m + (1 - beta1) * g, beta2 * v + (1 - beta2) * g * g
    denom = (v.sqrt() / math.sqrt(1 - beta2**step)) + eps
    return p * (1 - lr * weight_decay) - lr / (1 - beta1**step) * m / denom, m, v


def run_adamw(s, out=None):
    want = adamw_ref(clone(s), **HYPER)
    F.adamw_(*s.values(), out=out, **HYPER)
    tol = 1e-2 if s["exp_avg"].dtype == torch.bfloat16 else 1e-5
    for k, w, rtol in zip(("param", "exp_avg", "exp_avg_sq"), want, (1e-5, tol, tol)):
        torch.testing.assert_close(s[k].double().reshape(-1), w, rtol=rtol, atol=1e-6)
    if out is not None:
        assert torch.equal(out.reshape(-1), s["param"].reshape(-1).to(out.dtype))


def rejects(exc, name, s, out=None, **kw):
    """adamw_ raises exc naming `name` and writes none of its in-place arguments."""
    before = clone(s)
    raises(exc, "adamw_", name, lambda: F.adamw_(*s.values(), out=out, **(HYPER | kw)))
    for k in ("param", "exp_avg", "exp_avg_sq"):
        assert torch.equal(s[k], before[k]), f"{k} was written before the error"


@pytest.mark.parametrize("name", ["param", "grad", "exp_avg", "exp_avg_sq", "out"])
@pytest.mark.parametrize("bad", BAD_OBJECTS[1:], ids=["list", "numpy", "int"])
def test_adamw_wrong_python_types(name, bad):
    s = state()
    if name == "out":
        return rejects(TypeError, name, s, out=bad)
    s[name] = bad
    raises(TypeError, "adamw_", name, lambda: F.adamw_(*s.values(), **HYPER))
    raises(TypeError, "adamw_", name, lambda: F.adamw_(*{**s, name: None}.values(), **HYPER))


@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=str)
@pytest.mark.parametrize("name", ["param", "grad", "moments", "out"])
def test_adamw_dtypes(name, dtype):
    s, out = state(), None
    if name == "out":
        out = torch.zeros(N, dtype=dtype)
    for k in {"moments": ("exp_avg", "exp_avg_sq"), "out": ()}.get(name, (name,)):
        s[k] = s[k].to(dtype)
    accepted = {
        "param": (torch.float32,),
        "grad": FLOATS,
        "out": FLOATS,
        "moments": (torch.float32, torch.bfloat16),
    }[name]
    if dtype in accepted:
        run_adamw(s, out)
    else:
        rejects(TypeError, "exp_avg" if name == "moments" else name, s, out)
    rejects(TypeError, "exp_avg_sq", {**state(), "exp_avg": state()["exp_avg"].bfloat16()})


@pytest.mark.parametrize("kind", LAYOUTS)
@pytest.mark.parametrize("name", ["param", "grad", "exp_avg", "exp_avg_sq", "out"])
def test_adamw_layouts(name, kind):
    s, out = state(), (layout(torch.zeros(N), kind) if name == "out" else None)
    if name != "out":
        s[name] = layout(s[name], kind)
    if name == "grad":  # read only: a strided gradient is copied first
        return run_adamw(s)
    rejects(ValueError, name, s, out)


@pytest.mark.parametrize("n", [0, 1, 17])
def test_adamw_sizes_and_storage_offset(n):
    s = state(n)
    run_adamw(s, out=torch.zeros(n, dtype=torch.bfloat16))
    s = {k: v.reshape(()) for k, v in state(1).items()}  # 0-d
    run_adamw(s)
    base = {k: torch.full((n + 9,), 7.0) for k in s}
    s = {k: base[k][5 : 5 + n].copy_(v) for k, v in state(n).items()}
    run_adamw(s)
    for b in base.values():
        assert bool((b[:5] == 7).all() and (b[5 + n :] == 7).all()), "wrote outside the view"
    rejects(ValueError, "grad", {**state(), "grad": torch.ones(N - 1)})
    raises(
        ValueError,
        "adamw_",
        "exp_avg_sq",
        lambda: F.adamw_(*{**state(), "exp_avg_sq": torch.ones(N, device="meta")}.values(), **HYPER),
    )


@pytest.mark.parametrize(
    "alias",
    [
        ("param", "grad"),
        ("exp_avg", "exp_avg_sq"),
        ("param", "exp_avg"),
        ("out", "param"),
        ("out", "exp_avg_sq"),
        "views",
    ],
)
def test_adamw_aliasing(alias):
    s, out = state(), None
    if alias == "views":
        buf = torch.zeros(N + 4)
        s["exp_avg"], s["exp_avg_sq"], alias = buf[:N], buf[4:], ("exp_avg", "exp_avg_sq")
    elif alias[0] == "out":
        out = s[alias[1]]
    else:
        s[alias[1]] = s[alias[0]]
    rejects(ValueError, "shares memory", s, out)
    with pytest.raises(ValueError) as info:
        F.adamw_(*s.values(), out=out, **HYPER)
    assert all(a in str(info.value) for a in alias)
    s = state()  # the one alias allowed: out is grad (same dtype), as the engine does
    run_adamw(s, out=s["grad"])


@pytest.mark.parametrize(
    "kw,exc",
    [
        *[
            ({k: v}, ValueError)
            for k in ("lr", "beta1", "beta2", "eps", "weight_decay", "grad_scale")
            for v in (float("nan"), float("inf"), -float("inf"))
        ],
        *[
            ({k: v}, ValueError)
            for k, v in (
                ("lr", -1e-3),
                ("beta1", 1.0),
                ("beta1", -0.1),
                ("beta2", 1.0),
                ("eps", 0.0),
                ("eps", -1e-8),
                ("weight_decay", -1.0),
                ("grad_scale", 1e39),
                ("step", 0),
                ("step", -1),
                ("step", 2**63),
                ("seed", -1),
                ("seed", 2**64),
            )
        ],
        *[
            ({k: v}, TypeError)
            for k in ("lr", "eps", "grad_scale", "step", "seed")
            for v in (None, "1", [1], True)
        ],
        ({"step": 1.0}, TypeError),
    ],
)
def test_adamw_bad_hyper_parameters(kw, exc):
    rejects(exc, next(iter(kw)), state(), **kw)


@pytest.mark.parametrize(
    "kw",
    [
        dict(lr=1e300),
        dict(eps=1e300),
        dict(eps=1e-300),
        dict(lr=0.0),
        dict(weight_decay=1e300),
        dict(beta1=0.0, beta2=0.0),
        dict(grad_scale=-3e38),
        dict(grad_scale=0.0),
        dict(step=np.int64(1), lr=np.float32(0.5)),
    ],
)
def test_adamw_extreme_hyper_parameters_match_torch(kw):
    """Finite extremes are accepted and give torch.optim.AdamW(fused=True)'s answer (infs, NaNs)."""
    h = dict(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=1e-2, grad_scale=1.0) | kw
    s = state(37)
    ref = s["param"].clone().requires_grad_()
    opt = torch.optim.AdamW(
        [ref],
        lr=float(h["lr"]),
        betas=(h["beta1"], h["beta2"]),
        eps=h["eps"],
        weight_decay=h["weight_decay"],
        fused=True,
    )
    ref.grad = s["grad"] * np.float32(h["grad_scale"])
    opt.step()
    m, v = torch.zeros(37), torch.zeros(37)
    F.adamw_(s["param"], s["grad"], m, v, step=h.pop("step", 1), **h)
    torch.testing.assert_close(s["param"], ref.detach(), rtol=0, atol=0, equal_nan=True)
    torch.testing.assert_close(m, opt.state[ref]["exp_avg"], rtol=0, atol=0, equal_nan=True)


def test_in_place_ops_on_requires_grad_leaves_bump_the_version():
    """A leaf that requires grad is updated like torch.optim does, and autograd sees the write."""
    s = state()
    s["param"].requires_grad_()
    loss = (s["param"] ** 2).sum()  # saves param for backward
    with torch.no_grad():
        want = adamw_ref({k: t.detach().clone() for k, t in s.items()}, **HYPER)[0]
    F.adamw_(*s.values(), **HYPER)
    torch.testing.assert_close(s["param"].detach().double(), want, rtol=1e-5, atol=1e-6)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss.backward()
    dst = torch.ones(N, requires_grad=True)
    loss = (dst**2).sum()
    F.accumulate_(dst, torch.ones(N))
    assert torch.equal(dst.detach(), torch.full((N,), 2.0))
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss.backward()


# ---- sq_norm and accumulate_ ------------------------------------------------------------------


@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=str)
@pytest.mark.parametrize("kind", ["contiguous", "0-d", "empty", *LAYOUTS])
def test_sq_norm_and_accumulate_dtypes_layouts(dtype, kind):
    x = {"0-d": torch.tensor(1.5), "empty": torch.zeros(0)}.get(kind, torch.randn(N))
    x = layout(x.to(dtype), kind)
    n = x.numel()
    dst = torch.randn(n)
    want_dst = dst.double() + x.double().reshape(-1) if dtype in FLOATS else dst.clone()
    if dtype in FLOATS:
        assert F.sq_norm(x) == pytest.approx(float(x.double().square().sum()), rel=1e-12)
        F.accumulate_(dst, x)  # src is read only: any layout is fine
        torch.testing.assert_close(dst.double(), want_dst, rtol=1e-6, atol=1e-6)
    else:
        raises(TypeError, "sq_norm", "tensor", lambda: F.sq_norm(x))
        raises(TypeError, "accumulate_", "src", lambda: F.accumulate_(dst, x))
        assert torch.equal(dst, want_dst)
    if kind in LAYOUTS or dtype != torch.float32:  # dst is written in place: float32, contiguous
        d = layout(torch.zeros(N).to(dtype), kind) if kind in LAYOUTS else torch.zeros(N, dtype=dtype)
        exc = ValueError if dtype == torch.float32 else TypeError
        raises(exc, "accumulate_", "dst", lambda: F.accumulate_(d, torch.ones(N)))
    for bad in BAD_OBJECTS:
        raises(TypeError, "sq_norm", "tensor", lambda: F.sq_norm(bad))
        raises(TypeError, "accumulate_", "dst", lambda: F.accumulate_(bad, torch.ones(N)))
        raises(TypeError, "accumulate_", "src", lambda: F.accumulate_(torch.ones(N), bad))


def test_accumulate_aliasing_sizes_devices():
    buf = torch.arange(N + 4, dtype=torch.float32)
    before = buf.clone()
    raises(ValueError, "accumulate_", "src", lambda: F.accumulate_(buf[:N], buf[4:]))
    # bfloat16 src over the first half of dst's bytes
    raises(ValueError, "accumulate_", "src", lambda: F.accumulate_(buf[:N], buf.view(torch.bfloat16)[:N]))
    assert torch.equal(buf, before)
    F.accumulate_(buf, buf)  # exactly the same memory: dst = 2 * dst, element by element
    assert torch.equal(buf, 2 * before)
    raises(ValueError, "accumulate_", "src", lambda: F.accumulate_(torch.ones(N), torch.ones(N + 1)))
    raises(
        ValueError, "accumulate_", "src", lambda: F.accumulate_(torch.ones(N), torch.ones(N, device="meta"))
    )
    raises(ValueError, "sq_norm", "tensor", lambda: F.sq_norm(torch.ones(N, device="meta")))
