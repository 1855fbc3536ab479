"""The typed wrappers over the raw kernel entry points (ramstream/ops/_raw.py): keyword-only, torch
dtypes mapped to _C.DTYPE_*, results equal to the validated tensor API and to torch, the kernels'
hyper-parameter messages, and no raw entry called from anywhere else in the package."""

from __future__ import annotations

import inspect
import re
from pathlib import Path

import pytest
import torch

import ramstream.functional as F
from ramstream._native import lib
from ramstream.ops import _raw

from _adamw_helpers import assert_bits_equal, lr_at, make_problem, torch_adamw

C = lib()
PACKAGE = Path(_raw.__file__).resolve().parents[1]
WRAPPERS = [getattr(_raw, name) for name in _raw.__all__ if name != "dtype_code"]


def test_dtype_codes_are_the_bindings_codes():
    assert _raw.dtype_code(torch.float32) == C.DTYPE_FLOAT32
    assert _raw.dtype_code(torch.bfloat16) == C.DTYPE_BFLOAT16
    assert _raw.dtype_code(torch.float16) == C.DTYPE_FLOAT16
    for bad in (torch.float64, torch.int32, torch.uint8, "float32", None, 0, [torch.float32]):
        with pytest.raises(TypeError, match=r"grad_dtype must be torch\.float32/bfloat16/float16"):
            _raw.dtype_code(bad, "grad_dtype")


@pytest.mark.parametrize("fn", WRAPPERS, ids=lambda f: f.__name__)
def test_wrappers_take_keyword_arguments_only(fn):
    params = inspect.signature(fn).parameters.values()
    assert params and all(p.kind is inspect.Parameter.KEYWORD_ONLY for p in params)
    with pytest.raises(TypeError):
        fn(*[0] * len(params))


def _hyper(step):
    return {
        "step": step,
        "lr": 2e-3,
        "beta1": 0.85,
        "beta2": 0.99,
        "eps": 1e-7,
        "weight_decay": 0.1,
        "grad_scale": 0.25,
        "seed": 11,
    }


