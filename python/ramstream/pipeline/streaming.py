"""Streaming inference through a Pipeline (RamTorch's infer_open / infer_submit / infer_loop): items
submitted one at a time flow through the stage threads (stage s runs item i while stage s+1 runs
item i-1), each with an InferHandle whose result() returns its last stage's output or raises its
stage's error; other items go on.

Threads: while an InferStream is open, every stage thread runs serve() (a loop over its inbox
of (chunk, item, payload) messages) instead of step jobs; submit() and the handles are
thread-safe. On CUDA a stage runs on its stream; hand-overs carry events (stage.py's send and
receive) and result() makes the caller's current stream wait for the output.
"""

from __future__ import annotations

import math
import queue
import threading
from collections import deque

import torch

from .stage import device_context, receive, send

__all__ = ["InferHandle", "InferStream"]

_STOP = object()


def check_timeout(timeout, where: str) -> None:
    """timeout: None (wait as long as it takes) or a finite number of seconds >= 0."""
    ok = timeout is None or (
        isinstance(timeout, (int, float))
        and not isinstance(timeout, bool)
        and math.isfinite(timeout)
        and timeout >= 0
    )
    if not ok:
        raise ValueError(f"{where}: timeout must be None or a number of seconds >= 0, got {timeout!r}")


class InferHandle:
    """One submitted item. result(timeout=None) waits for it: the last stage's output (detached,
    on the last stage's device), or raises the error a stage raised for it (TimeoutError when
    `timeout` seconds pass first). done() says whether it finished. Thread-safe."""

    __slots__ = ("_error", "_event", "_ready", "_value", "index")

    def __init__(self, index: int) -> None:
        self.index = index
        self._ready = threading.Event()
        self._value = self._error = self._event = None

    def _set(self, value=None, error=None, event=None) -> None:
        self._value, self._error, self._event = value, error, event
        self._ready.set()

    def done(self) -> bool:
        return self._ready.is_set()

    def result(self, timeout: float | None = None):
        check_timeout(timeout, "InferHandle.result")
        if not self._ready.wait(timeout):
            raise TimeoutError(f"InferHandle.result: item {self.index} not done after {timeout} s")
        if self._error is not None:
            raise self._error
        if self._event is not None:  # the output was made on the last stage's stream
            ev, self._event = self._event, None
            for t in self._value if isinstance(self._value, tuple) else (self._value,):
                if torch.is_tensor(t) and t.is_cuda:
                    torch.cuda.current_stream(t.device).wait_event(ev)
                    t.record_stream(torch.cuda.current_stream(t.device))
        return self._value

    def __repr__(self) -> str:
        state = "failed" if self._error is not None else "done" if self.done() else "pending"
        return f"InferHandle(item={self.index}, {state})"


def _move(x, device):
    if torch.is_tensor(x):
        return x.to(device, non_blocking=device.type == "cuda")
    return x


