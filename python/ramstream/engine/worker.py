"""The engine thread: runs host jobs (wait for a copy, accumulate, AdamW, send back) in order.

Heavy work happens in ramstream._C with the GIL released, on the core's thread pool. A job that
raises stops the worker's queue from running later jobs; the error is re-raised in the
training thread at its next call into the engine.
"""
from __future__ import annotations

import queue
import threading
from typing import Callable


class Worker:
    def __init__(self, name: str, on_start: Callable[[], None] | None = None) -> None:
        self._q: queue.Queue = queue.Queue()
        self._error: BaseException | None = None
        self._idle = threading.Condition()
        self._outstanding = 0
        self._on_start = on_start
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        if self._on_start is not None:
            try:
                self._on_start()
            except BaseException as e:  # noqa: BLE001
                self._error = e
        while True:
            job = self._q.get()
            if job is None:
                return
            try:
                if self._error is None:
                    job()
            except BaseException as e:  # noqa: BLE001 - re-raised in the training thread
                self._error = e
            finally:
                with self._idle:
                    self._outstanding -= 1
                    self._idle.notify_all()

    def submit(self, job: Callable[[], None]) -> None:
        self.raise_if_failed()
        with self._idle:
            self._outstanding += 1
        self._q.put(job)

    def drain(self) -> None:
        """Blocks until every submitted job ran; re-raises a job's error."""
        with self._idle:
            self._idle.wait_for(lambda: self._outstanding == 0)
        self.raise_if_failed()

    def raise_if_failed(self) -> None:
        if self._error is not None:
            err = self._error
            raise RuntimeError(f"ramstream engine: a host update failed: {err!r}") from err

    @property
    def failed(self) -> bool:
        return self._error is not None

    def close(self) -> None:
        self._q.put(None)
        self._thread.join(timeout=30)
