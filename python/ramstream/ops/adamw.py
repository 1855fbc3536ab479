"""Host AdamW (fp32 or bf16 moments), gradient accumulation and squared norms on tensors.

CPU tensors run the multithreaded C++ kernels of ``ramstream._C``; CUDA tensors are handed to
``ramstream.ops.cuda`` where a CUDA kernel exists. Every function validates its arguments first
and raises ValueError/TypeError naming the bad one; in-place arguments are never copied.
"""

from __future__ import annotations

import torch

from .._native import lib
from . import _raw
from ._checks import bump_version, check_adamw_hyper, check_no_overlap

__all__ = ["adamw_", "sq_norm", "accumulate_"]

_GRAD_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_MOMENT_DTYPES = (torch.float32, torch.bfloat16)
_OUT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _names(dtypes) -> str:
    return "/".join(str(d).replace("torch.", "") for d in dtypes)


def _tensor(op: str, name: str, x) -> torch.Tensor:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{op}: {name} must be a torch.Tensor, got {type(x).__name__}")
    return x


def _dtype(op: str, name: str, x: torch.Tensor, allowed) -> None:
    if x.dtype not in allowed:
        raise TypeError(f"{op}: {name} must be {_names(allowed)}, got {x.dtype}")


def _numel(op: str, name: str, x: torch.Tensor, n: int, ref: str) -> None:
    if x.numel() != n:
        raise ValueError(
            f"{op}: {name} must have the same number of elements as {ref} ({n}), got {x.numel()}"
        )


def _host(op: str, name: str, x: torch.Tensor) -> None:
    if x.device.type != "cpu":
        raise ValueError(f"{op}: {name} must be a CPU tensor, got device {x.device}")


def _contiguous(op: str, name: str, x: torch.Tensor) -> None:
    if not x.is_contiguous():
        raise ValueError(
            f"{op}: {name} must be contiguous (it is written in place and never copied; "
            "call .contiguous() on the storage you keep)"
        )


def adamw_(
    param: torch.Tensor,
    grad: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    *,
    step: int,
    lr: float,
    beta1: float = 0.9,
    beta2: float = 0.999,
    eps: float = 1e-8,
    weight_decay: float = 1e-2,
    grad_scale: float = 1.0,
    out: torch.Tensor | None = None,
    seed: int = 0,
) -> None:
    """One AdamW step, in place, on flat state of any shape (all tensors have the same numel).

    Args:
        param: float32, updated in place (contiguous).
        grad: float32, bfloat16 or float16; read only (a non-contiguous grad is copied first).
        exp_avg, exp_avg_sq: both float32 or both bfloat16, updated in place (contiguous).
            bfloat16 moments are stored with stochastic rounding keyed by (seed, step, element
            index, moment): deterministic for a given seed, unbiased on average.
        step: the step being taken (>= 1); drives bias correction and the rounding stream.
        lr, beta1, beta2, eps, weight_decay: as torch.optim.AdamW (decoupled weight decay).
        grad_scale: multiplies the gradient before the update (clipping or averaging); 1 skips it.
        out: None, or a contiguous float32/bfloat16/float16 tensor that receives the new param
            (round to nearest even), written in the same pass. On the CPU it may be ``grad``
            itself when the dtypes match (the new weights overwrite the gradient, as the engine
            does); any other overlap between the tensors raises ValueError.
        seed: 0 <= seed < 2**64, the stochastic-rounding seed.

    With float32 state on the CPU the result is bit-identical to
    ``torch.optim.AdamW(fused=True)`` (torch 2.13, see ramstream/adamw.h), for every ISA and
    thread count. CPU tensors run on ramstream's host thread pool with the GIL released; if
    ``param`` is a CUDA tensor the call goes to ``ramstream.ops.cuda.adamw_`` (same arguments).
    """
    op = "adamw_"
    for name, x in (("param", param), ("grad", grad), ("exp_avg", exp_avg), ("exp_avg_sq", exp_avg_sq)):
        _tensor(op, name, x)
    hp = check_adamw_hyper(
        op,
        step=step,
        lr=lr,
        beta1=beta1,
        beta2=beta2,
        eps=eps,
        weight_decay=weight_decay,
        grad_scale=grad_scale,
        seed=seed,
    )
    del hp["offset"]  # the tensor API starts the rounding stream at element 0
    _dtype(op, "param", param, (torch.float32,))
    _dtype(op, "grad", grad, _GRAD_DTYPES)
    _dtype(op, "exp_avg", exp_avg, _MOMENT_DTYPES)
    if exp_avg_sq.dtype != exp_avg.dtype:
        raise TypeError(
            f"{op}: exp_avg_sq must have exp_avg's dtype ({exp_avg.dtype}), got {exp_avg_sq.dtype}"
        )
    n = param.numel()
    _numel(op, "grad", grad, n, "param")
    _numel(op, "exp_avg", exp_avg, n, "param")
    _numel(op, "exp_avg_sq", exp_avg_sq, n, "param")
    if out is not None:
        _tensor(op, "out", out)
        _dtype(op, "out", out, _OUT_DTYPES)
        _numel(op, "out", out, n, "param")
    check_no_overlap(
        op,
        (("param", param), ("grad", grad), ("exp_avg", exp_avg), ("exp_avg_sq", exp_avg_sq), ("out", out)),
        same_ok=(("grad", "out"),),
    )

    if param.device.type == "cuda":
        from . import cuda as _cuda  # noqa: PLC0415

        _cuda.adamw_(param, grad, exp_avg, exp_avg_sq, out=out, **hp)
        bump_version(param, exp_avg, exp_avg_sq, out)
        return None

    written = [("param", param), ("exp_avg", exp_avg), ("exp_avg_sq", exp_avg_sq)]
    if out is not None:
        written.append(("out", out))
    for name, x in written:
        _host(op, name, x)
        _contiguous(op, name, x)
    _host(op, "grad", grad)
    lib().adamw_(
        param.detach(),
        grad.detach().contiguous(),
        exp_avg.detach(),
        exp_avg_sq.detach(),
        None if out is None else out.detach(),
        offset=0,
        **hp,
    )
    bump_version(param, exp_avg, exp_avg_sq, out)
    return None


