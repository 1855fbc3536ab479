"""The decision log behind memory_report(model)["events"]: timestamped plain-text lines."""

from __future__ import annotations

import time


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
