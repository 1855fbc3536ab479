"""Host AdamW's bad input: hyper-parameters, tensors, the bindings' own checks, and the
RAMSTREAM_FORCE_ISA environment variable."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

import ramstream.functional as F
from ramstream._native import lib

C = lib()


# ---- RAMSTREAM_FORCE_ISA -------------------------------------------------------------------------


def test_force_isa_environment():
    code = "import ramstream._C as C; print(C.active_isa()); print(repr(C.isa_env_error()))"
    env = dict(os.environ, RAMSTREAM_FORCE_ISA="scalar")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    lines = out.stdout.splitlines()
    assert lines[0] == "scalar" and lines[1] == "''"
    env["RAMSTREAM_FORCE_ISA"] = "avx9000"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    lines = out.stdout.splitlines()
    assert lines[0] == C.best_isa()
    assert "RAMSTREAM_FORCE_ISA" in lines[1] and "avx9000" in lines[1]
    # the package says so the first time it loads the core, and `ramstream info` too
    code = "from ramstream._native import lib; lib()"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert "RuntimeWarning" in out.stderr and "avx9000" in out.stderr and "ignored" in out.stderr
    out = subprocess.run(
        [sys.executable, "-m", "ramstream.cli", "info"], env=env, capture_output=True, text=True, check=True
    )
    assert "avx9000" in out.stdout


# ---- bad input -----------------------------------------------------------------------------------


def _state(n=8, moment_dtype=torch.float32):
    return (
        torch.zeros(n),
        torch.zeros(n),
        torch.zeros(n, dtype=moment_dtype),
        torch.zeros(n, dtype=moment_dtype),
    )


@pytest.mark.parametrize(
    "kw,exc,match",
    [
        (dict(lr=float("nan")), ValueError, "lr"),
        (dict(lr=-1e-3), ValueError, "lr"),
        (dict(lr="0.1"), TypeError, "lr"),
        (dict(beta1=1.0), ValueError, "beta1"),
        (dict(beta1=-0.1), ValueError, "beta1"),
        (dict(beta2=1.5), ValueError, "beta2"),
        (dict(beta2=float("inf")), ValueError, "beta2"),
        (dict(eps=0.0), ValueError, "eps"),
        (dict(eps=float("nan")), ValueError, "eps"),
        (dict(weight_decay=-0.1), ValueError, "weight_decay"),
        (dict(weight_decay=float("inf")), ValueError, "weight_decay"),
        (dict(step=0), ValueError, "step"),
        (dict(step=1.5), TypeError, "step"),
        (dict(grad_scale=float("inf")), ValueError, "grad_scale"),
        (dict(seed=-1), ValueError, "seed"),
        (dict(seed=2**64), ValueError, "seed"),
    ],
)
def test_bad_hyper_parameters(kw, exc, match):
    p, g, m, v = _state()
    args = dict(step=1, lr=1e-3) | kw
    before = p.clone()
    with pytest.raises(exc, match=match):
        F.adamw_(p, g, m, v, **args)
    assert torch.equal(p, before)


def test_bad_tensors():
    p, g, m, v = _state()
    with pytest.raises(TypeError, match="param must be float32"):
        F.adamw_(p.double(), g, m, v, step=1, lr=1e-3)
    with pytest.raises(TypeError, match="grad must be float32/bfloat16/float16"):
        F.adamw_(p, g.to(torch.int32), m, v, step=1, lr=1e-3)
    with pytest.raises(TypeError, match="exp_avg must be float32/bfloat16"):
        F.adamw_(p, g, m.half(), v.half(), step=1, lr=1e-3)
    with pytest.raises(TypeError, match="exp_avg_sq must have exp_avg's dtype"):
        F.adamw_(p, g, m, v.bfloat16(), step=1, lr=1e-3)
    with pytest.raises(TypeError, match="out must be float32/bfloat16/float16"):
        F.adamw_(p, g, m, v, step=1, lr=1e-3, out=torch.empty(8, dtype=torch.float64))
    with pytest.raises(TypeError, match="grad must be a torch.Tensor"):
        F.adamw_(p, [0.0] * 8, m, v, step=1, lr=1e-3)
    for name, args in (
        ("grad", (p, g[:7], m, v)),
        ("exp_avg", (p, g, m[:7], v)),
        ("exp_avg_sq", (p, g, m, v[:7])),
    ):
        with pytest.raises(ValueError, match=f"{name} must have the same number of elements as param"):
            F.adamw_(*args, step=1, lr=1e-3)
    with pytest.raises(ValueError, match="out must have the same number of elements"):
        F.adamw_(p, g, m, v, step=1, lr=1e-3, out=torch.empty(9))
    wide = torch.zeros(8, 2)
    with pytest.raises(ValueError, match="param must be contiguous"):
        F.adamw_(wide[:, 0], g, m, v, step=1, lr=1e-3)
    with pytest.raises(ValueError, match="exp_avg_sq must be contiguous"):
        F.adamw_(p, g, m, wide[:, 1], step=1, lr=1e-3)
    with pytest.raises(ValueError, match="out must be contiguous"):
        F.adamw_(p, g, m, v, step=1, lr=1e-3, out=wide[:, 1])
    with pytest.raises(ValueError, match="grad must be a CPU tensor"):
        F.adamw_(p, g.to("meta"), m, v, step=1, lr=1e-3)
    # a non-contiguous grad is only read: accepted
    F.adamw_(p, wide[:, 0], m, v, step=1, lr=1e-3)


def test_binding_checks():
    """The compiled entry points validate on their own (no silent copies, arguments named)."""
    p, g, m, v = _state()
    kw = dict(lr=1e-3, step=1)
    with pytest.raises(TypeError, match="param"):
        C.adamw_(p.double(), g, m, v, None, **kw)
    with pytest.raises(ValueError, match="exp_avg: has 7 elements"):
        C.adamw_(p, g, m[:7], v, None, **kw)
    with pytest.raises(ValueError, match="grad: must be contiguous"):
        C.adamw_(p, torch.zeros(8, 2)[:, 0], m, v, None, **kw)
    with pytest.raises(ValueError, match="offset"):
        C.adamw_(p, g, m, v, None, offset=-1, **kw)
    with pytest.raises(ValueError, match="lr"):
        C.adamw_(p, g, m, v, None, lr=-1.0, step=1)
    with pytest.raises(ValueError, match="grad_dtype"):
        C.adamw_ptr(
            p.data_ptr(),
            g.data_ptr(),
            7,
            m.data_ptr(),
            v.data_ptr(),
            0,
            0,
            0,
            8,
            0,
            1e-3,
            0.9,
            0.999,
            1e-8,
            0.0,
            1,
            1.0,
            0,
        )
    with pytest.raises(ValueError, match="moment dtype"):
        C.adamw_ptr(
            p.data_ptr(),
            g.data_ptr(),
            0,
            m.data_ptr(),
            v.data_ptr(),
            C.DTYPE_FLOAT16,
            0,
            0,
            8,
            0,
            1e-3,
            0.9,
            0.999,
            1e-8,
            0.0,
            1,
            1.0,
            0,
        )
    with pytest.raises(ValueError, match="null pointer"):
        C.adamw_ptr(
            0,
            g.data_ptr(),
            0,
            m.data_ptr(),
            v.data_ptr(),
            0,
            0,
            0,
            8,
            0,
            1e-3,
            0.9,
            0.999,
            1e-8,
            0.0,
            1,
            1.0,
            0,
        )
    with pytest.raises(ValueError, match="step"):
        C.adamw_ptr(
            p.data_ptr(),
            g.data_ptr(),
            0,
            m.data_ptr(),
            v.data_ptr(),
            0,
            0,
            0,
            8,
            0,
            1e-3,
            0.9,
            0.999,
            1e-8,
            0.0,
            0,
            1.0,
            0,
        )


def test_parameter_with_requires_grad_is_updated():
    p = torch.nn.Parameter(torch.randn(33))
    before = p.detach().clone()
    F.adamw_(p, torch.randn(33), torch.zeros(33), torch.zeros(33), step=1, lr=1e-2)
    assert not torch.equal(p.detach(), before)