class InferStream:
    """An open streaming-inference session over `chunks` (the Pipeline's Chunk list) on
    `threads` (its StageThreads; [] with overlap=False: each item runs at submit(), on the
    caller's thread). `release` is called once when the stream closes (the Pipeline's lock).
    submit(x) -> InferHandle; loop(iterable) yields results in order; close() waits for the
    items in flight and ends the stage loops. A context manager."""

    def __init__(self, chunks, threads, release) -> None:
        self.chunks = chunks
        self.stages = 1 + max(ch.stage for ch in chunks)
        self.inboxes = [queue.SimpleQueue() for _ in range(self.stages)]
        self.finished: queue.SimpleQueue = queue.SimpleQueue()
        self.lock = threading.Lock()
        self.pending: dict = {}  # index -> handle not yet done
        self.count = 0
        self.closed = False
        self._release = release
        self.serial = not threads
        for s, t in enumerate(threads):
            t.submit(lambda s=s: self.serve(s))

    # ---- the caller's side ---------------------------------------------------------------------
    def submit(self, x) -> InferHandle:
        """Queues one item (a tensor, or a tuple: the first stage's positional arguments; not
        cut into microbatches) and returns its handle at once."""
        if not (torch.is_tensor(x) or isinstance(x, tuple)):
            raise TypeError(
                f"Pipeline.infer_submit: an item must be a tensor or a tuple of the first stage's arguments, "
                f"got {type(x).__name__}"
            )
        with self.lock:
            if self.closed:
                raise RuntimeError("Pipeline.infer_submit: the inference stream is closed")
            h = InferHandle(self.count)
            self.count += 1
            self.pending[h.index] = h
        args = x if isinstance(x, tuple) else (x,)
        if self.serial:
            with torch.no_grad():
                msg = (0, h, args)
                while msg is not None:
                    msg = self._run(self.chunks[msg[0]].stage, *msg)
        else:
            self.inboxes[self.chunks[0].stage].put((0, h, args))
        return h

    def loop(self, items, *, max_in_flight: int | None = None, timeout: float | None = None):
        """Submits `items` (an iterable of items as submit() takes) keeping at most `max_in_flight`
        (default: 2 per stage) submitted and not yet yielded, and yields their results in order;
        an item's error is raised when its turn comes (the rest are left to finish)."""
        cap = 2 * self.stages if max_in_flight is None else max_in_flight
        if isinstance(cap, bool) or not isinstance(cap, int) or cap < 1:
            raise ValueError(f"Pipeline.infer_loop: max_in_flight must be an int >= 1, got {max_in_flight!r}")
        check_timeout(timeout, "Pipeline.infer_loop")
        waiting: deque = deque()
        for x in items:
            waiting.append(self.submit(x))
            if len(waiting) >= cap:
                yield waiting.popleft().result(timeout)
        while waiting:
            yield waiting.popleft().result(timeout)

    def close(self, timeout: float | None = None) -> None:
        """Waits for the items in flight (each ends with a result or an error), then stops the
        stage loops and gives the pipeline back to step()/infer(); idempotent."""
        with self.lock:
            if self.closed:
                return
            self.closed = True
            left = list(self.pending.values())
        try:
            for h in left:
                h._ready.wait(timeout)
        finally:
            if not self.serial:
                for box in self.inboxes:
                    box.put(_STOP)
                for _ in self.inboxes:
                    self.finished.get(timeout=timeout)
            self._release()

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ---- a stage's side ------------------------------------------------------------------------
    def serve(self, s: int) -> None:
        """Stage s's loop: runs each (chunk, handle, payload) of its inbox until _STOP."""
        box = self.inboxes[s]
        try:
            with torch.no_grad():
                while True:
                    msg = box.get()
                    if msg is _STOP:
                        return
                    nxt = self._run(s, *msg)
                    if nxt is not None:
                        self.inboxes[self.chunks[nxt[0]].stage].put(nxt)
                    del msg, nxt
        finally:
            self.finished.put(s)

    def _run(self, s: int, c: int, h: InferHandle, payload):
        """Chunk c's forward of item h: the next message, or None (the item is done or failed)."""
        ch = self.chunks[c]
        try:
            with device_context(ch.device, ch.stream):
                if c == 0:
                    args = tuple(_move(a, ch.device) for a in payload)
                else:
                    args = receive(payload, ch.device, ch.stream)
                with ch.autocast():
                    out = ch.module(*args)
                if c < len(self.chunks) - 1:
                    return (c + 1, h, send(out if isinstance(out, tuple) else (out,), ch.stream))
                ev = None
                if ch.stream is not None:
                    ev = torch.cuda.Event()
                    ev.record(ch.stream)
                self._done(h, value=out, event=ev)
        except BaseException as e:  # noqa: BLE001 - the item's error, raised by its result()
            self._done(h, error=e)
        return None

    def _done(self, h: InferHandle, **kw) -> None:
        with self.lock:
            self.pending.pop(h.index, None)
        h._set(**kw)
