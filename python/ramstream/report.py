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


class Laps:
    """Seconds per phase of wrap() (memory_report(model)["plan"]["setup_s"]): lap(name) ends the
    phase `name` (phases may repeat)."""

    def __init__(self) -> None:
        self.t0 = self.t = time.perf_counter()
        self.laps: dict[str, float] = {}

    def __call__(self, name: str) -> None:
        now = time.perf_counter()
        self.laps[name] = self.laps.get(name, 0.0) + now - self.t
        self.t = now

    def done(self) -> dict:
        self("the rest")
        return {**{k: round(v, 3) for k, v in self.laps.items()}, "total": round(self.t - self.t0, 3)}

    def text(self) -> str:
        parts = ", ".join(f"{k} {v:.1f}" for k, v in self.laps.items() if v >= 0.05)
        return f"{self.t - self.t0:.1f} s" + (f" ({parts})" if parts else "")


def host_state_bytes(engine) -> int:
    """Bytes of the buckets' fp32 masters, moments and accumulation sums in host RAM (off the
    device: 0 once the optimizer is resident, and for buckets whose state is in VRAM; state on disk
    is not counted, nor its staging buffers: stats()["nvme_state_bytes"], ["nvme_staging_bytes"])."""
    return sum(
        t.nbytes
        for b in engine.buckets
        for t in (b.master, b.exp_avg, b.exp_avg_sq, b.acc)
        # meta: paged out to disk (disk_tier.py); a CUDA engine's "device" buckets: in VRAM
        if t is not None and t.device.type == "cpu"
    )


def _nvme(engine) -> dict | None:
    """The disk tier's figures (nvme_offload): state bytes on disk, bytes read and written in all
    and in the last step, the I/O mode and the folder; None without it."""
    disk = getattr(engine, "disk", None)
    return None if disk is None else {k.removeprefix("nvme_"): v for k, v in disk.stats().items()}


def _blocks(w) -> list:
    from .blocks import find_blocks

    if w.options.blocks is not None:
        return list(w.options.blocks)
    try:
        return find_blocks(w.model)
    except ValueError:
        return []


def _trainstream_keys(w, stats: dict, act: dict) -> dict:
    """TrainStream 0.4.1's keys with its meanings, where ramstream's own keys differ
    (docs/compat.md): params.paged_blocks are the blocks whose weights stream from host RAM,
    params.quantize the format; transfers, pinned, gpu and resident at the top."""
    from .quant.packed import is_quantized

    streamer = w.streamer
    stream = streamer.stats if streamer is not None else {}
    blocks = _blocks(w)
    quantized = [i for i, b in enumerate(blocks) if any(is_quantized(m) for m in b.modules())]
    q = w.plan.get("quantize")
    params = {
        "paged_blocks": [b.index for b in streamer.blocks] if streamer is not None else [],
        "paged_bytes": streamer.home_bytes()["streamed_bytes"] if streamer is not None else 0,
        "total_blocks": len(blocks),
        "load_bytes": stream.get("bytes_h2d", 0),
        "releases": stream.get("evictions", 0),
        "quantize": q.get("format") if isinstance(q, dict) else None,
        "quantized_blocks": quantized,
        "quantized_bytes": q.get("bytes_after", 0) if isinstance(q, dict) else 0,
    }
    d2h = stats["bytes_d2h"] + act.get("bytes_d2h", 0)
    h2d = stats["bytes_h2d"] + act.get("bytes_h2d", 0) + stream.get("bytes_h2d", 0)
    return {
        "params": params,
        "activations": {
            "offloaded_blocks": list(act.get("paged_blocks", [])),
            "total_blocks": len(blocks),
        },
        # bytes each way over the link (host memcpy on the CPU engine): gradients, weight uploads,
        # activation paging, streamed weights; copies: activation copies and block loads
        "transfers": {
            "bytes_d2h": d2h,
            "bytes_h2d": h2d,
            "copies_d2h": act.get("copies_d2h", 0),
            "copies_h2d": act.get("copies_h2d", 0) + stream.get("loads", 0),
        },
        "pinned": trainstream_pinned(),
        "gpu": _gpu(w.optimizer._engine.device),
        "resident": w.optimizer.resident,
    }


def _gpu(dev: torch.device | None) -> dict:
    cuda = dev is not None and dev.type == "cuda"
    return {
        "allocated": torch.cuda.memory_allocated(dev) if cuda else 0,
        "reserved": torch.cuda.memory_reserved(dev) if cuda else 0,
        "peak_allocated": torch.cuda.max_memory_allocated(dev) if cuda else 0,
    }


