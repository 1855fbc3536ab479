"""One training step under torch.profiler, for the benchmarks' --profile: the top ops by device
and by CPU time, and the step's wall time against the device's busy time (what says whether a step
is bound by the GPU or by the host issuing ops)."""

from __future__ import annotations

import time


def _sync(dev) -> None:
    import torch

    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def train_step(model, opt, x, dev) -> None:
    import torch

    with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=dev.type == "cuda"):
        loss = model(input_ids=x, labels=x).loss
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


def profiled_step(dev, step) -> dict:
    """Runs step() once under the profiler (module docstring): {"profile_wall_s", "profile_cpu",
    and on a GPU "profile_device", "profile_device_busy_s"}."""
    import torch

    acts = [torch.profiler.ProfilerActivity.CPU]
    if dev.type == "cuda":
        acts.append(torch.profiler.ProfilerActivity.CUDA)
    _sync(dev)
    with torch.profiler.profile(activities=acts) as p:
        t0 = time.perf_counter()
        step()
        _sync(dev)
        wall = time.perf_counter() - t0
    ka = p.key_averages()
    out = {"profile_wall_s": wall, "profile_cpu": ka.table(sort_by="self_cpu_time_total", row_limit=25)}
    if dev.type == "cuda":
        out["profile_device"] = ka.table(sort_by="self_device_time_total", row_limit=30)
        out["profile_device_busy_s"] = sum(e.self_device_time_total for e in ka) / 1e6
    return out
