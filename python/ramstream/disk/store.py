"""DiskStore: cold state in one scratch file, read into and written from aligned host tensors by
the C++ core's own I/O threads; and measure_disk, the disk's read and write rates through it."""

from __future__ import annotations

import os
import time
import weakref

import torch

from .._native import lib

__all__ = ["DiskStore", "DiskRequest", "measure_disk"]

_MIB = 1 << 20


class DiskRequest:
    """A queued read or write. ``wait()`` blocks until it ended (the GIL released) and raises its
    error: OSError with the errno (ENOSPC, EFBIG, EIO, ...) and the path, record and offset.
    The tensor is kept alive until then. Dropped without ``wait()``, it waits in ``__del__``
    (a failed write still shows: its record refuses reads and ``stats()["errors"]`` counts it)."""

    __slots__ = ("_native", "_ticket", "_tensor", "_waited", "__weakref__")

    def __init__(self, native, ticket: int, tensor: torch.Tensor):
        self._native = native
        self._ticket = ticket
        self._tensor = tensor
        self._waited = False

    def wait(self) -> torch.Tensor:
        """Blocks until the request ended; returns the tensor. A second call returns at once."""
        if not self._waited:
            self._waited = True
            try:
                self._native.wait(self._ticket)
            finally:
                self._native = None
        return self._tensor

    def done(self) -> bool:
        """True when the request ended (``wait()`` will not block)."""
        return self._waited or bool(self._native.done(self._ticket))

    def __del__(self):
        if not self._waited and self._native is not None:
            try:  # the core may still read or write the tensor: it must not be freed before that
                self._native.wait(self._ticket)
            except Exception:  # noqa: BLE001 - reported through the record and stats()
                pass


def _close(native) -> None:
    native.close()


class DiskStore:
    """Fixed-size records (one per bucket of cold state) in one file under ``directory``.

    Args:
        directory: where the file goes (a path; it must exist). Missing or not writable: OSError
            naming the path (FileNotFoundError, PermissionError, NotADirectoryError).
        record_bytes: the size in bytes of each record (0 allowed). Each takes its size rounded up
            to ``alignment`` in the file, which is reserved at open (``preallocate``): a full disk
            or a file-size limit is then an OSError here, not at a later write.
        chunk_bytes: requests are split into chunks of this size (a multiple of ``alignment``),
            ``io_threads`` of them in flight together.
        unlink_on_open: remove the file's name right after creating it (the default), so that a
            crash or kill leaves nothing; False keeps it visible (``path``) until ``close()``.
        preallocate: reserve the file's space at open (fallocate).
        direct: None: O_DIRECT when the filesystem takes it, else buffered (``direct`` says
            which); True: O_DIRECT or RuntimeError; False: buffered.

    The file is created exclusively (O_EXCL, no symlink followed) with mode 0600 and removed by
    ``close()``, by the context manager (also on an exception), when the object is garbage
    collected, and at interpreter exit. Tensors passed to ``read_into``/``write_from`` must be
    contiguous CPU tensors of exactly the record's bytes whose data start at a multiple of
    ``alignment`` (``ramstream.pinned_empty`` gives such tensors); otherwise ValueError. Records are
    independent; a failed write leaves its own record undefined (reads of it raise OSError EIO until
    it is written again) and nothing else; keep the source tensor until its ``wait()`` returned.
    One record takes several reads or one write in flight at a time (ValueError otherwise).
    Thread-safe; I/O runs with the GIL released.
    """

    def __init__(
        self,
        directory: str | os.PathLike,
        record_bytes,
        *,
        chunk_bytes: int = 8 * _MIB,
        io_threads: int = 4,
        unlink_on_open: bool = True,
        preallocate: bool = True,
        direct: bool | None = None,
    ):
        directory = os.fspath(directory)
        if not isinstance(directory, str):
            raise TypeError(f"DiskStore: directory must be a str path, got {directory!r}")
        sizes = [int(b) for b in record_bytes]
        if any(b < 0 for b in sizes):
            raise ValueError(f"DiskStore: record_bytes must be >= 0, got {sizes}")
        if direct not in (None, True, False):
            raise ValueError(f"DiskStore: direct must be None, True or False, got {direct!r}")
        for name, v in (("chunk_bytes", chunk_bytes), ("io_threads", io_threads)):
            if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
                raise ValueError(f"DiskStore: {name} must be a positive int, got {v!r}")
        self._sizes = sizes
        self._native = lib().DiskStore(
            directory,
            sizes,
            chunk_bytes=chunk_bytes,
            io_threads=io_threads,
            unlink_on_open=bool(unlink_on_open),
            preallocate=bool(preallocate),
            direct=-1 if direct is None else int(direct),
        )
        self.directory = directory
        self._finalizer = weakref.finalize(self, _close, self._native)  # also at exit

    # -- requests -------------------------------------------------------------------------------
    def _check(self, i: int, tensor: torch.Tensor, what: str) -> None:
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"DiskStore.{what}: tensor must be a torch.Tensor, got {type(tensor).__name__}")
        if tensor.device.type != "cpu":
            raise ValueError(f"DiskStore.{what}: tensor must be on the CPU, got {tensor.device}")
        if not isinstance(i, int) or isinstance(i, bool) or not 0 <= i < len(self._sizes):
            raise ValueError(f"DiskStore.{what}: record must be an int in [0, {len(self._sizes)}), got {i!r}")
        nbytes = tensor.numel() * tensor.element_size()
        if nbytes != self._sizes[i]:
            raise ValueError(
                f"DiskStore.{what}: record {i} holds {self._sizes[i]} bytes, the tensor {nbytes}"
            )

    def read_into(self, i: int, tensor: torch.Tensor) -> DiskRequest:
        """Queues a read of record ``i`` into ``tensor``; returns a DiskRequest to ``wait()`` on.
        A record never written reads as zeros."""
        self._check(i, tensor, "read_into")
        return DiskRequest(self._native, self._native.read(i, _flat_bytes(tensor)), tensor)

    def write_from(self, i: int, tensor: torch.Tensor) -> DiskRequest:
        """Queues a write of ``tensor`` into record ``i``; returns a DiskRequest to ``wait()`` on."""
        self._check(i, tensor, "write_from")
        return DiskRequest(self._native, self._native.write(i, _flat_bytes(tensor)), tensor)

    # -- state ------------------------------------------------------------------------------------
    @property
    def direct(self) -> bool:
        """True: O_DIRECT I/O; False: buffered (the filesystem refused O_DIRECT, or direct=False)."""
        return bool(self._native.direct)

    @property
    def alignment(self) -> int:
        """Bytes that tensor addresses and record extents are aligned to."""
        return int(self._native.alignment)

    @property
    def path(self) -> str:
        """The file's path (already removed from the directory when ``unlink_on_open``)."""
        return str(self._native.path)

    @property
    def record_bytes(self) -> list[int]:
        return list(self._sizes)

    @property
    def closed(self) -> bool:
        return not self._native.is_open

    def stats(self) -> dict:
        """Counters since open: bytes_read, bytes_written, reads, writes, errors, read_seconds and
        write_seconds (wall time with a request of that kind in flight), plus direct, alignment,
        file_bytes and path."""
        d = dict(self._native.stats())
        d.update(
            direct=self.direct,
            alignment=self.alignment,
            file_bytes=int(self._native.file_bytes),
            path=self.path,
        )
        return d

    def close(self) -> None:
        """Waits for every request, closes the file and removes it. Idempotent."""
        self._finalizer.detach()
        self._native.close()

    def __enter__(self) -> DiskStore:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        mode = "direct" if self.direct else "buffered"
        return (
            f"DiskStore({self.path!r}, {len(self._sizes)} records, {mode}{', closed' if self.closed else ''})"
        )


