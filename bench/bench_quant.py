"""Host NF4 / int8 quantize and dequantize throughput: ramstream's kernels vs a vectorized
pure-torch implementation of the same spec, measured in the same run (ratio = torch / ramstream time).

Run: pytest bench/bench_quant.py --benchmark-only   (RAMSTREAM_BENCH_ELEMS scales the size,
default 64M elements; RAMSTREAM_BENCH_ROUNDS the timed rounds, default 5)."""

from __future__ import annotations

import os
import time

import pytest
import torch

import ramstream.functional as rf
from ramstream._native import lib

from _nf4 import NF4_TABLE

N = int(float(os.environ.get("RAMSTREAM_BENCH_ELEMS", 64 * 2**20)))
ROUNDS = int(os.environ.get("RAMSTREAM_BENCH_ROUNDS", 5))
BLOCK = 64

NF4_CODE = torch.tensor(NF4_TABLE)
NF4_MID = (NF4_CODE[:-1] + NF4_CODE[1:]) / 2


# ---- the baseline: the spec in vectorized torch (n a multiple of the block) -------------------------


def torch_quantize_nf4(x):
    xb = x.view(-1, BLOCK).float()
    absmax = xb.abs().amax(dim=1)
    s = (xb * (1.0 / absmax.clamp(min=1e-38)).unsqueeze(1)).clamp_(-1, 1)
    q = torch.bucketize(s, NF4_MID, out_int32=True).to(torch.uint8)
    return ((q[:, 0::2] << 4) | q[:, 1::2]).view(-1), absmax


def torch_dequantize_nf4(packed, absmax, dtype):
    q = torch.stack([packed >> 4, packed & 15], dim=1).view(-1, BLOCK).long()
    return (NF4_CODE[q] * absmax.unsqueeze(1)).to(dtype).view(-1)


def torch_quantize_int8(x):
    xb = x.view(-1, BLOCK).float()
    absmax = xb.abs().amax(dim=1)
    q = torch.round((xb / absmax.unsqueeze(1)) * 127.0).nan_to_num_(0.0)
    return q.to(torch.int8).view(-1), absmax


def torch_dequantize_int8(codes, absmax, dtype):
    return (codes.view(-1, BLOCK).float() * (absmax / 127.0).unsqueeze(1)).to(dtype).view(-1)


# ---- fixtures and the measuring helper ----------------------------------------------------------


@pytest.fixture(scope="module")
def inputs():
    assert N % BLOCK == 0, "RAMSTREAM_BENCH_ELEMS must be a multiple of 64"
    x = torch.randn(N, generator=torch.Generator().manual_seed(0))
    return {torch.float32: x, torch.bfloat16: x.to(torch.bfloat16)}


def _best_time(fn, rounds):
    fn()  # warm-up
    best = float("inf")
    for _ in range(rounds):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best


