"""GPU benchmarks of the CUDA kernels, each against a baseline timed in the same run.

- dequantize NF4 / int8 -> float32/bfloat16/float16: GB/s written, vs a pure-torch GPU
  implementation of the same spec (table lookup, broadcast multiply, cast).
- "gpu" AdamW (moments in pinned host memory, read and written by the kernel over PCIe):
  params/s and effective PCIe GB/s, vs torch.optim.AdamW(fused=True) with its state on the GPU
  (for scale: that one never touches PCIe), and vs our kernel with the moments on the GPU.

Timing: CUDA events around each call, median of repeats. Run on a GPU machine with
    pytest bench/bench_cuda_kernels.py --benchmark-enable -s     (or: python bench/bench_cuda_kernels.py)
RAMSTREAM_BENCH_SCALE multiplies the sizes (default 1: 16 Mi elements per tensor).
"""

from __future__ import annotations

import os
import statistics

import pytest
import torch

from _nf4 import NF4_TABLE

SCALE = float(os.environ.get("RAMSTREAM_BENCH_SCALE", "1"))
N = int(16 * 2**20 * SCALE) // 1024 * 1024  # a multiple of every block size used
REPEATS = int(os.environ.get("RAMSTREAM_BENCH_REPEATS", "20"))


def _gpu_ready() -> tuple[bool, str]:
    try:
        from ramstream._native import cuda_available, lib
    except ImportError as e:  # pragma: no cover
        return False, str(e)
    if not torch.cuda.is_available():
        return False, "torch sees no GPU"
    if not cuda_available():
        return False, lib().cuda_unavailable_reason()
    return True, ""


_OK, _WHY = _gpu_ready()
pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not _OK, reason=f"needs a GPU: {_WHY}")]

ROWS: dict[str, list[str]] = {"dequant": [], "adamw": []}