def trainstream_pinned() -> dict:
    """TrainStream's names for the pinned host arena's counters (ops.memory.memory_stats):
    live_bytes (bytes_in_use), peak_live_bytes (peak_bytes_in_use), cached_bytes (bytes_cached),
    reserved_bytes (bytes_pinned), host_alloc_calls / host_free_calls (pin_calls / unpin_calls),
    cache_hits (reuse_hits). Process-wide; thread-safe."""
    from .ops.memory import memory_stats

    ms = memory_stats()
    return {
        "live_bytes": ms["bytes_in_use"],
        "peak_live_bytes": ms["peak_bytes_in_use"],
        "cached_bytes": ms["bytes_cached"],
        "reserved_bytes": ms["bytes_pinned"],
        "host_alloc_calls": ms["pin_calls"],
        "host_free_calls": ms["unpin_calls"],
        "cache_hits": ms["reuse_hits"],
    }


def pinned_stats() -> dict:
    """TrainStream's pinned_stats(): the pinned host arena's counters under its names
    (trainstream_pinned) and by_tag, always {} (ramstream's arena does not tag allocations).
    ramstream's own names and more counters: ramstream.memory_stats()."""
    return {**trainstream_pinned(), "by_tag": {}}


def memory_report(model: torch.nn.Module | None = None) -> dict:
    """What ramstream decided and holds for a wrapped model: events, params, activations,
    optimizer, plan; and TrainStream 0.4.1's keys with its meanings (docs/compat.md): params
    (paged_blocks: blocks whose weights stream from host RAM, loads, load_bytes, releases,
    paged_bytes, total_blocks, quantize: None, "int8" or "nf4", quantized_blocks,
    quantized_bytes), activations (offloaded_blocks, total_blocks, packed_bytes), transfers,
    pinned, gpu, resident; empty or zero where ramstream lacks the feature.
    Without a model (TrainStream's snapshot): {"pinned": the arena's counters under TrainStream's
    names, "pinned_by_tag": {}, "gpu": the current CUDA device's allocated, reserved and
    peak_allocated bytes (zeros without a GPU)}. ValueError for a model that is not wrapped."""
    if model is None:
        dev = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else None
        return {"pinned": trainstream_pinned(), "pinned_by_tag": {}, "gpu": _gpu(dev)}
    w = getattr(model, "_ramstream", None)
    if w is None:
        raise ValueError("memory_report(): this model is not wrapped by ramstream")
    from .runtime.refiner import split_report

    e = w.optimizer._engine
    host_state = host_state_bytes(e)
    landing = sum(b.landing.nbytes for b in e.buckets if b.landing is not None)
    stats = w.optimizer.stats()
    act = w.activations.off.stats() if w.activations is not None else {}
    ts = _trainstream_keys(w, stats, act)
    return {
        "events": list(w.log.lines),
        "params": {
            "count": len(e.slots),
            "numel": sum(s.numel for s in e.slots),
            "device": str(e.device),
            "buckets": len(e.buckets),
            "bucket_numel": [b.numel for b in e.buckets],
            # block weight loads, forward and backward (TrainStream's meaning too)
            "loads": w.streamer.stats["loads"] if w.streamer is not None else 0,
            "streamed_blocks": [b.index for b in w.streamer.blocks] if w.streamer is not None else [],
            "stream": dict(w.streamer.stats) if w.streamer is not None else {},
            "quantization": w.plan.get("quantize"),  # None with quantize="none", else a dict
            # nvme_weights: frozen weights of streamed blocks on disk (runtime/disk_weights.py); None without
            "nvme_weights": w.disk_weights.report() if getattr(w, "disk_weights", None) is not None else None,
            **ts["params"],
        },
        "activations": {
            "packed_bytes": act.get("bytes_d2h", 0),  # saved activations paged to host, in all
            "paged_blocks": list(act.get("paged_blocks", [])),  # blocks paging their activations
            **ts["activations"],
        },
        "transfers": ts["transfers"],
        "pinned": ts["pinned"],
        "gpu": ts["gpu"],
        "resident": ts["resident"],
        "optimizer": {
            "mode": w.optimizer.mode,
            "gpu_updated_numel": e.mapped_numel,
            "resident": w.optimizer.resident,
            "moment_dtype": str(e.moment_dtype).replace("torch.", ""),
            "host_state_bytes": host_state,
            "nvme": _nvme(e),
            "landing_bytes": landing,
            "grad_bytes_offloaded": stats["grad_bytes_offloaded"],
            "stats": stats,
        },
        "plan": {
            **w.plan,
            # the blocks recomputing now (activation_checkpointing="auto" in LoRA keeps some after
            # step 1: runtime/keep.py)
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
                "split": split_report(w.optimizer),  # optimizer_mode="auto" (runtime/refiner.py)
            },
            "history": list(w.plan.get("history", [])) + list(w.optimizer.plan_history),
            "activations": w.activations.report() if w.activations is not None else None,
            # VRAM growth after the plan settled (runtime/watchdog.py)
            "watchdog": w.watchdog.report() if w.watchdog is not None else {"enabled": False},
        },
    }
