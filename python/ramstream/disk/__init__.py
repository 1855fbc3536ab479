"""ramstream.disk: the disk (NVMe) tier's mechanism. A DiskStore keeps fixed-size records of cold
state in one scratch file and moves them to and from aligned host tensors on the core's own I/O
threads; measure_disk gives the rates the planner will use. Not yet wired into wrap() or
OffloadModel (issue 29)."""

from .store import DiskRequest, DiskStore, measure_disk

__all__ = ["DiskStore", "DiskRequest", "measure_disk"]
