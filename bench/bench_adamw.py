"""Host AdamW throughput, side by side with torch.optim.AdamW on the CPU in the same run.

    pytest bench/bench_adamw.py --benchmark-only -s

(a) fp32 everything: ramstream vs torch fused=True (the baseline) and foreach=True;
(b) mixed: bf16 grads in, bf16 moments (stochastic rounding), bf16 weights out, vs the same
    torch fused fp32 baseline; once with a separate `out` buffer (written with non-temporal
    stores) and once engine-style, `out` being the grad buffer itself (the engine's call).
Size: RAMSTREAM_BENCH_PARAMS (default 16M; 256M on the GPU box).
GB/s counts the state each step must touch once (fp32: read p, g, m, v and write p, m, v =
28 B/param; mixed: read p(4) g(2) m(2) v(2), write p(4) m(2) v(2) out(2) = 20 B/param; a
separate `out` written with ordinary stores would also be read first: 22 B of traffic).
"""

from __future__ import annotations

import os

import pytest
import torch

import ramstream.functional as F
from ramstream._native import lib

N = int(float(os.environ.get("RAMSTREAM_BENCH_PARAMS", 16 * 2**20)))
ROUNDS = int(os.environ.get("RAMSTREAM_BENCH_ROUNDS", 10))
BASELINE = "torch fused fp32"
BYTES = {"fp32": 28, "mixed": 20}
_results: dict[str, tuple[float, int]] = {}  # name -> (median seconds, bytes per param)


def _run(benchmark, name: str, kind: str, fn) -> None:
    benchmark.group = f"adamw {N / 2**20:.0f}M params"
    benchmark.pedantic(fn, rounds=ROUNDS, warmup_rounds=2, iterations=1)
    t = benchmark.stats.stats.median
    _results[name] = (t, BYTES[kind])
    benchmark.extra_info.update(params_per_s=N / t, gb_per_s=N * BYTES[kind] / t / 1e9)
    if BASELINE in _results:
        benchmark.extra_info["ratio_vs_torch_fused"] = _results[BASELINE][0] / t


@pytest.fixture(scope="module", autouse=True)
def table():
    yield
    if not _results:
        return
    base = _results.get(BASELINE, (None,))[0]
    threads = f"ramstream {lib().num_threads()} threads ({lib().active_isa()}), torch {torch.get_num_threads()} threads"
    lines = [
        f"\nhost AdamW, {N:,} params, {threads}",
        f"{'implementation':<42}{'ms/step':>10}{'Gparams/s':>11}{'GB/s':>8}{'vs torch fused':>16}",
    ]
    for name, (t, b) in _results.items():
        ratio = f"{base / t:.2f}x" if base else "-"
        lines.append(f"{name:<42}{t * 1e3:>10.2f}{N / t / 1e9:>11.3f}{N * b / t / 1e9:>8.1f}{ratio:>16}")
    print("\n".join(lines))


def _fp32_state(seed: int):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(N, generator=g), torch.randn(N, generator=g) * 1e-2


def _torch_step(benchmark, name: str, **impl):
    p0, grad = _fp32_state(0)
    p = torch.nn.Parameter(p0)
    p.grad = grad
    opt = torch.optim.AdamW([p], lr=1e-3, weight_decay=1e-2, **impl)
    _run(benchmark, name, "fp32", opt.step)


def test_torch_fused_fp32(benchmark):
    _torch_step(benchmark, BASELINE, fused=True)


def test_torch_foreach_fp32(benchmark):
    _torch_step(benchmark, "torch foreach fp32", foreach=True)


def test_ramstream_fp32(benchmark):
    p, grad = _fp32_state(0)
    m, v = torch.zeros(N), torch.zeros(N)
    step = [0]

    def fn():
        step[0] += 1
        F.adamw_(p, grad, m, v, step=step[0], lr=1e-3, weight_decay=1e-2)

    _run(benchmark, "ramstream fp32", "fp32", fn)


def _mixed(benchmark, name: str, out_is_grad: bool):
    p, grad = _fp32_state(0)
    grad = grad.to(torch.bfloat16)
    m = torch.zeros(N, dtype=torch.bfloat16)
    v = torch.zeros(N, dtype=torch.bfloat16)
    out = grad if out_is_grad else torch.empty(N, dtype=torch.bfloat16)
    step = [0]

    def fn():
        step[0] += 1
        F.adamw_(p, grad, m, v, step=step[0], lr=1e-3, weight_decay=1e-2, out=out, seed=1)

    _run(benchmark, name, "mixed", fn)


def test_ramstream_mixed_bf16(benchmark):
    _mixed(benchmark, "ramstream mixed (bf16 g/m/v/out, fp32 p)", out_is_grad=False)


def test_ramstream_mixed_bf16_out_is_grad(benchmark):
    """The engine's call: the new bf16 weights overwrite the bf16 gradient they were made from."""
    _mixed(benchmark, "ramstream mixed, out = grad (engine)", out_is_grad=True)
