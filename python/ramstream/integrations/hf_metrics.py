"""The memory figures on each training log: ramstream's own (ramstream_*, ramstream_figures) and
TrainStream 0.4.1's (ts_*, TrainStreamMetrics and TrainStreamCallback, with its meanings: GiB,
traffic since the previous log), so a TrainStream user's dashboards keep their keys and scales."""

from __future__ import annotations

import torch
import transformers

from ..ops.memory import memory_stats
from ..report import host_state_bytes, memory_report

__all__ = ["ramstream_figures", "TrainStreamMetrics", "TrainStreamCallback"]

_GIB = float(1 << 30)


def _model_of(optimizer):
    ref = getattr(optimizer, "_attached_model", None)
    model = ref() if ref is not None else None
    w = getattr(model, "_ramstream", None) if model is not None else None
    return model if w is not None and w.optimizer is optimizer else None


def _device_memory(dev: torch.device) -> tuple[int, int]:
    """(allocated now, peak since torch's last reset) on a CUDA device; zeros on the CPU."""
    if dev.type != "cuda":
        return 0, 0
    return torch.cuda.memory_allocated(dev), torch.cuda.max_memory_allocated(dev)


def _transfers(optimizer) -> dict:
    """Bytes each way between device and host: memory_report(model)["transfers"] when the optimizer
    is attached to a model (gradients, weight uploads, activation paging, streamed weights), else
    the optimizer's own (gradients and weight uploads)."""
    model = _model_of(optimizer)
    if model is not None:
        return memory_report(model)["transfers"]
    s = optimizer.stats()
    return {"bytes_d2h": s["bytes_d2h"], "bytes_h2d": s["bytes_h2d"]}


def ramstream_figures(model, optimizer) -> dict[str, float]:
    """ramstream's figures, GB (1e9 bytes) and counts since training began: ramstream_vram_alloc_gb
    (device memory torch has allocated now), ramstream_vram_peak_gb (its peak since torch's last
    reset), ramstream_pinned_gb (page-locked host memory ramstream's arena holds),
    ramstream_host_state_gb (fp32 masters, moments and accumulation sums in host RAM),
    ramstream_d2h_gb / ramstream_h2d_gb (gradient bytes copied to the host / weight bytes copied
    back), ramstream_skipped_steps (steps skipped for non-finite gradients). `model` is the
    wrapped model (memory_report), `optimizer` its OffloadAdamW."""
    alloc, peak = _device_memory(optimizer._engine.device)
    rep = memory_report(model)["optimizer"]
    return {
        "ramstream_vram_alloc_gb": alloc / 1e9,
        "ramstream_vram_peak_gb": peak / 1e9,
        "ramstream_pinned_gb": memory_stats()["bytes_in_use"] / 1e9,
        "ramstream_host_state_gb": rep["host_state_bytes"] / 1e9,
        "ramstream_d2h_gb": rep["stats"]["bytes_d2h"] / 1e9,
        "ramstream_h2d_gb": rep["stats"]["bytes_h2d"] / 1e9,
        "ramstream_skipped_steps": rep["stats"]["skipped_steps"],
    }


class TrainStreamMetrics:
    """TrainStream's log figures for an OffloadAdamW, in GiB (2**30 bytes) rounded to 3 decimals,
    from ramstream's counters: collect() gives ts_vram_alloc_gb (device memory allocated now),
    ts_vram_peak_gb (peak allocation), ts_pinned_gb (page-locked host memory ramstream's arena
    holds), ts_host_state_gb (optimizer state in host RAM; 0 once resident) and, from the second
    call on, ts_d2h_gb / ts_h2d_gb (bytes copied device to host / host to device since the
    previous call). Zeros for device memory on the CPU engine (its copies are host memcpy).
    Differs from TrainStream: ts_vram_peak_gb is the peak since torch's last reset
    (torch.cuda.reset_peak_memory_stats), not since the previous call: ramstream's plan and
    watchdog read the same counter, so collect() does not reset it. Not thread-safe."""

    def __init__(self, optimizer) -> None:
        from ..optim import OffloadAdamW

        if not isinstance(optimizer, OffloadAdamW):
            raise TypeError(
                f"TrainStreamMetrics: optimizer must be a ramstream.OffloadAdamW, got {type(optimizer).__name__}"
            )
        self.opt = optimizer
        self._last: dict | None = None

    def collect(self) -> dict[str, float]:
        opt = self.opt
        out: dict[str, float] = {}
        t = _transfers(opt)
        if self._last is not None:
            for k in ("d2h", "h2d"):
                out[f"ts_{k}_gb"] = round((t[f"bytes_{k}"] - self._last[f"bytes_{k}"]) / _GIB, 3)
        self._last = t
        alloc, peak = _device_memory(opt._engine.device)
        out["ts_vram_alloc_gb"] = round(alloc / _GIB, 3)
        out["ts_vram_peak_gb"] = round(peak / _GIB, 3)
        out["ts_pinned_gb"] = round(memory_stats()["bytes_in_use"] / _GIB, 3)
        out["ts_host_state_gb"] = round(host_state_bytes(opt._engine) / _GIB, 3)
        return out


class TrainStreamCallback(transformers.TrainerCallback):
    """TrainStream's callback for a stock transformers.Trainer driving an OffloadAdamW: prints
    TrainStreamMetrics(optimizer).collect() at each log on the main process (the figures are
    not added to the log history; OffloadTrainer/TrainStreamTrainer add them to each training log).
    `metrics` is the TrainStreamMetrics."""

    def __init__(self, optimizer) -> None:
        self.metrics = TrainStreamMetrics(optimizer)

    def on_log(self, args, state, control, logs=None, **kwargs):
        if state.is_world_process_zero:
            print(self.metrics.collect())