def sq_norm(tensor: torch.Tensor) -> float:
    """Sum of squares of ``tensor`` (float32/bfloat16/float16, any shape) as a Python float.

    On the CPU: squares and sums in double on the host thread pool (GIL released); the result is
    the same for every ISA and thread count. A CUDA tensor goes to ``ramstream.ops.cuda.sq_norm``.
    """
    op = "sq_norm"
    _tensor(op, "tensor", tensor)
    _dtype(op, "tensor", tensor, _GRAD_DTYPES)
    if tensor.device.type == "cuda":
        from . import cuda as _cuda  # noqa: PLC0415

        return _cuda.sq_norm(tensor)
    _host(op, "tensor", tensor)
    return float(_raw.sq_norm(x=tensor.contiguous()))


def accumulate_(dst: torch.Tensor, src: torch.Tensor) -> None:
    """``dst += src`` in place, element by element in float32 (gradient accumulation).

    dst: float32, contiguous; src: float32/bfloat16/float16 with the same numel (any shape).
    CPU tensors use the host kernels (GIL released); CUDA tensors (both on the same device) use
    torch's ``add_``, which computes the same float32 sums.
    """
    op = "accumulate_"
    _tensor(op, "dst", dst)
    _tensor(op, "src", src)
    _dtype(op, "dst", dst, (torch.float32,))
    _dtype(op, "src", src, _GRAD_DTYPES)
    _numel(op, "src", src, dst.numel(), "dst")
    _contiguous(op, "dst", dst)
    check_no_overlap(op, (("dst", dst), ("src", src)), same_ok=(("dst", "src"),))
    if dst.device.type == "cuda":
        if src.device != dst.device:
            raise ValueError(f"{op}: src must be on dst's device ({dst.device}), got {src.device}")
        with torch.no_grad():
            dst.view(-1).add_(src.reshape(-1))
        return None
    _host(op, "dst", dst)
    _host(op, "src", src)
    lib().accumulate_(dst.detach(), src.detach().contiguous())
    bump_version(dst)
    return None
