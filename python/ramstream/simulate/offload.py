"""The OffloadModel schedule simulator: the loads, computes and write-backs the weight streamer
issues in one training step, on three serial lanes (H2D copy stream, compute stream, D2H stream).

The model follows weights/streamer.py hook by hook:

  window    OffloadModel's (RamTorch's): device slots for streamed chunks, the running one
            included; the streamer loads `ahead` = window - 1 chunks ahead of the running one
  forward   at streamed chunk k's pre-hook, chunk k and the next `ahead` streamed chunks are
            loaded (those not loaded yet, in order); pinned chunks load nothing
  backward  at chunk k's output-gradient hook, chunk k and the `ahead` streamed chunks before
            it are loaded; the last `window` streamed chunks are still loaded when backward
            starts (farthest next use is evicted: the forward keeps them for it); with
            keep_activations False or "checkpoint" every chunk's forward runs again first
  loads     one at a time on the copy stream, each no earlier than the compute issued before
            its hook (the copy stream waits for it: the memory of the evicted chunks is free
            then; this bounds the loaded streamed chunks to `window`; window=1: every load waits
            for the compute before it, nothing overlaps)
  write     the trained gradients of streamed chunk k go home on the D2H stream after its backward
  serial    device="cpu": copies run inline, on the compute timeline (nothing overlaps)

A chunk occupies device memory from the start of its load to the end of its last compute before
eviction. Times are seconds, per chunk (a number for every chunk, or one per chunk).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ..frontends.offload_model.checks import spaced
from ._base import _times

KEEP = (False, True, "checkpoint")


@dataclass(frozen=True)
class Span:
    """One interval on one lane: lane in ("h2d", "compute", "d2h"), kind in ("load", "forward",
    "recompute", "backward", "write", "stall")."""

    lane: str
    kind: str
    chunk: int
    start: float
    end: float


@dataclass
class Prediction:
    """The simulated step: makespan (s), GPU compute busy time (s), utilisation (busy /
    makespan), stall (s: the compute lane idle inside the step), peak_chunks (chunks on the
    device at once, pinned ones included) and every span."""

    window: int
    pinned: tuple
    makespan: float
    busy: float
    utilisation: float
    stall: float
    peak_chunks: int
    peak_bytes: int | None
    spans: list = field(default_factory=list)

    def row(self) -> dict:
        return {
            "window": self.window,
            "makespan_s": self.makespan,
            "utilisation": self.utilisation,
            "stall_s": self.stall,
            "peak_chunks": self.peak_chunks,
            "peak_bytes": self.peak_bytes,
        }


def _per_chunk(name: str, value, n: int) -> list[float]:
    """Seconds (or bytes) per chunk: simulate/_base.py's parser, its errors naming simulate_offload."""
    return _times(name, value, n, "chunk", "simulate_offload")


def _layers(layers, *vals) -> int:
    if layers is not None:
        if isinstance(layers, bool) or not isinstance(layers, int) or layers < 1:
            raise ValueError(f"simulate_offload: layers must be an int >= 1, got {layers!r}")
        return layers
    for v in vals:
        if not isinstance(v, (int, float)):
            return len(list(v))
    raise ValueError("simulate_offload: give layers (or per-chunk lists of times)")


def pinned_chunks(pin, pin_layers, n: int) -> set[int]:
    """The resident chunks, validated and chosen as OffloadModel's (`pin` evenly spaced: chunk
    i * n // pin for i = 0 .. pin-1; `pin_layers` explicit)."""
    if pin_layers is not None:
        idx = list(pin_layers)
        bad = [i for i in idx if isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < n]
        if bad:
            raise ValueError(f"simulate_offload: pin_layers must be chunk indices in [0, {n}), got {bad!r}")
        if len(set(idx)) != len(idx):
            raise ValueError(f"simulate_offload: pin_layers has duplicate indices: {idx!r}")
        return set(idx)
    if isinstance(pin, bool) or not isinstance(pin, int) or not 0 <= pin <= n:
        raise ValueError(
            f"simulate_offload: pin must be an int in [0, {n}] (the number of chunks), got {pin!r}"
        )
    return spaced(pin, n)


class _Lanes:
    def __init__(self, serial: bool) -> None:
        self.serial = serial
        self.copy = 0.0  # when the copy stream is free
        self.compute = 0.0
        self.d2h = 0.0
        self.spans: list[Span] = []
        self.load_end: dict[int, float] = {}
        self.loaded_at: dict[int, float] = {}  # chunk -> load start (while it is on the device)
        self.intervals: list[tuple[float, float, int]] = []  # (start, end, chunk)

    def load(self, c: int, t: float) -> None:
        """Chunk c's load, issued at a hook after the compute queued so far."""
        if c in self.loaded_at:
            return
        if self.serial:
            start = self.compute
            self.compute = start + t
        else:
            start = max(self.copy, self.compute)
            self.copy = start + t
        self.spans.append(Span("h2d", "load", c, start, start + t))
        self.load_end[c] = start + t
        self.loaded_at[c] = start

    def run(self, c: int, kind: str, t: float, needs: int | None) -> float:
        """A compute span of chunk c (after the load of chunk `needs`)."""
        start = self.compute if needs is None else max(self.compute, self.load_end[needs])
        if start > self.compute:
            self.spans.append(Span("compute", "stall", c, self.compute, start))
        self.spans.append(Span("compute", kind, c, start, start + t))
        self.compute = start + t
        return self.compute

    def evict(self, c: int, end: float) -> None:
        if c in self.loaded_at:
            self.intervals.append((self.loaded_at.pop(c), end, c))

    def write(self, c: int, t: float, after: float) -> None:
        if self.serial:
            start = self.compute
            self.compute = start + t
        else:
            start = max(self.d2h, after)
            self.d2h = start + t
        self.spans.append(Span("d2h", "write", c, start, start + t))