def cuda_time(fn, repeats: int = REPEATS, warmup: int = 3) -> float:
    """Median seconds of fn() on the current stream, timed with CUDA events."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return statistics.median(times)


# ---- baselines: the same spec in plain torch on the GPU ------------------------------------
def torch_dequant_nf4(packed, absmax, n, block, dtype, table):
    p = packed.to(torch.int64)
    codes = torch.stack((p >> 4, p & 15), dim=1).reshape(-1)[:n]
    return (table[codes].view(-1, block) * absmax[:, None]).reshape(-1).to(dtype)


def torch_dequant_int8(codes, absmax, n, block, dtype):
    scale = absmax / torch.full_like(absmax, 127.0)  # tensor / tensor: a true division
    return (codes.view(-1, block).to(torch.float32) * scale[:, None]).reshape(-1).to(dtype)


# ---- dequantization ------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("fmt", ["nf4", "int8"])
def test_bench_dequant(benchmark, fmt, dtype):
    from ramstream.ops import cuda as rc

    dev = torch.device("cuda", torch.cuda.current_device())
    block, n = 64, N
    absmax = torch.rand(n // block, device=dev) * 4
    if fmt == "nf4":
        codes = torch.randint(0, 256, (n // 2,), device=dev, dtype=torch.int32).to(torch.uint8)
        table = torch.tensor(NF4_TABLE, device=dev)
        ours = lambda: rc.dequantize_nf4(codes, absmax, (n,), dtype, block)  # noqa: E731
        base = lambda: torch_dequant_nf4(codes, absmax, n, block, dtype, table)  # noqa: E731
    else:
        codes = torch.randint(-127, 128, (n,), device=dev, dtype=torch.int32).to(torch.int8)
        ours = lambda: rc.dequantize_int8(codes, absmax, (n,), dtype, block)  # noqa: E731
        base = lambda: torch_dequant_int8(codes, absmax, n, block, dtype)  # noqa: E731
    assert torch.equal(ours(), base()), "kernel and torch baseline disagree"
    t_ours, t_base = cuda_time(ours), cuda_time(base)
    written = n * torch.tensor([], dtype=dtype).element_size()
    read = codes.numel() + absmax.numel() * 4
    gbs = written / t_ours / 1e9
    ratio = t_base / t_ours
    row = (
        f"{fmt:>5} -> {str(dtype).replace('torch.', ''):<9} n={n:>11,d}  ours {t_ours * 1e6:9.1f} us "
        f"{gbs:7.1f} GB/s written ({(written + read) / t_ours / 1e9:7.1f} GB/s r+w)  "
        f"torch {t_base * 1e6:9.1f} us {written / t_base / 1e9:7.1f} GB/s  speedup {ratio:5.2f}x"
    )
    ROWS["dequant"].append(row)
    print("\n" + row)
    benchmark.extra_info.update(gb_per_s_written=gbs, speedup_vs_torch=ratio, n=n)
    benchmark.pedantic(lambda: (ours(), torch.cuda.synchronize()), rounds=5, iterations=1)


# ---- AdamW ----------------------------------------------------------------------------------
@pytest.mark.parametrize("moment_dtype", [torch.float32, torch.bfloat16])
def test_bench_adamw(benchmark, moment_dtype):
    from ramstream.ops import cuda as rc

    dev = torch.device("cuda", torch.cuda.current_device())
    n = N
    param = torch.randn(n, device=dev)
    grad = torch.randn(n, device=dev).to(torch.bfloat16)
    out = torch.empty(n, dtype=torch.bfloat16, device=dev)
    m_host = torch.zeros(n, dtype=moment_dtype, pin_memory=True)
    v_host = torch.zeros(n, dtype=moment_dtype, pin_memory=True)
    m_dev, v_dev = (
        torch.zeros(n, dtype=moment_dtype, device=dev),
        torch.zeros(n, dtype=moment_dtype, device=dev),
    )
    hyper = dict(step=1, lr=1e-4, weight_decay=1e-2)

    t_host = cuda_time(lambda: rc.adamw_(param, grad, m_host, v_host, out=out, **hyper))
    t_dev = cuda_time(lambda: rc.adamw_(param, grad, m_dev, v_dev, out=out, **hyper))

    ref = torch.nn.Parameter(torch.randn(n, device=dev))
    ref.grad = torch.randn(n, device=dev)
    opt = torch.optim.AdamW([ref], lr=1e-4, weight_decay=1e-2, fused=True)
    t_torch = cuda_time(opt.step)

    pcie = 2 * 2 * n * torch.tensor([], dtype=moment_dtype).element_size()  # 2 moments, read + write
    name = str(moment_dtype).replace("torch.", "")
    row = (
        f"moments {name:<8} n={n:>11,d}  pinned-host {t_host * 1e3:8.2f} ms "
        f"{n / t_host / 1e9:6.2f} Gparam/s  PCIe {pcie / t_host / 1e9:6.1f} GB/s (both ways)  | "
        f"moments on GPU {t_dev * 1e3:7.2f} ms  | torch fused (GPU state) {t_torch * 1e3:7.2f} ms  "
        f"host/torch {t_host / t_torch:5.1f}x"
    )
    ROWS["adamw"].append(row)
    print("\n" + row)
    benchmark.extra_info.update(
        params_per_s=n / t_host,
        pcie_gb_per_s=pcie / t_host / 1e9,
        time_vs_torch_fused_gpu=t_host / t_torch,
        time_vs_device_moments=t_host / t_dev,
        n=n,
    )
    benchmark.pedantic(
        lambda: (rc.adamw_(param, grad, m_host, v_host, out=out, **hyper), torch.cuda.synchronize()),
        rounds=3,
        iterations=1,
    )


@pytest.fixture(scope="module", autouse=True)
def _print_tables():
    yield
    for title, rows in ROWS.items():
        if rows:
            print(f"\n== {title} (median of {REPEATS}, CUDA events) ==")
            print("\n".join(rows))


if __name__ == "__main__":
    raise SystemExit(pytest.main([__file__, "--benchmark-enable", "-s", "-q"]))