@pytest.mark.parametrize("gdt", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("mdt", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("odt", [None, torch.float32, torch.bfloat16, torch.float16])
def test_adamw_ptr_equals_the_tensor_api(gdt, mdt, odt):
    n = 1037
    p0, grads = make_problem(n, seed=5, steps=3)
    a = [p0.clone(), torch.zeros(n, dtype=mdt), torch.zeros(n, dtype=mdt)]
    b = [t.clone() for t in a]
    out_a = None if odt is None else torch.empty(n, dtype=odt)
    out_b = None if odt is None else torch.empty(n, dtype=odt)
    for s, g in enumerate(grads):
        g = g.to(gdt)
        F.adamw_(*a[:1], g, *a[1:], out=out_a, **_hyper(s + 1))
        _raw.adamw_ptr(
            param=b[0].data_ptr(),
            grad=g.data_ptr(),
            grad_dtype=gdt,
            exp_avg=b[1].data_ptr(),
            exp_avg_sq=b[2].data_ptr(),
            moment_dtype=mdt,
            n=n,
            out=0 if out_b is None else out_b.data_ptr(),
            out_dtype=odt,
            **_hyper(s + 1),
        )
    for x, y in zip(a + [out_a], b + [out_b]):
        if x is not None:
            assert_bits_equal(x, y, "raw")


def test_adamw_ptr_fp32_is_torch_fused_and_offsets_shard_the_rounding_stream():
    n = 2 * 1024
    p0, grads = make_problem(n, seed=9, steps=4)
    p = p0.clone()
    m, v = torch.zeros(n), torch.zeros(n)
    for s, g in enumerate(grads):
        _raw.adamw_ptr(
            param=p.data_ptr(),
            grad=g.data_ptr(),
            grad_dtype=g.dtype,
            exp_avg=m.data_ptr(),
            exp_avg_sq=v.data_ptr(),
            moment_dtype=m.dtype,
            n=n,
            step=s + 1,
            lr=lr_at(s),
            beta1=0.9,
            beta2=0.999,
            eps=1e-8,
            weight_decay=1e-2,
        )
    for x, y in zip((p, m, v), torch_adamw(p0, grads, wd=1e-2, fused=True)):
        assert_bits_equal(x, y, "fused")
    # bf16 moments: two calls on halves with offsets equal one call on the whole
    whole = [p0.clone(), torch.zeros(n, dtype=torch.bfloat16), torch.zeros(n, dtype=torch.bfloat16)]
    parts = [t.clone() for t in whole]
    half = n // 2
    for s, g in enumerate(grads):
        F.adamw_(whole[0], g, whole[1], whole[2], **_hyper(s + 1))
        for start in (0, half):
            ptr = [t.data_ptr() + start * t.element_size() for t in parts]
            _raw.adamw_ptr(
                param=ptr[0],
                grad=g.data_ptr() + 4 * start,
                grad_dtype=g.dtype,
                exp_avg=ptr[1],
                exp_avg_sq=ptr[2],
                moment_dtype=torch.bfloat16,
                n=half,
                offset=start,
                **_hyper(s + 1),
            )
    for x, y in zip(whole, parts):
        assert_bits_equal(x, y, "offset")


def test_adamw_ptr_argument_errors():
    p, g, m, v = (torch.zeros(8) for _ in range(4))
    kw = {
        "param": p.data_ptr(),
        "grad": g.data_ptr(),
        "grad_dtype": torch.float32,
        "exp_avg": m.data_ptr(),
        "exp_avg_sq": v.data_ptr(),
        "moment_dtype": torch.float32,
        "n": 8,
        "step": 1,
        "lr": 1e-3,
        "beta1": 0.9,
        "beta2": 0.999,
        "eps": 1e-8,
        "weight_decay": 0.0,
    }
    with pytest.raises(TypeError, match="out_dtype must be .* when out is given"):
        _raw.adamw_ptr(**kw, out=g.data_ptr())
    with pytest.raises(TypeError, match="moment_dtype must be"):
        _raw.adamw_ptr(**(kw | {"moment_dtype": torch.float64}))
    # the kernel's own rule (ramstream/adamw_rules.h) and its message; nothing is written
    with pytest.raises(ValueError, match=r"adamw: beta1 must be a finite float in \[0, 1\), got 1$"):
        _raw.adamw_ptr(**(kw | {"beta1": 1.0}))
    with pytest.raises(ValueError, match="adamw: step must be an int >= 1, got 0"):
        _raw.adamw_ptr(**(kw | {"step": 0}))
    assert not p.any() and not m.any()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_sq_norm_and_accumulate_ptr_match_float64(dtype):
    x = torch.randn(4099, generator=torch.Generator().manual_seed(3)).to(dtype)
    want = float((x.double() ** 2).sum())
    assert _raw.sq_norm_ptr(ptr=x.data_ptr(), dtype=dtype, n=x.numel()) == pytest.approx(want, rel=1e-12)
    assert _raw.sq_norm(x=x) == _raw.sq_norm_ptr(ptr=x.data_ptr(), dtype=dtype, n=x.numel())
    dst = torch.randn(4099)
    want = dst + x.float()
    _raw.accumulate_ptr(dst=dst.data_ptr(), src=x.data_ptr(), src_dtype=dtype, n=x.numel())
    assert torch.equal(dst, want)


def test_cuda_entries_without_a_cuda_build_raise():
    if C.built_with_cuda():
        pytest.skip("this build has CUDA")
    with pytest.raises(RuntimeError, match="no CUDA support"):
        _raw.cuda_adamw_ptr(
            param=0,
            grad=0,
            grad_dtype=torch.float32,
            exp_avg=0,
            exp_avg_sq=0,
            moment_dtype=torch.float32,
            n=0,
            step=1,
            lr=1e-3,
            beta1=0.9,
            beta2=0.999,
            eps=1e-8,
            weight_decay=0.0,
            stream=0,
            device=0,
        )


@pytest.mark.cuda
@pytest.mark.parametrize("mdt", [torch.float32, torch.bfloat16])
def test_cuda_adamw_ptr_equals_the_tensor_api(mdt):
    n = 4096 + 48
    p0, grads = make_problem(n, seed=7, steps=3)
    a = [
        p0.cuda(),
        torch.zeros(n, dtype=mdt, device="cuda"),
        torch.zeros(n, dtype=mdt, device="cuda"),
        torch.empty(n, dtype=torch.bfloat16, device="cuda"),
    ]
    b = [t.clone() for t in a]
    stream = torch.cuda.current_stream().cuda_stream
    for s, g in enumerate(grads):
        g = g.to("cuda", torch.bfloat16)
        F.adamw_(a[0], g, a[1], a[2], out=a[3], **_hyper(s + 1))
        _raw.cuda_adamw_ptr(
            param=b[0].data_ptr(),
            grad=g.data_ptr(),
            grad_dtype=g.dtype,
            exp_avg=b[1].data_ptr(),
            exp_avg_sq=b[2].data_ptr(),
            moment_dtype=mdt,
            n=n,
            out=b[3].data_ptr(),
            out_dtype=torch.bfloat16,
            stream=stream,
            device=torch.cuda.current_device(),
            **_hyper(s + 1),
        )
    torch.cuda.synchronize()
    for x, y in zip(a, b):
        assert_bits_equal(x.cpu(), y.cpu(), "cuda raw")
    x = torch.randn(999, device="cuda")
    out = torch.zeros(1, dtype=torch.float64, device="cuda")
    _raw.cuda_sq_norm(x=x, out=out, stream=stream, device=x.device.index)
    _raw.cuda_sq_norm(x=x, out=out, stream=stream, device=x.device.index, accumulate=True)
    assert out.item() == pytest.approx(2 * float((x.double() ** 2).sum()), rel=1e-12)


RAW = r"(?:adamw_ptr|cuda_adamw_ptr|sq_norm_ptr|accumulate_ptr|cuda_sq_norm|sq_norm|DTYPE_\w+)"


def test_no_raw_entry_is_called_outside_the_wrappers():
    """The raw entries (and their integer dtype codes) are reached only through ops/_raw.py."""
    call = re.compile(rf"(?:lib\(\)|\bC|\b_C|\bc)\.{RAW}\b")
    codes = re.compile(r"torch\.(?:float32|bfloat16|float16)\s*:\s*[0-9]")
    offenders = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if path.name == "_raw.py":
            continue
        text = path.read_text()
        offenders += [
            f"{path.relative_to(PACKAGE)}: {m.group(0)}" for rx in (call, codes) for m in rx.finditer(text)
        ]
    assert not offenders, offenders
