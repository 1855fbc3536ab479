"""PlanHistory: the record of every change the runtime made to the applied plan while training.

memory_report(model)["plan"]["history"] reads it. Its only writer is the session
(runtime/session.py TrainingSession.record, which PlanSession records through too): the deciders
(the resident switch and the VRAM share in runtime/optimizer_split.py, the refinement in
runtime/refiner.py, the watchdog in runtime/watchdog.py, the LoRA keep policy in runtime/keep.py)
return their entries and the session records them (tests/test_layering.py checks it); everyone else
reads a sequence of dicts in the order the changes were made."""

from __future__ import annotations

from collections.abc import Sequence


class PlanHistory(Sequence):
    """A read-only sequence of history entries ({"step": int | None, "change": str, ...}) that
    record() extends."""

    def __init__(self) -> None:
        self._entries: list[dict] = []

    def record(self, entry: dict) -> dict:
        """Appends one entry; returns it. An entry is a dict with a "change" string."""
        if not isinstance(entry, dict) or not isinstance(entry.get("change"), str):
            raise TypeError(f"PlanHistory.record: an entry is a dict with a 'change' string, got {entry!r}")
        self._entries.append(entry)
        return entry

    def __getitem__(self, i):
        return self._entries[i]

    def __len__(self) -> int:
        return len(self._entries)

    def __eq__(self, other) -> bool:
        if isinstance(other, PlanHistory):
            return self._entries == other._entries
        return isinstance(other, list) and self._entries == other

    __hash__ = None  # mutable (record), compared by value

    def __repr__(self) -> str:
        return f"PlanHistory({self._entries!r})"
