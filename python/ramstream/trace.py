"""Chrome/Perfetto step traces for every mode: `with ramstream.trace(path):` around wrap()
training, or OffloadModel.step(..., profile_path=path). One tracer for both front ends.

Spans ("ph": "X", microseconds) on one track each: compute (one span per chunk or block forward
and backward), stalls (the compute track idle inside a pass), H2D (weight loads), D2H (gradient
write-backs), host optimizer (wrap()'s engine: landing and AdamW per bucket), steps. GPU spans
are timed with CUDA events on the stream that runs them, resolved once when the trace ends (no
synchronisation per span); host spans with perf_counter. When no trace is active the only cost
is one global lookup at each instrumented point; module hooks exist only while tracing.
"""

from __future__ import annotations

import json
import os
import threading
import time
import weakref
from contextlib import contextmanager

import torch

from ._paths import check_writable

LANES = {"steps": 0, "compute": 1, "stall": 1, "h2d": 2, "d2h": 3, "host optimizer": 4}
_TRACK_NAMES = {0: "steps", 1: "compute", 2: "H2D (weight loads)", 3: "D2H (gradients)", 4: "host optimizer"}

_ACTIVE = None  # the Tracer being recorded, or None
_TARGETS: weakref.WeakKeyDictionary = (
    weakref.WeakKeyDictionary()
)  # front end -> fn(owner) -> (modules, device)


def current():
    """The active Tracer or None (the instrumented points check this)."""
    return _ACTIVE


def register(owner, modules_of) -> None:
    """A front end whose modules get compute spans while a trace is active: modules_of(owner)
    returns (modules in forward order, device). Held weakly."""
    _TARGETS[owner] = modules_of


def _first_grad_tensor(x):
    """The first tensor requiring grad in x (a tensor, or a tuple/list/dict of them). Here rather
    than in weights/streamer.py, which imports it: the streamer records its spans here."""
    if torch.is_tensor(x):
        return x if x.requires_grad else None
    if isinstance(x, (tuple, list)):
        for v in x:
            t = _first_grad_tensor(v)
            if t is not None:
                return t
    if isinstance(x, dict):
        return _first_grad_tensor(list(x.values()))
    return None


class Tracer:
    """Collects spans; written as {"traceEvents": [...]} to `path` (temp name, then rename)."""

    def __init__(self, path, device=None) -> None:
        if not isinstance(path, (str, os.PathLike)):
            raise TypeError(f"ramstream.trace: path must be a str or os.PathLike, got {type(path).__name__}")
        self.path = check_writable(path, "ramstream.trace: path")  # before anything is traced
        self.device = None if device is None else torch.device(device)
        self.spans: list = []  # (lane, name, t0 token, t1 token, args)
        self.regions: list = []  # (t0 token, t1 token): inside a pass, an idle compute track is a stall
        self._hooks: list = []
        self._modspans: list = []
        self._lock = threading.Lock()
        self.host0 = time.perf_counter()
        self._ref = None  # (cuda event, host time)

    # ---- clocks ---------------------------------------------------------------------------------
    def now(self, stream=None):
        """A timestamp: on `stream` (a torch.cuda.Stream: an event recorded there) or the host."""
        if stream is None:
            return time.perf_counter()
        if self._ref is None:
            self._start_cuda(stream.device)
        ev = torch.cuda.Event(enable_timing=True)
        ev.record(stream)
        return ev

    def _start_cuda(self, device) -> None:
        torch.cuda.synchronize(device)  # once: GPU and host clocks start together
        ev = torch.cuda.Event(enable_timing=True)
        ev.record(torch.cuda.current_stream(device))
        self._ref = (ev, time.perf_counter())
        self._cuda_device = device

    def compute_stream(self, device):
        return torch.cuda.current_stream(device) if device is not None and device.type == "cuda" else None

    def span(self, lane: str, name: str, t0, t1, **args) -> None:
        with self._lock:
            self.spans.append((lane, name, t0, t1, args))

    @contextmanager
    def stream_span(self, lane: str, name: str, stream, **args):
        """A span of the work queued inside the block on `stream` (None: host time)."""
        t0 = self.now(stream)
        try:
            yield
        finally:
            self.span(lane, name, t0, self.now(stream), **args)

    @contextmanager
    def host_span(self, lane: str, name: str, **args):
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.span(lane, name, t0, time.perf_counter(), **args)

    # ---- lifetime -------------------------------------------------------------------------------
    def __enter__(self):
        global _ACTIVE
        if _ACTIVE is not None:
            raise RuntimeError("ramstream.trace: a trace is already being recorded (one at a time)")
        if self.device is not None and self.device.type == "cuda":
            self._start_cuda(self.device)
        _ACTIVE = self
        seen: set = set()
        for owner, fn in list(_TARGETS.items()):
            modules, device = fn(owner)
            mods = [m for m in modules if id(m) not in seen]
            seen.update(id(m) for m in mods)
            if mods:
                self._modspans.append(_ModuleSpans(self, mods, device))
        return self

    def __exit__(self, *exc) -> None:
        global _ACTIVE
        _ACTIVE = None
        for ms in self._modspans:
            ms.close()
        self.write()

    def _us(self, tok) -> float:
        if isinstance(tok, float):
            return (tok - self.host0) * 1e6
        ev, host = self._ref
        return (host - self.host0) * 1e6 + ev.elapsed_time(tok) * 1e3

    def events(self) -> list[dict]:
        """The trace events (resolving CUDA events: waits for the GPU once)."""
        if self._ref is not None:
            torch.cuda.synchronize(self._cuda_device)
        pid = os.getpid()
        out = [{"name": "process_name", "ph": "M", "pid": pid, "tid": 0, "args": {"name": "ramstream"}}]
        out += [
            {"name": "thread_name", "ph": "M", "pid": pid, "tid": t, "args": {"name": n}}
            for t, n in _TRACK_NAMES.items()
        ]
        spans = []
        for lane, name, t0, t1, args in self.spans:
            a, b = self._us(t0), self._us(t1)
            spans.append((lane, name, a, max(b, a), args))
        spans += self._stalls(spans)
        spans.sort(key=lambda s: (LANES[s[0]], s[2]))
        for lane, name, a, b, args in spans:
            ev = {"name": name, "cat": lane, "ph": "X", "ts": round(a, 3), "dur": round(b - a, 3)}
            ev.update(pid=pid, tid=LANES[lane])
            if args:
                ev["args"] = args
            out.append(ev)
        return out

    def _stalls(self, spans) -> list:
        comp = sorted((s for s in spans if s[0] == "compute"), key=lambda s: s[2])
        out = []
        for r0, r1 in self.regions:
            a, b = self._us(r0), self._us(r1)
            inside = [s for s in comp if s[2] >= a - 1e-3 and s[3] <= b + 1e-3]
            for prev, nxt in zip(inside, inside[1:]):
                if nxt[2] - prev[3] > 1.0:  # > 1 us idle
                    out.append(("stall", "stall", prev[3], nxt[2], {"before": nxt[1]}))
        return out

    def write(self) -> None:
        doc = {"traceEvents": self.events(), "displayTimeUnit": "ms"}
        tmp = f"{self.path}.tmp.{os.getpid()}"
        with open(tmp, "w") as f:
            json.dump(doc, f)
        os.replace(tmp, self.path)