def _flat_bytes(t: torch.Tensor) -> torch.Tensor:
    """A 1-D uint8 view of a tensor's bytes (the core checks contiguity and alignment)."""
    if not t.is_contiguous():
        raise ValueError("DiskStore: tensor must be contiguous (call .contiguous() first)")
    return t.reshape(-1).view(torch.uint8) if t.numel() else torch.empty(0, dtype=torch.uint8)


def measure_disk(
    directory: str | os.PathLike,
    size: int = 256 * _MIB,
    *,
    record_bytes: int = 64 * _MIB,
    chunk_bytes: int = 8 * _MIB,
    io_threads: int = 4,
    direct: bool | None = None,
) -> dict:
    """The disk's rates as the store sees them: ``size`` bytes written in records of
    ``record_bytes`` (all queued at once), written again (timed: an overwrite, as each step's
    write-back is), then read back (timed). Returns ``{"read_gbps", "write_gbps", "direct",
    "bytes", "alignment"}`` (GB/s = 1e9 bytes/s). With ``direct`` False (a filesystem without
    O_DIRECT) reads may come from the page cache and overstate the disk. Writes ``2 * size`` bytes.
    """
    from ..ops.memory import pinned_empty  # noqa: PLC0415 - the arena, on first use only

    if size <= 0 or record_bytes <= 0:
        raise ValueError(f"measure_disk: size and record_bytes must be > 0, got {size}, {record_bytes}")
    rec = min(int(record_bytes), int(size))
    n = -(-int(size) // rec)
    buf = pinned_empty(rec, torch.uint8)
    buf.copy_(torch.randint(0, 256, (rec,), dtype=torch.uint8))  # nothing a filesystem could compress
    out = pinned_empty(rec, torch.uint8)
    with DiskStore(directory, [rec] * n, chunk_bytes=chunk_bytes, io_threads=io_threads, direct=direct) as st:

        def timed(fn) -> float:
            t0 = time.perf_counter()
            for r in [fn(i) for i in range(n)]:
                r.wait()
            return time.perf_counter() - t0

        timed(lambda i: st.write_from(i, buf))  # first write: allocates the extents
        w = timed(lambda i: st.write_from(i, buf))
        r = timed(lambda i: st.read_into(i, out))
        return {
            "read_gbps": n * rec / r / 1e9,
            "write_gbps": n * rec / w / 1e9,
            "direct": st.direct,
            "bytes": n * rec,
            "alignment": st.alignment,
        }
