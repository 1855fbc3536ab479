"""memory_report(model): what ramstream decided and holds for a wrapped model; EventLog, the
decision log behind its "events" (timestamped plain-text lines)."""

from __future__ import annotations

import time

import torch


class EventLog:
    def __init__(self, verbose: bool = False) -> None:
        self.verbose = verbose
        self.lines: list[str] = []
        self._t0 = time.perf_counter()

    def __call__(self, msg: str) -> None:
        line = f"[{time.perf_counter() - self._t0:8.3f}s] {msg}"
        self.lines.append(line)
        if self.verbose:
            print(f"ramstream: {msg}", flush=True)


def memory_report(model: torch.nn.Module) -> dict:
    """What ramstream decided and holds for a wrapped model: events, params, activations,
    optimizer, plan. TrainStream's keys are always there, empty or zero where ramstream lacks
    the feature: params.loads (weight paging), params.quantize."""
    w = getattr(model, "_ramstream", None)
    if w is None:
        raise ValueError("memory_report(): this model is not wrapped by ramstream")
    from .engine.refine import split_report

    e = w.optimizer._engine
    host_state = sum(
        t.nbytes for b in e.buckets for t in (b.master, b.exp_avg, b.exp_avg_sq, b.acc) if t is not None
    )
    landing = sum(b.landing.nbytes for b in e.buckets if b.landing is not None)
    stats = w.optimizer.stats()
    act = w.activations.off.stats() if w.activations is not None else {}
    return {
        "events": list(w.log.lines),
        "params": {
            "count": len(e.slots),
            "numel": sum(s.numel for s in e.slots),
            "device": str(e.device),
            "buckets": len(e.buckets),
            "bucket_numel": [b.numel for b in e.buckets],
            "paged_blocks": w.activations.off.paged if w.activations is not None else [],
            "loads": w.streamer.stats["loads"] if w.streamer is not None else 0,  # block weight loads
            "streamed_blocks": [b.index for b in w.streamer.blocks] if w.streamer is not None else [],
            "stream": dict(w.streamer.stats) if w.streamer is not None else {},
            "quantize": w.plan.get("quantize"),
        },
        "activations": {
            "packed_bytes": act.get("bytes_d2h", 0),  # saved activations paged to host, in all
            "paged_blocks": list(act.get("paged_blocks", [])),
        },
        "optimizer": {
            "mode": w.optimizer.mode,
            "gpu_updated_numel": e.mapped_numel,
            "resident": w.optimizer.resident,
            "moment_dtype": str(e.moment_dtype).replace("torch.", ""),
            "host_state_bytes": host_state,
            "landing_bytes": landing,
            "grad_bytes_offloaded": stats["grad_bytes_offloaded"],
            "stats": stats,
        },
        "plan": {
            **w.plan,
            # the blocks recomputing now (activation_checkpointing="auto" in LoRA keeps some after
            # step 1: activations/recompute_keep.py)
            **({"recompute": w.recompute.recomputed()} if w.recompute is not None else {}),
            "recompute_keep": w.keep.report() if getattr(w, "keep", None) is not None else None,
            "optimizer": {
                "resident": w.optimizer.resident,
                "buckets": {
                    where: sum(1 for b in e.buckets if (b.placement, b.streamed) == key)
                    for where, key in (
                        ("host", ("host", False)),
                        ("mapped", ("mapped", False)),
                        ("device", ("device", False)),
                        ("streamed", ("host", True)),
                    )
                },
                "moment_dtype": str(e.moment_dtype).replace("torch.", ""),
                "split": split_report(w.optimizer),  # optimizer_mode="auto" (engine/refine.py)
            },
            "history": list(w.plan.get("history", [])) + list(w.optimizer.plan_history),
            "activations": w.activations.report() if w.activations is not None else None,
            # VRAM growth after the plan settled (engine/watchdog.py)
            "watchdog": w.watchdog.report() if w.watchdog is not None else {"enabled": False},
        },
    }
