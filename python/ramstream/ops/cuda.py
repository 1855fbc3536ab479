"""CUDA kernels on torch tensors: NF4/int8 dequantization, AdamW with device or pinned-host moments, norms.

Every function runs asynchronously on torch's current stream of the tensors' device (except
``sq_norm``, which returns a Python float and therefore waits for its result). ramstream's
static CUDA runtime is pointed at that device on each call, so the functions work on any GPU
of the machine. Without a usable GPU each raises RuntimeError saying why.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from .._native import lib
from . import _checks, _raw

__all__ = ["adamw_", "dequantize_nf4", "dequantize_int8", "sq_norm", "cuda_ready"]

_ready = False  # set once CUDA has been found usable; the failure path re-checks every time


def cuda_ready(op: str) -> None:
    """Returns when ramstream's CUDA kernels can run; RuntimeError naming ``op`` and the reason
    otherwise (no CUDA in this build, no driver or GPU, torch without CUDA)."""
    global _ready
    if _ready:
        return
    c = lib()
    if not c.built_with_cuda() or c.cuda_device_count() == 0:
        raise RuntimeError(f"{op}: CUDA is not usable: {c.cuda_unavailable_reason()}")
    if not torch.cuda.is_available():
        raise RuntimeError(
            f"{op}: CUDA is not usable: this torch ({torch.__version__}) has no CUDA device "
            "(torch.cuda.is_available() is False)"
        )
    _ready = True


def _stream(device: torch.device) -> int:
    return torch.cuda.current_stream(device).cuda_stream


def _launch(on: torch.device, fn, /, *args, **kwargs):
    """Calls a binding with torch's current device set to ``on``: torch refuses to export
    (DLPack) a CUDA tensor of another device than its current one."""
    if on.index == torch.cuda.current_device():
        return fn(*args, **kwargs)
    with torch.cuda.device(on):
        return fn(*args, **kwargs)


def _require_cuda(op: str, name: str, t: torch.Tensor, device: torch.device | None = None) -> None:
    if t.device.type != "cuda":
        raise ValueError(f"{op}: {name} must be a CUDA tensor, got a tensor on {t.device}")
    if device is not None and t.device != device:
        raise ValueError(f"{op}: {name} is on {t.device}, expected {device}")


def _shape(op: str, shape) -> tuple[tuple[int, ...], int]:
    if isinstance(shape, torch.Size):
        shape = tuple(shape)
    elif not isinstance(shape, Sequence):
        shape = (shape,)
    dims = tuple(_checks.check_int(op, "shape", d, ge=0) for d in shape)
    return dims, math.prod(dims)


def _dequantize(codes, absmax, shape, dtype, block_size, *, nf4: bool) -> torch.Tensor:
    """The body of dequantize_nf4 (``nf4``: uint8 ``packed``, two codes per byte, even block size)
    and of dequantize_int8 (int8 ``codes``): checks, then the kernel on codes' current stream."""
    op, codes_name = ("dequantize_nf4", "packed") if nf4 else ("dequantize_int8", "codes")
    _checks.check_tensor(op, codes_name, codes, (torch.uint8 if nf4 else torch.int8,))
    _checks.check_tensor(op, "absmax", absmax, (torch.float32,))
    if dtype not in _checks.FLOAT_DTYPES:
        raise TypeError(f"{op}: dtype must be torch.float32/bfloat16/float16, got {dtype!r}")
    if nf4:
        block_size = _checks.check_int(op, "block_size", block_size, ge=2)
        if block_size % 2:
            raise ValueError(f"{op}: block_size must be an even int >= 2, got {block_size}")
    else:
        block_size = _checks.check_int(op, "block_size", block_size, ge=1)
    dims, n = _shape(op, shape)
    want = (n + 1) // 2 if nf4 else n
    if codes.numel() != want:
        raise ValueError(f"{op}: {codes_name} has {codes.numel()} elements, shape {dims} needs {want}")
    blocks = -(-n // block_size)
    if absmax.numel() != blocks:
        raise ValueError(
            f"{op}: absmax has {absmax.numel()} elements, shape {dims} with block_size "
            f"{block_size} needs {blocks}"
        )
    cuda_ready(op)
    _require_cuda(op, codes_name, codes)
    _require_cuda(op, "absmax", absmax, codes.device)
    out = torch.empty(dims, dtype=dtype, device=codes.device)
    kernel = lib().cuda_dequantize_nf4 if nf4 else lib().cuda_dequantize_int8
    _launch(
        codes.device,
        kernel,
        codes.detach(),
        absmax.detach(),
        out,
        block_size,
        _stream(codes.device),
        codes.device.index,
    )
    return out


def dequantize_nf4(
    packed: torch.Tensor,
    absmax: torch.Tensor,
    shape,
    dtype: torch.dtype = torch.bfloat16,
    block_size: int = 64,
) -> torch.Tensor:
    """Dequantize NF4 codes on the GPU (docs/NUMERICS.md rule 4; bit-identical to the host).

    Args:
        packed: uint8 CUDA tensor, contiguous, (n + 1) // 2 bytes: element 2j in the high nibble
            of byte j, 2j + 1 in the low nibble (bitsandbytes' layout).
        absmax: float32 CUDA tensor on packed's device, ceil(n / block_size) block maxima.
        shape: shape of the result (n = its number of elements).
        dtype: torch.float32, torch.bfloat16 or torch.float16 (rounded to nearest even).
        block_size: even int >= 2.

    Returns:
        A new tensor of ``shape`` and ``dtype`` on packed's device, written on its current stream.
    """
    return _dequantize(packed, absmax, shape, dtype, block_size, nf4=True)


def dequantize_int8(
    codes: torch.Tensor,
    absmax: torch.Tensor,
    shape,
    dtype: torch.dtype = torch.bfloat16,
    block_size: int = 64,
) -> torch.Tensor:
    """Dequantize symmetric blockwise int8 codes on the GPU (docs/NUMERICS.md rule 5; bit-identical
    to the host).

    Args:
        codes: int8 CUDA tensor, contiguous, n elements.
        absmax: float32 CUDA tensor on codes' device, ceil(n / block_size) block maxima;
            x = float(code) * (absmax / 127) in float32.
        shape: shape of the result (n = its number of elements).
        dtype: torch.float32, torch.bfloat16 or torch.float16 (rounded to nearest even).
        block_size: int >= 1.

    Returns:
        A new tensor of ``shape`` and ``dtype`` on codes' device, written on its current stream.
    """
    return _dequantize(codes, absmax, shape, dtype, block_size, nf4=False)


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
    offset: int = 0,
) -> None:
    """One AdamW step on the GPU, in place (the numerics of the host kernel, docs/NUMERICS.md rules
    2 and 3).

    Args:
        param: float32 master weights, updated in place: a CUDA tensor on grad's device, or
            pinned host memory (a mapped master the kernel reads and writes over PCIe).
        grad: float32/bfloat16/float16 CUDA tensor; multiplied by grad_scale. Its device is the
            device of the call.
        exp_avg, exp_avg_sq: float32 or bfloat16 (both the same), updated in place; either on
            param's device or in pinned host memory (``pin_memory=True``), which the kernel then
            reads and writes over PCIe ("gpu" optimizer mode; the host CPU does nothing). bfloat16
            moments are stored with stochastic rounding keyed by (seed, step, index + offset).
        step: the step being taken, >= 1 (bias correction).
        lr, beta1, beta2, eps, weight_decay: as torch.optim.AdamW (decoupled weight decay).
        grad_scale: multiplies the gradient (clipping, averaging); 1 leaves it untouched.
        out: optional float32/bfloat16/float16 CUDA tensor on param's device that receives the new
            weight (rounded to nearest even).
        seed, offset: the stochastic-rounding stream; offset is the index of element 0 in the
            whole state (shards of one state give the same result as the whole).

    All tensors are contiguous with the same number of elements. The update is queued on the
    current stream of param's device: pinned moments must not be read or written by the host
    until that stream has reached this point.
    """
    op = "adamw_"
    hp = _checks.check_adamw_hyper(
        op,
        step=step,
        lr=lr,
        beta1=beta1,
        beta2=beta2,
        eps=eps,
        weight_decay=weight_decay,
        grad_scale=grad_scale,
        seed=seed,
        offset=offset,
    )
    _checks.check_tensor(op, "param", param, (torch.float32,))
    _checks.check_tensor(op, "grad", grad, _checks.FLOAT_DTYPES)
    _checks.check_tensor(op, "exp_avg", exp_avg, _checks.MOMENT_DTYPES)
    _checks.check_tensor(op, "exp_avg_sq", exp_avg_sq, (exp_avg.dtype,))
    if out is not None:
        _checks.check_tensor(op, "out", out, _checks.FLOAT_DTYPES)
    n = param.numel()
    for name, t in (("grad", grad), ("exp_avg", exp_avg), ("exp_avg_sq", exp_avg_sq), ("out", out)):
        if t is not None and t.numel() != n:
            raise ValueError(f"{op}: {name} has {t.numel()} elements, param has {n}")
    cuda_ready(op)
    _require_cuda(op, "grad", grad)
    device = grad.device
    if out is not None:
        _require_cuda(op, "out", out, device)
    for name, t in (("param", param), ("exp_avg", exp_avg), ("exp_avg_sq", exp_avg_sq)):
        if t.device.type == "cuda":
            _require_cuda(op, name, t, device)
        elif t.device.type != "cpu":
            raise ValueError(f"{op}: {name} must be on {device} or in pinned host memory, got {t.device}")
        # pinned-ness of host tensors is checked by the binding (cudaPointerGetAttributes)
    # detach(): DLPack refuses tensors that require grad (e.g. an nn.Parameter); same storage.
    _launch(
        device,
        lib().cuda_adamw_,
        param.detach(),
        grad.detach(),
        exp_avg.detach(),
        exp_avg_sq.detach(),
        None if out is None else out.detach(),
        **hp,
        stream=_stream(device),
        device=device.index,
    )


def sq_norm(tensor: torch.Tensor) -> float:
    """Sum of squares of a float32/bfloat16/float16 CUDA tensor, accumulated in double.

    A non-contiguous tensor is read through a contiguous copy. Runs on the current stream of the
    tensor's device and waits for the result (it returns a Python float).
    """
    op = "sq_norm"
    _checks.check_tensor(op, "tensor", tensor, _checks.FLOAT_DTYPES, contiguous=False)
    cuda_ready(op)
    _require_cuda(op, "tensor", tensor)
    x = tensor.detach().contiguous()
    out = torch.empty(1, dtype=torch.float64, device=x.device)
    _launch(x.device, _raw.cuda_sq_norm, x=x, out=out, stream=_stream(x.device), device=x.device.index)
    return out.item()
