"""Byte ranges of checkpoint files for load_model, and a bounded runner that processes them on a
few threads: each range is mapped on its own (or read with pread), used and unmapped, so that only
the ranges in flight count in the process's RSS, never a whole file; a tensor the model keeps as
it is stored can instead stay a private mapping of its bytes (map_tensor)."""

from __future__ import annotations

import collections
import ctypes
import mmap
import os
import threading
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor

import torch

__all__ = [
    "interleave",
    "map_tensor",
    "read_into",
    "run_bounded",
    "usable_cores",
    "with_range",
]

_MAP_MIN = 1 << 20  # ranges below this are read (pread) rather than mapped
_POPULATE_MIN = 1 << 20  # fresh destinations from this size are populated before the read
_MADV_POPULATE_READ = 22  # Linux 5.14
_MADV_POPULATE_WRITE = 23
# A mapped range's pages are mapped in one madvise(MADV_POPULATE_READ) on the reading thread
# before its function runs, so that the function (the packing kernel, on the whole thread pool)
# meets no page faults: on the H200 host (16 cores) a 7B-shaped NF4 load took 0.69-0.74 s with
# it against 0.82-0.86 s without (bench/train/probe_load.py, bench/RESULTS.md seventh session).
_POPULATE_RANGES = True
_madvise = None


