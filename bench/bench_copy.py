"""Benchmarks of the pinned host arena: H2D/D2H bandwidth vs torch's pinned buffers, allocation cost.

Run: pytest bench/bench_copy.py --benchmark-only -s
  RAMSTREAM_BENCH_COPY_MIB   copy size in MiB for the bandwidth benchmarks (default 256)
  RAMSTREAM_BENCH_ALLOC_MIB  largest allocation size in MiB for the allocation benchmark (default 16)
Each benchmark measures its baseline in the same run and records the ratio in extra_info.
"""

from __future__ import annotations

import os
import statistics
import time

import pytest
import torch

import ramstream
from ramstream._native import cuda_available, lib

MiB = 1 << 20
COPY_BYTES = int(float(os.environ.get("RAMSTREAM_BENCH_COPY_MIB", "256")) * MiB)
ALLOC_MAX = int(float(os.environ.get("RAMSTREAM_BENCH_ALLOC_MIB", "16")) * MiB)
ALLOC_SIZES = sorted({4096, 1 * MiB, ALLOC_MAX})

needs_gpu = pytest.mark.skipif(
    not (torch.cuda.is_available() and cuda_available()), reason="needs a GPU and a CUDA build"
)


def _median_seconds(fn, reps: int, inner: int = 1) -> float:
    """Median over `reps` runs of the wall time of `inner` calls of fn, per call."""
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        for _ in range(inner):
            fn()
        times.append((time.perf_counter() - t0) / inner)
    return statistics.median(times)


# ---- allocation cost (runs everywhere) ----------------------------------------------------------


@pytest.mark.parametrize("nbytes", ALLOC_SIZES, ids=lambda n: f"{n // 1024}KiB")
def test_alloc_arena_vs_torch_empty(benchmark, nbytes):
    """pinned_empty (the block is freed and reused each round) vs torch.empty(pin_memory=False)."""
    for _ in range(10):  # warm the arena's cache and the allocator
        ramstream.pinned_empty(nbytes, torch.uint8)
        torch.empty(nbytes, dtype=torch.uint8)
    inner = 200
    base = _median_seconds(lambda: torch.empty(nbytes, dtype=torch.uint8), reps=15, inner=inner)
    arena = _median_seconds(lambda: ramstream.pinned_empty(nbytes, torch.uint8), reps=15, inner=inner)
    info = {
        "arena_us": arena * 1e6,
        "torch_empty_us": base * 1e6,
        "ratio_torch_over_arena": base / arena,
        "arena_pinned": bool(ramstream.memory_stats()["pinning_available"]),
    }
    if torch.cuda.is_available():
        torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        pinned = _median_seconds(
            lambda: torch.empty(nbytes, dtype=torch.uint8, pin_memory=True), reps=15, inner=inner
        )
        info["torch_pinned_us"] = pinned * 1e6
        info["ratio_torch_pinned_over_arena"] = pinned / arena
    benchmark.extra_info.update(info)
    print(
        f"\nalloc {nbytes} B: "
        + ", ".join(f"{k}={v:.3g}" if isinstance(v, float) else f"{k}={v}" for k, v in info.items())
    )
    benchmark(lambda: ramstream.pinned_empty(nbytes, torch.uint8))


# ---- H2D / D2H bandwidth (GPU) ---------------------------------------------------------------------


def _copy_gbps(dst: torch.Tensor, src: torch.Tensor, reps: int = 9) -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    for _ in range(2):
        dst.copy_(src, non_blocking=True)
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start.record()
        dst.copy_(src, non_blocking=True)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return src.numel() * src.element_size() / statistics.median(times) / 1e9


@needs_gpu
@pytest.mark.parametrize("direction", ["h2d", "d2h"])
def test_copy_bandwidth_arena_vs_torch_pinned(benchmark, direction):
    n = COPY_BYTES
    arena = ramstream.pinned_empty(n, torch.uint8)
    assert arena.is_pinned() and lib().is_arena_pinned(arena.data_ptr())
    ref = torch.empty(n, dtype=torch.uint8, pin_memory=True)
    pageable = torch.empty(n, dtype=torch.uint8)
    for t in (arena, ref, pageable):
        t.fill_(3)
    gpu = torch.empty(n, dtype=torch.uint8, device="cuda")

    def gbps(host):
        return _copy_gbps(gpu, host) if direction == "h2d" else _copy_gbps(host, gpu)

    arena_bw, ref_bw, pageable_bw = gbps(arena), gbps(ref), gbps(pageable)
    # Interleave a second round so that clock or link drift does not favour one side.
    arena_bw = max(arena_bw, gbps(arena))
    ref_bw = max(ref_bw, gbps(ref))
    info = {
        "bytes": n,
        "arena_GBps": arena_bw,
        "torch_pinned_GBps": ref_bw,
        "pageable_GBps": pageable_bw,
        "ratio_arena_over_torch_pinned": arena_bw / ref_bw,
    }
    benchmark.extra_info.update(info)
    print(
        f"\n{direction} {n / MiB:.0f} MiB: arena {arena_bw:.1f} GB/s, torch pinned {ref_bw:.1f} GB/s "
        f"(ratio {arena_bw / ref_bw:.3f}), pageable {pageable_bw:.1f} GB/s"
    )

    def one_copy():
        if direction == "h2d":
            gpu.copy_(arena, non_blocking=True)
        else:
            arena.copy_(gpu, non_blocking=True)
        torch.cuda.synchronize()

    benchmark.pedantic(one_copy, rounds=5, iterations=1, warmup_rounds=1)