def simulate_offload(
    tf,
    tb,
    th2d,
    *,
    layers: int | None = None,
    window: int = 2,
    pin: int = 0,
    pin_layers=None,
    keep_activations=False,
    td2h=0.0,
    chunk_bytes=None,
    serial: bool = False,
) -> Prediction:
    """Predicts one OffloadModel.step().

    Args:
        tf, tb: each chunk's forward and backward compute time (backward without the recompute).
        th2d: each chunk's H2D load time; td2h: its gradients' D2H write-back time.
        layers: the number of chunks (needed when every time is a single number).
        window, pin, pin_layers, keep_activations: as OffloadModel's (window: device slots for
            streamed chunks, the running one included; pin: evenly spaced resident chunks).
        chunk_bytes: each chunk's weight bytes (for peak_bytes), optional.
        serial: copies inline on the compute timeline (device="cpu").
    """
    n = _layers(layers, tf, tb, th2d)
    tf, tb = _per_chunk("tf", tf, n), _per_chunk("tb", tb, n)
    th2d, td2h = _per_chunk("th2d", th2d, n), _per_chunk("td2h", td2h, n)
    if isinstance(window, bool) or not isinstance(window, int) or window < 1:
        raise ValueError(f"simulate_offload: window must be an int >= 1, got {window!r}")
    if not any(keep_activations is k or (isinstance(k, str) and keep_activations == k) for k in KEEP):
        raise ValueError(
            f"simulate_offload: keep_activations must be False, True or 'checkpoint', got {keep_activations!r}"
        )
    pinned = pinned_chunks(pin, pin_layers, n)
    sizes = None if chunk_bytes is None else [int(b) for b in _per_chunk("chunk_bytes", chunk_bytes, n)]
    streamed = [c for c in range(n) if c not in pinned]
    pos = {c: k for k, c in enumerate(streamed)}
    s = len(streamed)
    lanes = _Lanes(serial)

    ahead = window - 1  # the streamer's prefetch depth
    for c in range(n):  # forward
        k = pos.get(c)
        if k is None:
            lanes.run(c, "forward", tf[c], None)
            continue
        for j in range(k, min(s, k + 1 + ahead)):
            lanes.load(streamed[j], th2d[streamed[j]])
        end = lanes.run(c, "forward", tf[c], c)
        if k < s - window:  # the last `window` stay loaded for backward
            lanes.evict(c, end)
    recompute = keep_activations is not True
    for c in range(n - 1, -1, -1):  # backward
        k = pos.get(c)
        if k is not None:
            for j in range(k, max(-1, k - 1 - ahead), -1):
                lanes.load(streamed[j], th2d[streamed[j]])
        if recompute:
            lanes.run(c, "recompute", tf[c], c if k is not None else None)
        end = lanes.run(c, "backward", tb[c], c if k is not None and not recompute else None)
        if k is not None:
            lanes.evict(c, end)
            if td2h[c] > 0:
                lanes.write(c, td2h[c], end)
    spans = lanes.spans
    makespan = max(sp.end for sp in spans) if spans else 0.0
    busy = sum(sp.end - sp.start for sp in spans if sp.lane == "compute" and sp.kind != "stall")
    peak, peak_b = _peak(lanes.intervals, sizes)
    pinned_b = None if sizes is None else sum(sizes[c] for c in pinned)
    return Prediction(
        window=window,
        pinned=tuple(sorted(pinned)),
        makespan=makespan,
        busy=busy,
        utilisation=busy / makespan if makespan > 0 else 1.0,
        stall=makespan - busy,
        peak_chunks=len(pinned) + peak,
        peak_bytes=None if sizes is None else pinned_b + peak_b,
        spans=spans,
    )


def _peak(intervals, sizes) -> tuple[int, int]:
    """The most chunks (and bytes) on the device at once; a chunk freed at t makes room for one
    loaded at t."""
    events = []
    for start, end, c in intervals:
        b = 0 if sizes is None else sizes[c]
        events += [(start, 1, 1, b), (end, 0, -1, -b)]
    events.sort()
    now = nb = peak = peak_b = 0
    for _, _, d, b in events:
        now += d
        nb += b
        peak, peak_b = max(peak, now), max(peak_b, nb)
    return peak, peak_b


def table(tf, tb, th2d, *, layers=None, windows=None, **kw) -> list[Prediction]:
    """simulate_offload for every window in `windows` (default 1 .. the number of chunks; a
    window beyond the streamed chunks changes nothing)."""
    n = _layers(layers, tf, tb, th2d)
    return [simulate_offload(tf, tb, th2d, layers=n, window=w, **kw) for w in (windows or range(1, n + 1))]