def _measure(benchmark, capsys, name, ours, baseline, nbytes, kernel=None):
    """Times `ours` (the public API, which allocates its outputs like the torch baseline) with
    pytest-benchmark, the baseline in the same run, and optionally `kernel`: the same work into
    preallocated outputs (no page faults on fresh memory)."""
    benchmark.pedantic(ours, rounds=ROUNDS, warmup_rounds=1, iterations=1)
    t_ours = benchmark.stats.stats.min
    t_torch = _best_time(baseline, max(1, ROUNDS // 2))
    t_kernel = _best_time(kernel, ROUNDS) if kernel is not None else None
    ratio = t_torch / t_ours
    benchmark.extra_info.update(
        elements=N,
        bytes=nbytes,
        isa=lib().active_isa(),
        threads=lib().num_threads(),
        torch_threads=torch.get_num_threads(),
        ramstream_GBps=nbytes / t_ours / 1e9,
        ramstream_Gelem_per_s=N / t_ours / 1e9,
        torch_GBps=nbytes / t_torch / 1e9,
        torch_Gelem_per_s=N / t_torch / 1e9,
        speedup_vs_torch=ratio,
    )
    kernel_txt = ""
    if t_kernel is not None:
        benchmark.extra_info.update(kernel_reused_out_GBps=nbytes / t_kernel / 1e9)
        kernel_txt = f" | kernel, reused out {nbytes / t_kernel / 1e9:7.2f} GB/s"
    with capsys.disabled():
        print(
            f"\n{name:24s} N={N} ramstream {nbytes / t_ours / 1e9:6.2f} GB/s "
            f"({N / t_ours / 1e9:5.3f} Gelem/s) | torch {nbytes / t_torch / 1e9:6.2f} GB/s "
            f"({N / t_torch / 1e9:5.3f} Gelem/s) | ratio {ratio:6.2f}x{kernel_txt} "
            f"[{lib().active_isa()}, {lib().num_threads()} threads]"
        )


DTYPES = [torch.float32, torch.bfloat16]
IDS = ["fp32", "bf16"]


@pytest.mark.parametrize("dtype", DTYPES, ids=IDS)
def test_quantize_nf4(benchmark, capsys, inputs, dtype):
    x = inputs[dtype]
    ours = rf.quantize_nf4(x, block_size=BLOCK)
    ref = torch_quantize_nf4(x)
    assert torch.equal(ours[0], ref[0]) and torch.equal(ours[1], ref[1])  # same spec, same bytes
    del ours, ref
    packed, absmax = torch.empty(N // 2, dtype=torch.uint8), torch.empty(N // BLOCK)
    _measure(
        benchmark,
        capsys,
        f"quantize_nf4 {dtype}",
        lambda: rf.quantize_nf4(x, block_size=BLOCK),
        lambda: torch_quantize_nf4(x),
        x.numel() * x.element_size(),
        lambda: lib().quantize_nf4(x, packed, absmax, BLOCK),
    )


@pytest.mark.parametrize("dtype", DTYPES, ids=IDS)
def test_dequantize_nf4(benchmark, capsys, inputs, dtype):
    packed, absmax = rf.quantize_nf4(inputs[torch.float32], block_size=BLOCK)
    out = torch.empty(N, dtype=dtype)
    assert torch.equal(
        rf.dequantize_nf4(packed, absmax, (N,), dtype, block_size=BLOCK),
        torch_dequantize_nf4(packed, absmax, dtype),
    )
    _measure(
        benchmark,
        capsys,
        f"dequantize_nf4 {dtype}",
        lambda: rf.dequantize_nf4(packed, absmax, (N,), dtype, block_size=BLOCK),
        lambda: torch_dequantize_nf4(packed, absmax, dtype),
        N * dtype.itemsize,
        lambda: lib().dequantize_nf4(packed, absmax, out, BLOCK),
    )


@pytest.mark.parametrize("dtype", DTYPES, ids=IDS)
def test_quantize_int8(benchmark, capsys, inputs, dtype):
    x = inputs[dtype]
    ours = rf.quantize_int8(x, block_size=BLOCK)
    ref = torch_quantize_int8(x)
    assert torch.equal(ours[0], ref[0]) and torch.equal(ours[1], ref[1])
    del ours, ref
    codes, absmax = torch.empty(N, dtype=torch.int8), torch.empty(N // BLOCK)
    _measure(
        benchmark,
        capsys,
        f"quantize_int8 {dtype}",
        lambda: rf.quantize_int8(x, block_size=BLOCK),
        lambda: torch_quantize_int8(x),
        x.numel() * x.element_size(),
        lambda: lib().quantize_int8(x, codes, absmax, BLOCK),
    )


@pytest.mark.parametrize("dtype", DTYPES, ids=IDS)
def test_dequantize_int8(benchmark, capsys, inputs, dtype):
    codes, absmax = rf.quantize_int8(inputs[torch.float32], block_size=BLOCK)
    out = torch.empty(N, dtype=dtype)
    assert torch.equal(
        rf.dequantize_int8(codes, absmax, (N,), dtype, block_size=BLOCK),
        torch_dequantize_int8(codes, absmax, dtype),
    )
    _measure(
        benchmark,
        capsys,
        f"dequantize_int8 {dtype}",
        lambda: rf.dequantize_int8(codes, absmax, (N,), dtype, block_size=BLOCK),
        lambda: torch_dequantize_int8(codes, absmax, dtype),
        N * dtype.itemsize,
        lambda: lib().dequantize_int8(codes, absmax, out, BLOCK),
    )