def _advise(ptr: int, n: int, advice: int) -> None:
    """madvise over the whole pages within [ptr, ptr + n). A hint: any failure (an older kernel,
    no glibc) leaves the faults to the code that touches the pages."""
    global _madvise
    if _madvise is None:
        try:
            fn = ctypes.CDLL(None, use_errno=True).madvise
            fn.argtypes, fn.restype = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int], ctypes.c_int
            _madvise = fn
        except (OSError, AttributeError):  # pragma: no cover - not Linux / glibc
            _madvise = False
    page = mmap.PAGESIZE
    lo = -(-ptr // page) * page
    hi = (ptr + n) // page * page
    if _madvise and hi > lo:
        _madvise(lo, hi - lo, advice)


def _populate(dst: torch.Tensor, n: int) -> None:
    """Faults in the pages of ``dst`` (n bytes) in one call (MADV_POPULATE_WRITE) rather than one
    fault per page inside the read's copy: 13 % less time for a read into fresh memory (a 229 MB
    read 113 -> 98 ms)."""
    _advise(dst.data_ptr(), n, _MADV_POPULATE_WRITE)


def usable_cores() -> int:
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # pragma: no cover - not Linux
        return max(1, os.cpu_count() or 1)


def _check_size(fd: int, path: str, offset: int, nbytes: int) -> None:
    size = os.fstat(fd).st_size
    if offset + nbytes > size:
        raise ValueError(
            f"bytes {offset}..{offset + nbytes} lie past the end of the file ({size} bytes): it shrank "
            "after its header was read"
        )


def read_into(path: str, offset: int, dst: torch.Tensor) -> None:
    """Fills the contiguous CPU tensor ``dst`` with the file's bytes from ``offset`` (pread: one
    copy out of the page cache, nothing mapped; the GIL is released while the kernel copies).
    ValueError when the file ends first. Thread-safe."""
    n = dst.numel() * dst.element_size()
    if n == 0:
        return
    view = memoryview(dst.view(-1).view(torch.uint8).numpy())
    fd = os.open(path, os.O_RDONLY)
    try:
        _check_size(fd, path, offset, n)
        if n >= _POPULATE_MIN:
            _populate(dst, n)
        done = 0
        while done < n:
            got = os.preadv(fd, [view[done:]], offset + done)
            if got <= 0:
                raise ValueError(f"the file ended {n - done} bytes early at byte {offset + done}")
            done += got
    finally:
        os.close(fd)


def with_range(path: str, offset: int, nbytes: int, fn: Callable[[torch.Tensor], object], align: int = 1):
    """``fn(t)`` for a uint8 CPU tensor ``t`` of the file's bytes [offset, offset + nbytes), and
    its result: ``t`` is a private (copy-on-write) mapping of just those pages, unmapped as soon as
    ``fn`` returns, so they leave RSS right away; ``fn``'s result must not view ``t``. Small or
    misaligned ranges (offset not a multiple of ``align``, the element size ``fn`` views them as)
    are read into a new buffer instead. Thread-safe."""
    if nbytes < _MAP_MIN or offset % align:
        buf = torch.empty(nbytes, dtype=torch.uint8)
        read_into(path, offset, buf)
        return fn(buf)
    mm, base = _map_private(path, offset, nbytes)
    try:
        t = torch.frombuffer(mm, dtype=torch.uint8, count=nbytes, offset=offset - base)
        if _POPULATE_RANGES:
            _advise(t.data_ptr(), nbytes, _MADV_POPULATE_READ)
        return fn(t)
    finally:
        try:
            mm.close()
        except BufferError:  # fn kept a view (or a traceback holds one): unmapped when collected
            pass


def _map_private(path: str, offset: int, nbytes: int) -> tuple[mmap.mmap, int]:
    """(a private, copy-on-write mapping of the pages holding the file's bytes [offset, offset +
    nbytes), the file offset it starts at); the size is checked against the file first."""
    base = offset - offset % mmap.ALLOCATIONGRANULARITY
    fd = os.open(path, os.O_RDONLY)
    try:
        _check_size(fd, path, offset, nbytes)
        return mmap.mmap(fd, offset + nbytes - base, access=mmap.ACCESS_COPY, offset=base), base
    finally:
        os.close(fd)


def map_tensor(path: str, offset: int, shape: tuple, dtype: torch.dtype) -> torch.Tensor:
    """A CPU tensor of ``shape`` and ``dtype`` over the file's bytes from ``offset``, as a private
    (copy-on-write) mapping of just those pages: nothing is read or copied now; a page comes from
    the page cache when first touched (and only then counts in RSS, as file memory the kernel can
    drop and read again), and a write copies only the page written: the file never changes. The
    mapping lives as long as the tensor's storage (torch.frombuffer keeps it). As for
    from_pretrained's tensors, the file must keep its bytes meanwhile: truncating it or rewriting
    it in place shows through (a read past a truncated end is SIGBUS); deleting it or renaming a
    new file over it is safe. ``offset`` must be a multiple of the element size and the tensor
    non-empty (ValueError otherwise, or when the file ends first). Thread-safe."""
    numel = torch.Size(shape).numel()
    nbytes = numel * dtype.itemsize
    if numel == 0 or offset % dtype.itemsize:
        raise ValueError(f"cannot map {numel} elements of {dtype} at byte {offset}")
    mm, base = _map_private(path, offset, nbytes)
    return torch.frombuffer(mm, dtype=dtype, count=numel, offset=offset - base).view(shape)


Job = tuple[int, Callable[[], None], Callable[[], None] | None]


def run_bounded(jobs: Iterable[Job], *, workers: int, cap: int, on_admit=None) -> None:
    """Runs ``work()`` of each job ``(size, work, done)`` on up to ``workers`` threads, admitting a
    job only while the sizes of the jobs in flight stay within ``cap`` bytes (a job larger than
    ``cap`` runs when nothing else does); ``done()`` (or None) runs on the calling thread, in the
    order of ``jobs``, once that job and every job before it have finished, so the results never
    depend on thread timing. ``jobs`` is consumed lazily (a job is made when it can be admitted).
    ``on_admit(bytes in flight)``: an observer, for tests.

    The first error (in job order) of a work or done is raised after every job already started has
    finished; later jobs are not started. No thread is left running."""
    cond = threading.Condition()
    state = {"in_flight": 0, "failed": False}

    def run(size: int, work: Callable[[], None]) -> None:
        try:
            work()
        except BaseException:
            state["failed"] = True
            raise
        finally:
            with cond:
                state["in_flight"] -= size
                cond.notify_all()

    pending: collections.deque = collections.deque()

    def drain(wait: bool) -> None:
        while pending and (wait or pending[0][0].done()):
            fut, done = pending.popleft()
            fut.result()  # the job's error, if any
            if done is not None:
                done()

    pool = ThreadPoolExecutor(max(1, workers), thread_name_prefix="ramstream-load")
    try:
        for size, work, done in jobs:
            with cond:
                while state["in_flight"] and state["in_flight"] + size > cap and not state["failed"]:
                    cond.wait()
                if state["failed"]:
                    break
                state["in_flight"] += size
                if on_admit is not None:
                    on_admit(state["in_flight"])
            pending.append((pool.submit(run, size, work), done))
            drain(False)
        drain(True)
    finally:
        pool.shutdown(wait=True, cancel_futures=True)


def interleave(streams: list[tuple[int, Iterable[Job]]]) -> Iterable[Job]:
    """The jobs of every ``(total, jobs)`` stream, each stream in its own order, merged so that the
    streams advance together: next comes the stream with the smallest share of its ``total`` (in
    the unit of the jobs' sizes) already yielded, ties to the earlier stream. The order depends
    only on the sizes, never on timing. load_model interleaves the tensors it copies with those it
    packs, so that the copies run beside the packing (which keeps every core busy on its own)
    instead of alone, one after another. Lazy: a stream's next job is made when it is its turn."""
    live = [[0, max(1, total), iter(jobs)] for total, jobs in streams]
    while live:
        s = min(live, key=lambda s: s[0] / s[1])
        job = next(s[2], None)
        if job is None:
            live.remove(s)
            continue
        s[0] += job[0]
        yield job
