"""Typed wrappers over ramstream._C's raw entry points (addresses, sizes, streams); their only caller.

Every wrapper takes keyword arguments only and torch dtypes, which it maps to ``_C.DTYPE_*``
(TypeError naming the argument for any other dtype). Beyond that nothing is checked here: the
caller (the engine) guarantees that each address is valid for ``n`` elements of its dtype, on the
side the entry needs (host memory for the host entries; device-accessible memory for the CUDA
ones) and that buffers do not overlap except where an entry allows it. The kernels themselves
validate hyper-parameters (``ramstream/adamw_rules.h``) and raise ValueError. All of them release
the GIL while they run; the CUDA entries are asynchronous on ``stream`` (an integer
``cudaStream_t``) of ``device``.
"""

from __future__ import annotations

import torch

from .._native import lib

__all__ = [
    "accumulate_ptr",
    "adamw_ptr",
    "cuda_adamw_ptr",
    "cuda_sq_norm",
    "dtype_code",
    "sq_norm",
    "sq_norm_ptr",
]

_codes: dict = {}


def _load_codes() -> dict:
    c = lib()
    _codes.update(
        {torch.float32: c.DTYPE_FLOAT32, torch.bfloat16: c.DTYPE_BFLOAT16, torch.float16: c.DTYPE_FLOAT16}
    )
    return _codes


def dtype_code(dtype: torch.dtype, name: str = "dtype") -> int:
    """The ``_C.DTYPE_*`` code of a float32/bfloat16/float16 dtype."""
    try:
        return (_codes or _load_codes())[dtype]
    except (KeyError, TypeError):
        raise TypeError(f"ramstream: {name} must be torch.float32/bfloat16/float16, got {dtype!r}") from None


def _adamw_codes(grad_dtype, moment_dtype, out, out_dtype) -> tuple[int, int, int]:
    """The codes of the three dtypes (out's 0 when there is no out), in one lookup each: these
    wrappers run once per parameter and step."""
    try:
        codes = _codes or _load_codes()
        return codes[grad_dtype], codes[moment_dtype], codes[out_dtype] if out else 0
    except (KeyError, TypeError):
        pass
    if out and out_dtype is None:
        raise TypeError(
            "ramstream: out_dtype must be torch.float32/bfloat16/float16 when out is given, got None"
        )
    return (
        dtype_code(grad_dtype, "grad_dtype"),
        dtype_code(moment_dtype, "moment_dtype"),
        dtype_code(out_dtype, "out_dtype") if out else 0,
    )


def adamw_ptr(
    *,
    param: int,
    grad: int,
    grad_dtype: torch.dtype,
    exp_avg: int,
    exp_avg_sq: int,
    moment_dtype: torch.dtype,
    n: int,
    step: int,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    grad_scale: float = 1.0,
    seed: int = 0,
    offset: int = 0,
    out: int = 0,
    out_dtype: torch.dtype | None = None,
) -> None:
    """Host AdamW on raw host addresses: ``param`` float32 (n elements), ``grad`` of grad_dtype,
    the moments both of moment_dtype, ``out`` (0: none) receives the new weight in out_dtype
    (it may be ``grad`` itself when the dtypes match). ``offset`` is the index of element 0 in the
    whole state (stochastic rounding of bf16 moments). Numerics of ``ramstream.ops.adamw.adamw_``.
    Runs on the host thread pool, GIL released."""
    g, m, o = _adamw_codes(grad_dtype, moment_dtype, out, out_dtype)
    lib().adamw_ptr(
        param,
        grad,
        g,
        exp_avg,
        exp_avg_sq,
        m,
        out,
        o,
        n,
        offset,
        lr,
        beta1,
        beta2,
        eps,
        weight_decay,
        step,
        grad_scale,
        seed,
    )


def cuda_adamw_ptr(
    *,
    param: int,
    grad: int,
    grad_dtype: torch.dtype,
    exp_avg: int,
    exp_avg_sq: int,
    moment_dtype: torch.dtype,
    n: int,
    step: int,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    stream: int,
    device: int,
    grad_scale: float = 1.0,
    seed: int = 0,
    offset: int = 0,
    out: int = 0,
    out_dtype: torch.dtype | None = None,
) -> None:
    """CUDA AdamW on device-accessible addresses (VRAM, or mapped pinned host memory), the same
    arguments as ``adamw_ptr`` plus ``stream`` and ``device`` (its index); queued on ``stream``."""
    g, m, o = _adamw_codes(grad_dtype, moment_dtype, out, out_dtype)
    lib().cuda_adamw_ptr(
        param,
        grad,
        g,
        exp_avg,
        exp_avg_sq,
        m,
        out,
        o,
        n,
        offset,
        lr,
        beta1,
        beta2,
        eps,
        weight_decay,
        step,
        grad_scale,
        seed,
        stream,
        device,
    )


def sq_norm_ptr(*, ptr: int, dtype: torch.dtype, n: int) -> float:
    """Sum of squares of ``n`` host elements of ``dtype`` at ``ptr``, accumulated in double."""
    return lib().sq_norm_ptr(ptr, dtype_code(dtype), n)


def accumulate_ptr(*, dst: int, src: int, src_dtype: torch.dtype, n: int) -> None:
    """``dst[i] += float(src[i])`` for ``n`` host elements: dst float32, src of src_dtype."""
    lib().accumulate_ptr(dst, src, dtype_code(src_dtype, "src_dtype"), n)


def sq_norm(*, x: torch.Tensor) -> float:
    """Sum of squares of a contiguous host float32/bfloat16/float16 tensor, in double."""
    return lib().sq_norm(x.detach())


def cuda_sq_norm(
    *, x: torch.Tensor, out: torch.Tensor, stream: int, device: int, accumulate: bool = False
) -> None:
    """``out[0]`` (1-element float64 CUDA tensor) = (or += with ``accumulate``) the sum of squares
    of the contiguous CUDA tensor ``x``, in double; queued on ``stream`` of ``device``."""
    lib().cuda_sq_norm(x.detach(), out, accumulate=accumulate, stream=stream, device=device)
