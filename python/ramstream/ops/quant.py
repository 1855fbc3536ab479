"""Blockwise NF4 (bitsandbytes' format) and symmetric int8 quantization with float32 absmax per block.

Quantization runs on the host (multithreaded C++ kernels); dequantization runs on the host, or on
the GPU when the codes are CUDA tensors. The formats are fixed in cpp/include/ramstream/quant_format.h.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Sequence

import torch

from .._native import lib

__all__ = ["quantize_nf4", "dequantize_nf4", "quantize_int8", "dequantize_int8"]

_FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_FLOAT_NAMES = "float32/bfloat16/float16"


_MAX_BLOCK = 2**31 - 1  # the kernels take an int


def _check_block_size(op: str, block_size) -> int:
    """An int (numpy ints too; bool, float and str rejected), even, in [2, 2**31)."""
    v = None
    if not isinstance(block_size, (bool, float)):
        try:
            v = operator.index(block_size)
        except TypeError:
            pass
    if v is None or v < 2 or v % 2 or v > _MAX_BLOCK:
        raise ValueError(f"{op}: block_size must be an even int in [2, 2**31), got {block_size!r}")
    return v


def _check_tensor(op: str, name: str, t, dtypes: tuple[torch.dtype, ...], dtype_names: str) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{op}: {name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in dtypes:
        raise TypeError(f"{op}: {name} must be {dtype_names}, got {t.dtype}")
    if not t.is_contiguous():
        raise ValueError(
            f"{op}: {name} must be contiguous (call {name}.contiguous() first; nothing is copied silently)"
        )


def _check_shape(op: str, shape) -> tuple[tuple[int, ...], int]:
    if not isinstance(shape, Sequence) and not isinstance(shape, bool):
        try:
            shape = (operator.index(shape),)
        except TypeError:
            pass
    if not isinstance(shape, Sequence):
        raise TypeError(f"{op}: shape must be an int or a sequence of ints, got {shape!r}")
    dims = []
    for d in shape:
        if isinstance(d, bool):
            raise TypeError(f"{op}: shape must contain ints, got {shape!r}")
        try:
            d = operator.index(d)
        except TypeError:
            raise TypeError(f"{op}: shape must contain ints, got {shape!r}") from None
        if d < 0:
            raise ValueError(f"{op}: shape must not contain negative sizes, got {tuple(shape)}")
        dims.append(d)
    return tuple(dims), math.prod(dims)


def _check_out_dtype(op: str, dtype) -> None:
    if dtype not in _FLOAT_DTYPES:
        raise TypeError(f"{op}: dtype must be torch.{_FLOAT_NAMES.replace('/', '/torch.')}, got {dtype!r}")


def _check_host_input(op: str, x: torch.Tensor) -> None:
    if x.device.type != "cpu":
        raise ValueError(f"{op}: quantization runs on the host, but x is on {x.device} (pass x.cpu())")


def _check_absmax(op: str, absmax, codes: torch.Tensor, n: int, block_size: int) -> None:
    _check_tensor(op, "absmax", absmax, (torch.float32,), "float32")
    if absmax.device != codes.device:
        raise ValueError(
            f"{op}: absmax must be on the same device as the codes ({codes.device}), got {absmax.device}"
        )
    blocks = -(-n // block_size)
    if absmax.numel() != blocks:
        raise ValueError(
            f"{op}: absmax has {absmax.numel()} entries, expected {blocks} "
            f"(ceil({n} / block_size={block_size}))"
        )


def _dequantize(codes, absmax, shape, dtype, block_size, *, nf4: bool) -> torch.Tensor:
    """The body of dequantize_nf4 (``nf4``: uint8 ``packed``, two codes per byte) and of
    dequantize_int8 (int8 ``codes``): checks, then the host kernel, or the CUDA one (ops/cuda.py)
    when the codes are CUDA tensors."""
    op = "dequantize_nf4" if nf4 else "dequantize_int8"
    block_size = _check_block_size(op, block_size)
    dims, n = _check_shape(op, shape)
    _check_out_dtype(op, dtype)
    if nf4:
        name, want, unit, why = "packed", (n + 1) // 2, "bytes", f"ceil({n} / 2) for shape {dims}"
        _check_tensor(op, name, codes, (torch.uint8,), "uint8")
    else:
        name, want, unit, why = "codes", n, "elements", f"shape {dims}"
        _check_tensor(op, name, codes, (torch.int8,), "int8")
    if codes.numel() != want:
        raise ValueError(f"{op}: {name} has {codes.numel()} {unit}, expected {want} ({why})")
    _check_absmax(op, absmax, codes, n, block_size)
    if codes.is_cuda:
        from . import cuda as _cuda  # noqa: PLC0415

        gpu = _cuda.dequantize_nf4 if nf4 else _cuda.dequantize_int8
        return gpu(codes, absmax, dims, dtype, block_size)
    if codes.device.type != "cpu":
        raise ValueError(f"{op}: {name} must be a CPU or CUDA tensor, got {codes.device}")
    out = torch.empty(dims, dtype=dtype)
    host = lib().dequantize_nf4 if nf4 else lib().dequantize_int8
    host(codes, absmax, out, block_size)
    return out


def quantize_nf4(x: torch.Tensor, block_size: int = 64) -> tuple[torch.Tensor, torch.Tensor]:
    """NF4-quantize a host tensor in blocks of ``block_size`` consecutive elements.

    Args:
        x: CPU tensor (float32, bfloat16 or float16), contiguous, any shape; n = x.numel().
            Read only; flattened in row-major order.
        block_size: even int >= 2 (bitsandbytes' default 64).

    Returns:
        ``(packed, absmax)``: packed is a new 1-D uint8 CPU tensor of ceil(n / 2) bytes, two codes
        per byte (element 2j in the high nibble, 2j+1 in the low one; odd n pads a 0.0 code);
        absmax is a new 1-D float32 CPU tensor of ceil(n / block_size) block maxima of |x|.
        Bit-identical to ``bitsandbytes.functional.quantize_4bit(x, blocksize=block_size,
        quant_type="nf4")`` (whose packed output is ``packed.view(-1, 1)``).

    Raises:
        TypeError: x is not a float32/bfloat16/float16 tensor.
        ValueError: bad block_size, non-contiguous x, or x on a GPU (quantization runs on the
            host: pass ``x.cpu()``).
    """
    op = "quantize_nf4"
    block_size = _check_block_size(op, block_size)
    _check_tensor(op, "x", x, _FLOAT_DTYPES, _FLOAT_NAMES)
    _check_host_input(op, x)
    n = x.numel()
    packed = torch.empty((n + 1) // 2, dtype=torch.uint8)
    absmax = torch.empty(-(-n // block_size), dtype=torch.float32)
    lib().quantize_nf4(x.detach(), packed, absmax, block_size)
    return packed, absmax


def dequantize_nf4(
    packed: torch.Tensor,
    absmax: torch.Tensor,
    shape,
    dtype: torch.dtype = torch.bfloat16,
    block_size: int = 64,
) -> torch.Tensor:
    """Rebuild a tensor of ``shape`` from NF4 codes: ``code_table[q] * absmax[block]`` in float32,
    rounded to nearest even into ``dtype``.

    Args:
        packed: uint8 tensor with ceil(n / 2) elements (any shape, e.g. bitsandbytes' (n/2, 1)),
            contiguous, n = prod(shape); CPU, or CUDA to run the CUDA kernel.
        absmax: float32 tensor with ceil(n / block_size) elements, contiguous, same device.
        shape: int or sequence of ints, the shape of the result.
        dtype: torch.float32, torch.bfloat16 or torch.float16.
        block_size: the block size used to quantize (even int >= 2).

    Returns:
        A new contiguous tensor of ``shape`` and ``dtype`` on packed's device.
    """
    return _dequantize(packed, absmax, shape, dtype, block_size, nf4=True)


def quantize_int8(x: torch.Tensor, block_size: int = 64) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric int8 quantization of a host tensor in blocks of ``block_size`` elements.

    ``q = round_half_even((x / absmax) * 127)`` per element (0 for an all-zero block).

    Args:
        x: CPU tensor (float32, bfloat16 or float16), contiguous, any shape; n = x.numel().
        block_size: even int >= 2.

    Returns:
        ``(codes, absmax)``: codes is a new int8 CPU tensor of x's shape with values in
        [-127, 127]; absmax a new 1-D float32 CPU tensor of ceil(n / block_size) block maxima.

    Raises:
        TypeError: bad dtype. ValueError: bad block_size, non-contiguous x, or x on a GPU.
    """
    op = "quantize_int8"
    block_size = _check_block_size(op, block_size)
    _check_tensor(op, "x", x, _FLOAT_DTYPES, _FLOAT_NAMES)
    _check_host_input(op, x)
    codes = torch.empty(x.shape, dtype=torch.int8)
    absmax = torch.empty(-(-x.numel() // block_size), dtype=torch.float32)
    lib().quantize_int8(x.detach(), codes, absmax, block_size)
    return codes, absmax


def quantize_into_(
    fmt: str, x: torch.Tensor, codes: torch.Tensor, absmax: torch.Tensor, block_size: int
) -> None:
    """Quantizes host ``x`` (n elements) into given outputs, as quantize_nf4 / quantize_int8 would
    make them: ``fmt`` "nf4": ``codes`` uint8 of ceil(n / 2) bytes; "int8": int8 of n elements;
    ``absmax`` float32 of ceil(n / block_size). All contiguous CPU tensors. Slices of one larger
    tensor's outputs may be filled piece by piece: blocks are independent, so a piece that starts
    at a multiple of block_size gets the same bytes as the whole. Releases the GIL; thread-safe
    (concurrent calls share the host thread pool, one after another)."""
    op = "quantize_nf4" if fmt == "nf4" else "quantize_int8"
    block_size = _check_block_size(op, block_size)
    _check_tensor(op, "x", x, _FLOAT_DTYPES, _FLOAT_NAMES)
    _check_host_input(op, x)
    want = torch.uint8 if fmt == "nf4" else torch.int8
    _check_tensor(op, "codes", codes, (want,), str(want).removeprefix("torch."))
    _check_tensor(op, "absmax", absmax, (torch.float32,), "float32")
    (lib().quantize_nf4 if fmt == "nf4" else lib().quantize_int8)(x.detach(), codes, absmax, block_size)


def dequantize_int8(
    codes: torch.Tensor,
    absmax: torch.Tensor,
    shape,
    dtype: torch.dtype = torch.bfloat16,
    block_size: int = 64,
) -> torch.Tensor:
    """Rebuild a tensor of ``shape`` from int8 codes: ``float(q) * (absmax / 127)`` in float32,
    rounded to nearest even into ``dtype``.

    Args:
        codes: int8 tensor with n = prod(shape) elements, contiguous; CPU, or CUDA to run the CUDA
            kernel.
        absmax: float32 tensor with ceil(n / block_size) elements, contiguous, same device.
        shape: int or sequence of ints, the shape of the result.
        dtype: torch.float32, torch.bfloat16 or torch.float16.
        block_size: the block size used to quantize (even int >= 2).

    Returns:
        A new contiguous tensor of ``shape`` and ``dtype`` on codes' device.
    """
    return _dequantize(codes, absmax, shape, dtype, block_size, nf4=False)
