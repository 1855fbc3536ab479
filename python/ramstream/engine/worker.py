"""The engine thread: runs host jobs (wait for a copy, accumulate, AdamW, send back).

Jobs carry a priority (lower runs first: bucket index, i.e. the order the next forward reads
the weights) and dependencies (jobs that must finish first). Heavy work happens in ramstream._C
with the GIL released. A job that raises makes every later wait re-raise its error in the
training thread; nothing waits forever on a failed engine.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable


class Worker:
    def __init__(self, name: str, on_start: Callable[[], None] | None = None) -> None:
        self._cv = threading.Condition()
        self._pending: list[tuple[float, int, frozenset, bool, Callable[[], None]]] = []
        self._done: set[int] = set()  # finished jobs above _low
        self._low = 0  # every job <= _low has finished
        self._seq = 0
        self._error: BaseException | None = None
        self._stop = False
        self._on_start = on_start
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    # ---- the thread ---------------------------------------------------------------------------
    def _finished(self, seq: int) -> bool:
        return seq <= self._low or seq in self._done

    def _next(self):
        best = None
        for i, (prio, seq, deps, barrier, _) in enumerate(self._pending):
            if barrier and self._low < seq - 1:
                continue
            if all(self._finished(d) for d in deps) and (
                best is None or (prio, seq) < self._pending[best][:2]
            ):
                best = i
        return None if best is None else self._pending.pop(best)

    def _run(self) -> None:
        if self._on_start is not None:
            try:
                self._on_start()
            except BaseException as e:  # noqa: BLE001
                self._error = e
        while True:
            with self._cv:
                while True:
                    if self._stop and not self._pending:
                        return
                    job = self._next()
                    if job is not None:
                        break
                    self._cv.wait()
            _, seq, _, _, fn = job
            try:
                if self._error is None:
                    fn()
            except BaseException as e:  # noqa: BLE001 - re-raised in the training thread
                self._error = e
            finally:
                del fn, job  # a finished job must not keep its engine alive
            with self._cv:
                self._done.add(seq)
                while self._low + 1 in self._done:
                    self._low += 1
                    self._done.discard(self._low)
                self._cv.notify_all()

    # ---- the training thread ------------------------------------------------------------------
    def submit(
        self, fn: Callable[[], None], priority: float = 0.0, deps: Iterable[int] = (), barrier: bool = False
    ) -> int:
        """Queues fn; returns its sequence number (for deps and wait()). Among runnable jobs the
        lowest (priority, seq) runs first; a barrier runs after every job submitted before it."""
        self.raise_if_failed()
        with self._cv:
            self._seq += 1
            seq = self._seq
            self._pending.append((priority, seq, frozenset(d for d in deps if d), barrier, fn))
            self._cv.notify_all()
        return seq

    def wait(self, seq: int) -> None:
        """Blocks until job `seq` ran (0: returns at once); re-raises a job's error."""
        if seq:
            with self._cv:
                self._cv.wait_for(lambda: self._finished(seq) or self._error is not None)
        self.raise_if_failed()

    def drain(self) -> None:
        """Blocks until every submitted job ran; re-raises a job's error."""
        with self._cv:
            self._cv.wait_for(lambda: self._low >= self._seq or self._error is not None)
        self.raise_if_failed()

    def raise_if_failed(self) -> None:
        if self._error is not None:
            err = self._error
            raise RuntimeError(f"ramstream engine: a host update failed: {err!r}") from err

    @property
    def failed(self) -> bool:
        return self._error is not None

    def stop(self) -> None:
        """Lets the thread finish the queued jobs and exit (no wait)."""
        with self._cv:
            self._stop = True
            self._cv.notify_all()

    def close(self) -> None:
        self.stop()
        if self._thread is not threading.current_thread():
            self._thread.join(timeout=30)