def trace(path, device=None) -> Tracer:
    """A context manager recording a Chrome/Perfetto trace of the training inside it into `path`
    (open it at ui.perfetto.dev or chrome://tracing). `device`: the GPU whose clock starts the
    trace (found from the first GPU span when not given). The folder of `path` is checked here:
    FileNotFoundError / NotADirectoryError / PermissionError naming it, before anything runs."""
    return Tracer(path, device)


class _ModuleSpans:
    """Compute spans of `modules` (in forward order): forward k from its pre-hook (after the
    weight streamer's wait for its weights) to its post-hook; backward k from its output's
    gradient hook (after the streamer's) to the next module's boundary (the gradient of module
    k's input), the last one to the end of the backward pass."""

    def __init__(self, tracer: Tracer, modules, device) -> None:
        self.t, self.device = tracer, device
        self.index = {id(m): k for k, m in enumerate(modules)}
        self.fwd0: dict = {}
        self.bwd0: dict = {}  # k -> (start token) of this pass
        self.task = None
        self.pass0 = None
        self.handles = []
        for k, m in enumerate(modules):
            self.handles.append(m.register_forward_pre_hook(lambda mod, a, k=k: self._pre(k)))
            self.handles.append(
                m.register_forward_hook(lambda mod, a, o, k=k: self._boundary(k, o), prepend=True)
            )
            self.handles.append(m.register_forward_hook(lambda mod, a, o, k=k: self._post(k, o)))

    @staticmethod
    def _in_backward() -> bool:
        return torch._C._current_graph_task_id() != -1

    def _stream(self):
        return self.t.compute_stream(self.device)

    def _pre(self, k: int) -> None:
        if self._in_backward():
            return
        self.fwd0[k] = self.t.now(self._stream())
        if k == 0 or self.pass0 is None:
            self.pass0 = self.fwd0[k]  # a pass starts (a forward without backward ends none)

    def _post(self, k: int, out) -> None:
        if self._in_backward() or k not in self.fwd0:
            return
        self.t.span("compute", f"forward {k}", self.fwd0.pop(k), self.t.now(self._stream()), chunk=k)
        y = _first_grad_tensor(out)
        if y is not None:
            y.register_hook(lambda g, k=k: self._bwd_start(k))

    def _boundary(self, k: int, out) -> None:
        """Registered before the streamer's output hook: fires before it waits for a load."""
        if self._in_backward():
            return
        y = _first_grad_tensor(out)
        if y is not None:
            y.register_hook(lambda g, k=k: self._bwd_end(k + 1))

    def _bwd_end(self, k: int) -> None:
        task = torch._C._current_graph_task_id()
        if task != self.task:
            self.task = task
            torch.autograd.Variable._execution_engine.queue_callback(self._pass_end)
        if k in self.bwd0:
            self.t.span("compute", f"backward {k}", self.bwd0.pop(k), self.t.now(self._stream()), chunk=k)

    def _bwd_start(self, k: int) -> None:
        self.bwd0[k] = self.t.now(self._stream())

    def _pass_end(self) -> None:
        end = self.t.now(self._stream())
        for k, t0 in sorted(self.bwd0.items()):
            self.t.span("compute", f"backward {k}", t0, end, chunk=k)
        self.bwd0.clear()
        self.task = None
        if self.pass0 is not None:
            self.t.regions.append((self.pass0, end))
        self.pass0 = None

    def close(self) -> None:
        for h in self.handles:
            h.remove()
        self.handles = []
