"""The pipeline's moving parts below Pipeline: one step's exchange of activations and gradients
between stage workers (Exchange), the persistent stage threads (StageThread), and the hand-over of
tensors between devices and CUDA streams (send, receive).

Threads: every stage has one StageThread, started once by the Pipeline and fed one job per
step; the thread holds no reference to the Pipeline (a dropped Pipeline is collected and its
threads stop). Streams: on CUDA each stage runs on its own stream; a hand-over carries an event
recorded on the producer's stream, and the receiver's streams wait for it on the GPU.
"""

from __future__ import annotations

import contextlib
import queue
import threading

import torch

__all__ = ["Exchange", "Payload", "StageThread", "Stopped", "device_context", "receive", "send"]


class Stopped(Exception):
    """Raised inside a stage worker when another worker failed: the worker stops its op list."""


class Payload:
    """What one chunk hands to the next (activations, forward) or to the one before (gradients,
    backward): `values` (tensors detached from the producer's graph, or other objects), `flags`
    (per value: the receiver makes it a leaf that requires grad) and `event` (a CUDA event on the
    producer's stream, or None)."""

    __slots__ = ("event", "flags", "values")

    def __init__(self, values, flags, event) -> None:
        self.values, self.flags, self.event = values, flags, event


def _record(stream):
    if stream is None:
        return None
    ev = torch.cuda.Event()
    ev.record(stream)
    return ev


def send(values, stream, *, grads: bool = False) -> Payload:
    """A Payload of `values` (a tuple) produced on `stream` (None off CUDA). Forward (grads=False):
    each tensor is detached and flagged when it requires grad. Backward (grads=True): the values
    are gradients (or None) and are never flagged."""
    if grads:
        return Payload(tuple(values), (False,) * len(values), _record(stream))
    out, flags = [], []
    for v in values:
        if torch.is_tensor(v):
            flags.append(v.requires_grad)
            out.append(v.detach())
        else:
            flags.append(False)
            out.append(v)
    return Payload(tuple(out), tuple(flags), _record(stream))


def receive(p: Payload, device: torch.device, stream) -> tuple:
    """The payload's values on `device`, usable on this thread's current streams: the current
    stream of every CUDA device involved waits (on the GPU) for the producer's event; tensors on
    another device are copied (non-blocking between GPUs and to a GPU), and a tensor read on a
    stream other than the one it was made on is recorded there for the caching allocator. A
    flagged tensor becomes a fresh leaf that requires grad (its .grad is the gradient to send
    back)."""
    if p.event is not None:
        devs = {v.device for v in p.values if torch.is_tensor(v) and v.is_cuda}
        if device.type == "cuda":
            devs.add(device)
        for d in devs:
            torch.cuda.current_stream(d).wait_event(p.event)
    out = []
    for v, flag in zip(p.values, p.flags):
        if torch.is_tensor(v):
            if v.device != device:
                w = v.to(device, non_blocking=device.type == "cuda")
                if v.is_cuda:
                    v.record_stream(torch.cuda.current_stream(v.device))
            else:
                w = v
                if v.is_cuda and stream is not None:
                    v.record_stream(stream)
            v = w.detach().requires_grad_(True) if flag else w
        out.append(v)
    return tuple(out)


def device_context(device: torch.device, stream):
    """The stage's device and stream made current on this thread (nothing off CUDA)."""
    if stream is None:
        return contextlib.nullcontext()
    stack = contextlib.ExitStack()
    stack.enter_context(torch.cuda.device(device))
    stack.enter_context(torch.cuda.stream(stream))
    return stack


class Exchange:
    """One step's mailbox between the stage workers: put(key, payload) / take(key), keys
    ("F", chunk, mb) for activations and ("B", chunk, mb) for gradients (the producer's chunk).
    Thread-safe. take() raises Stopped once fail() was called (by any worker, or by the caller
    on an interrupt); it also detects a deadlock (every worker still running is waiting), which
    fails the step with a RuntimeError instead of hanging."""

    def __init__(self, workers: int) -> None:
        self.cond = threading.Condition()
        self.items: dict = {}
        self.error: BaseException | None = None
        self.running = workers
        self.waits: dict = {}  # worker -> the key it waits for (for the deadlock message)

    def put(self, key, value) -> None:
        with self.cond:
            self.items[key] = value
            self.cond.notify_all()

    def take(self, key, who=None):
        with self.cond:
            while key not in self.items:
                if self.error is not None:
                    raise Stopped
                self.waits[who] = key
                try:
                    if self._blocked() >= self.running:
                        self._deadlock()
                        raise Stopped
                    self.cond.wait()
                finally:
                    self.waits.pop(who, None)
            return self.items.pop(key)

    def _blocked(self) -> int:
        """Workers waiting for a key nobody has put (a woken one whose key arrived is not)."""
        return sum(1 for k in self.waits.values() if k not in self.items)

    def check(self) -> None:
        """Raises Stopped when the step failed (between two ops of a worker)."""
        if self.error is not None:
            raise Stopped

    def fail(self, exc: BaseException) -> None:
        with self.cond:
            if self.error is None:
                self.error = exc
            self.cond.notify_all()

    def finished(self) -> None:
        """A worker left (its op list done, or stopped)."""
        with self.cond:
            self.running -= 1
            if self.running > 0 and self._blocked() >= self.running:
                self._deadlock()
            self.cond.notify_all()

    def _deadlock(self) -> None:
        if self.error is None:
            where = ", ".join(
                f"stage {w} waits for {k[0]}(chunk={k[1]}, mb={k[2]})"
                for w, k in self.waits.items()
                if k not in self.items
            )
            self.error = RuntimeError(f"Pipeline: the schedule deadlocked ({where}); no stage can go on")
        self.cond.notify_all()


def _serve(inbox: queue.SimpleQueue) -> None:
    """A stage thread's loop: run each job (a callable that never raises) until None arrives."""
    while True:
        job = inbox.get()
        if job is None:
            return
        job()
        del job  # the step's graphs and modules are not held between steps


class StageThread:
    """One persistent worker thread (daemon, named ramstream-pipeline-<stage>): submit(job) runs
    `job()` on it; stop() ends it after the job in progress. Holds nothing but its queue."""

    def __init__(self, stage: int) -> None:
        self.inbox: queue.SimpleQueue = queue.SimpleQueue()
        self.thread = threading.Thread(
            target=_serve, args=(self.inbox,), name=f"ramstream-pipeline-{stage}", daemon=True
        )
        self.thread.start()

    def submit(self, job) -> None:
        self.inbox.put(job)

    def stop(self, wait: bool = True) -> None:
        self.inbox.put(None)
        if wait and self.thread is not threading.current_thread():
            self.thread.join()


def stop_all(threads, streamed) -> None:
    """A pipeline collected without close(): its threads end, its streamed stages unhook."""
    for t in threads:
        t.stop(wait=False)
    for st in streamed:
        st.close()
