"""The NVMe tier of the host optimizer state (wrap(nvme_offload=..., nvme_dir=...), issue 29).

Policy: `choose_disk_buckets` picks the host buckets whose state goes to disk (a share by bytes,
from the back of the stack: their gradients arrive first in backward, so their I/O overlaps the
rest of it). Mechanism: one `ramstream.disk.DiskStore` (C++ I/O threads, O_DIRECT when possible)
with one record per disk bucket: [fp32 master][exp_avg][exp_avg_sq] (the master stays in RAM for a
streamed fp32 bucket, whose master IS its slab home). A small pool of aligned pinned staging
buffers holds the buckets paged in: while bucket k is updated, k+1 is being read and k-1 written.

A disk bucket's `master` / `exp_avg` / `exp_avg_sq` are views into its staging buffer while paged
in, and "meta" tensors of the right size and dtype otherwise: never None, so code that reads
`b.exp_avg is None` as "another data-parallel rank owns this bucket" stays right, and any data
access outside a page-in fails loudly. `b.disk` is the tier (None: the state is in RAM).

Threads: `expect` runs on the training thread (the order update jobs were submitted in);
`updating` (host_jobs.update) on the engine thread; `paged`, `flush`, `raise_if_failed`, `close`
on the training thread with the engine idle (after synchronize). Disk I/O runs on the store's own
threads; the engine thread only waits.
"""

from __future__ import annotations

import collections
import contextlib
import threading

import torch

from .buckets import Bucket

STAGING_BUFFERS = 3  # bucket k updated, k+1 read ahead, k-1 written back
_STATE = ("master", "exp_avg", "exp_avg_sq")


def master_on_disk(b: Bucket) -> bool:
    """A streamed fp32 bucket's master is its slab home (layout._allocate_streamed): kept in RAM."""
    return not (b.streamed and b.slots[0].param.dtype == torch.float32)


def record_bytes(b: Bucket, moment_dtype: torch.dtype) -> int:
    m = torch.empty((), dtype=moment_dtype).element_size()
    return b.numel * (2 * m + (4 if master_on_disk(b) else 0))


def choose_disk_buckets(buckets: list[Bucket], share: float, moment_dtype: torch.dtype) -> list[Bucket]:
    """The buckets whose state goes to disk: `share` (0..1] of the state's bytes, taken from the
    back of the stack (last in forward order), a bucket counted when at least half of it fits."""
    if share <= 0:
        return []
    sizes = {b.index: record_bytes(b, moment_dtype) for b in buckets}
    total, taken, out = sum(sizes.values()), 0, []
    for b in reversed(buckets):
        if share >= 1.0 or taken + sizes[b.index] / 2 <= share * total:
            out.append(b)
            taken += sizes[b.index]
    return sorted(out, key=lambda b: b.index)


class _Page:
    """One disk bucket: its record, the layout of its state in the record, and the staging buffer
    holding it (None: only on disk) with the read or write in flight on it."""

    __slots__ = ("record", "nbytes", "parts", "buf", "read", "write", "dirty", "held")

    def __init__(self, record: int, parts: list, nbytes: int) -> None:
        self.record, self.parts, self.nbytes = record, parts, nbytes
        self.buf = self.read = self.write = None
        self.dirty = False  # its last write failed: the buffer holds the only current copy
        self.held = False  # paged in (b's state tensors are views of buf)


class DiskTier:
    def __init__(
        self,
        buckets: list[Bucket],
        directory: str,
        *,
        moment_dtype: torch.dtype,
        log=None,
        staging: int = STAGING_BUFFERS,
    ) -> None:
        """Opens the store (the file's space reserved now: a full disk is an OSError here, before
        any bucket is allocated) for `buckets`, whose state `adopt` then moves to disk."""
        from ..disk import DiskStore

        self.log = log or (lambda msg: None)
        self.moment_dtype = moment_dtype
        self.pages: dict[int, _Page] = {}
        sizes = []
        for i, b in enumerate(buckets):
            parts, off = [], 0
            for name in _STATE:
                if name == "master" and not master_on_disk(b):
                    continue
                dt = torch.float32 if name == "master" else moment_dtype
                parts.append((name, off, dt))
                off += b.numel * torch.empty((), dtype=dt).element_size()
            self.pages[b.index] = _Page(i, parts, off)
            sizes.append(off)
        self.state_bytes = sum(sizes)
        try:
            self.store = DiskStore(directory, sizes)
        except OSError as e:
            raise type(e)(
                e.errno,
                f"ramstream: nvme_dir={directory!r}: cannot hold the optimizer state of "
                f"{len(sizes)} buckets ({self.state_bytes} bytes needed): {e.strerror or e}",
            ) from e
        self.directory = directory
        self.largest = max(sizes, default=0)
        self.free: list[torch.Tensor] = []
        self.buffers = 0
        for _ in range(min(staging, len(sizes))):
            self.free.append(self._new_buffer())
        self.writing: collections.deque = collections.deque()  # pages with a write in flight
        self.expected: collections.deque = collections.deque()  # bucket indices, submission order
        self._lock = threading.Lock()
        self.errors: list[OSError] = []
        self.update_io = [0, 0]  # bytes read, written for updates (not adopt, not paged)
        self.reads_ahead = 0  # updates whose read was issued before they started (prefetch)
        self._down = sorted(self.pages, reverse=True)  # disk buckets, last in forward order first
        self.steps = 0

    def _new_buffer(self) -> torch.Tensor:
        from ..ops.memory import pinned_empty

        self.buffers += 1
        return pinned_empty(max(self.largest, 1), torch.uint8)

    # ---- construction -----------------------------------------------------------------------
    def adopt(self, b: Bucket) -> None:
        """Training thread, at construction: b's state (just allocated in RAM by layout.py) is
        written to its record and freed; b.disk is set."""
        pg = self.pages[b.index]
        buf = self._take_buffer()
        for name, off, dt in pg.parts:
            _view(buf, off, dt, b.numel).copy_(getattr(b, name))
        req = self.store.write_from(pg.record, buf[: pg.nbytes])
        try:
            req.wait()
        finally:
            self.free.append(buf)
        b.disk = self
        self._placeholders(b, pg)

    def _placeholders(self, b: Bucket, pg: _Page) -> None:
        for name, _, dt in pg.parts:
            setattr(b, name, torch.empty(b.numel, dtype=dt, device="meta"))
        pg.held = False

    def _bind(self, b: Bucket, pg: _Page) -> None:
        for name, off, dt in pg.parts:
            setattr(b, name, _view(pg.buf, off, dt, b.numel))
        pg.held = True

    # ---- buffers ----------------------------------------------------------------------------------
    def _reap(self, pg: _Page) -> None:
        """Waits for pg's write; its buffer goes back to the pool, or stays (dirty) on an error."""
        req, pg.write = pg.write, None
        try:
            req.wait()
        except OSError as e:
            pg.dirty = True  # the new state is only in the buffer: kept, written again later
            self.errors.append(e)
            return
        pg.dirty = False
        if not pg.held:
            self.free.append(pg.buf)
            pg.buf = None

    def _reap_done(self) -> None:
        while self.writing and self.writing[0].write is not None and self.writing[0].write.done():
            self._reap(self.writing.popleft())
        while self.writing and self.writing[0].write is None:
            self.writing.popleft()

    def _take_buffer(self) -> torch.Tensor:
        while not self.free:
            while self.writing and self.writing[0].write is None:
                self.writing.popleft()
            if self.writing:
                self._reap(self.writing.popleft())
                continue
            clean = [p for p in self.pages.values() if p.buf is not None and not p.held and not p.dirty]
            if clean:  # a read ahead not needed yet gives its buffer back
                p = clean[0]
                if p.read is not None:
                    p.read.wait()
                p.read = None
                self.free.append(p.buf)
                p.buf = None
                continue
            self.log(f"nvme: staging buffer {self.buffers + 1} allocated ({self.largest} bytes)")
            return self._new_buffer()
        return self.free.pop()

    def _start_read(self, pg: _Page, update: bool = False) -> None:
        pg.buf = self._take_buffer()
        pg.read = self.store.read_into(pg.record, pg.buf[: pg.nbytes])
        self.update_io[0] += pg.nbytes if update else 0

    def _page_in(self, b: Bucket, update: bool = False) -> _Page:
        pg = self.pages[b.index]
        self.reads_ahead += bool(update and pg.read is not None)
        if pg.write is not None:  # written back, not yet ended: the buffer still holds it
            self.writing.remove(pg)
            self._reap(pg)
        if pg.buf is None:
            self._start_read(pg, update)
        if pg.read is not None:
            req, pg.read = pg.read, None
            try:
                req.wait()
            except BaseException:
                self.free.append(pg.buf)
                pg.buf = None
                raise
        self._bind(b, pg)
        return pg

    def _page_out(self, b: Bucket, pg: _Page, update: bool = False) -> None:
        """Queues the write of b's state; its buffer returns to the pool when the write ended."""
        self._placeholders(b, pg)
        pg.write = self.store.write_from(pg.record, pg.buf[: pg.nbytes])
        self.writing.append(pg)
        self.update_io[1] += pg.nbytes if update else 0

    # ---- the update path ----------------------------------------------------------------------
    def expect(self, b: Bucket) -> None:
        """Training thread: an update job of b was submitted (reads ahead follow this order)."""
        if b.index in self.pages:
            with self._lock:
                self.expected.append(b.index)

    def _prefetch(self, current: int) -> None:
        """Reads ahead, into the buffers free: the buckets whose update jobs are queued, in the order
        the engine thread runs them (the lowest bucket index first: worker.py), then, when fewer are
        queued, the next buckets below this one (an eager backward lands them in that order), so
        the read of the next update overlaps this one instead of starting when its job does. A
        wrong guess costs a read, never a write: a clean read ahead gives its buffer back when one
        is needed."""
        want = max(1, self.buffers - 1)
        with self._lock:
            ahead = sorted(set(self.expected))[:want]
        if len(ahead) < want:
            at = self._down.index(current)
            ahead += [i for i in self._down[at + 1 : at + 1 + want] if i not in ahead][: want - len(ahead)]
        for i in ahead:
            pg = self.pages[i]
            if not self.free:
                break
            if pg.buf is None and pg.write is None:
                self._start_read(pg, update=True)

    @contextlib.contextmanager
    def updating(self, b: Bucket):
        """Engine thread, around b's AdamW: b's state paged in (its read ahead waited for, or
        read now), then written back asynchronously while the next buckets are read ahead."""
        with self._lock:
            if b.index in self.expected:
                self.expected.remove(b.index)
        self._reap_done()
        pg = self._page_in(b, update=True)
        self._prefetch(b.index)
        try:
            yield
        finally:
            self._page_out(b, pg, update=True)

    # ---- everything else: synchronous, engine idle ---------------------------------------------
    @contextlib.contextmanager
    def paged(self, b: Bucket, write: bool = False):
        """b's state paged in for the block (training thread, after synchronize()); with `write`
        it is written back (and waited for) at the end. Yields a PagedIn whose `write` the block
        may clear (nothing changed: no write)."""
        pg = self.pages[b.index]
        ctl = PagedIn(write)
        if pg.held:  # nested
            yield ctl
            return
        self._page_in(b)
        try:
            yield ctl
        finally:
            if ctl.write:
                self._page_out(b, pg)
                self.writing.remove(pg)
                self._reap(pg)
                self.raise_if_failed()
            else:
                self._placeholders(b, pg)
                if not pg.dirty:  # a dirty bucket's buffer is its only current copy: kept
                    self.free.append(pg.buf)
                    pg.buf = None

    def flush(self) -> None:
        """Waits for every read and write in flight; reads ahead are dropped."""
        while self.writing:
            pg = self.writing.popleft()
            if pg.write is not None:
                self._reap(pg)
        with self._lock:
            self.expected.clear()
        for pg in self.pages.values():
            if pg.buf is not None and not pg.held and not pg.dirty:
                if pg.read is not None:
                    with contextlib.suppress(OSError):
                        pg.read.wait()
                pg.read = None
                self.free.append(pg.buf)
                pg.buf = None

    def raise_if_failed(self) -> None:
        """A write that failed since the last call: OSError with its errno; the buckets it left
        dirty keep their state in RAM and are written again at their next update."""
        if not self.errors:
            return
        errs, self.errors = self.errors, []
        e = errs[0]
        dirty = [i for i, p in self.pages.items() if p.dirty]
        raise OSError(
            e.errno,
            f"ramstream: nvme_offload: writing optimizer state to nvme_dir={self.directory!r} failed "
            f"({len(errs)} writes): {e}; the state of buckets {dirty} is kept in RAM (pinned) and "
            "written again at their next update",
        ) from e

    def end_step(self) -> None:
        """Training thread, at each step() taken."""
        self.steps += 1

    def stats(self) -> dict:
        """Bytes of state on disk; bytes read and written in all (the first write at wrap(), state
        dicts and checkpoints included) and per step by the updates (issued, averaged over the
        steps taken: the SSD wear figure; a bucket updated again while its write-back is in
        flight is not read again); the staging buffers' bytes, the updates whose read was issued
        ahead (prefetched), the I/O mode and the folder."""
        st = self.store.stats() if not self.store.closed else {}
        per = max(1, self.steps)
        return {
            "nvme_state_bytes": self.state_bytes,
            "nvme_buckets": len(self.pages),
            "nvme_bytes_read": int(st.get("bytes_read", 0)),
            "nvme_bytes_written": int(st.get("bytes_written", 0)),
            "nvme_step_bytes_read": self.update_io[0] // per,
            "nvme_step_bytes_written": self.update_io[1] // per,
            "nvme_staging_bytes": self.buffers * self.largest,
            "nvme_reads_ahead": self.reads_ahead,
            "nvme_direct": bool(st.get("direct", False)),
            "nvme_dir": self.directory,
        }

    def close(self) -> None:
        """Waits for the I/O in flight, closes the store (its file is removed). Idempotent."""
        with contextlib.suppress(OSError):
            self.flush()
        self.store.close()


def _view(buf: torch.Tensor, off: int, dtype: torch.dtype, n: int) -> torch.Tensor:
    size = torch.empty((), dtype=dtype).element_size()
    return buf[off : off + n * size].view(dtype)


@contextlib.contextmanager
def paged(b: Bucket, write: bool = False):
    """b's state usable for the block wherever it lives (a no-op for a bucket in RAM); yields a
    PagedIn (DiskTier.paged)."""
    if getattr(b, "disk", None) is None:
        yield PagedIn(write)
        return
    with b.disk.paged(b, write) as ctl:
        yield ctl


class PagedIn:
    """What `paged` yields: `write` False skips the write-back of a block that changed nothing."""

    __slots__ = ("write",)

    def __init__(self, write: bool) -> None:
        self.write = write


class Paging:
    """Keeps at most one disk bucket paged in across consecutive calls (state dicts and
    checkpoints walk the slots in bucket order): ``with Paging(write) as page: page(b); ...``.
    A bucket in RAM is a no-op; with `write` each bucket is written back when the next one comes."""

    def __init__(self, write: bool = False) -> None:
        self.write, self.cur, self.ctx = write, None, None

    def __call__(self, b: Bucket) -> None:
        if b is self.cur:
            return
        self.close()
        if getattr(b, "disk", None) is not None:
            ctx = b.disk.paged(b, self.write)
            ctx.__enter__()
            self.cur, self.ctx = b, ctx

    def close(self) -> None:
        if self.ctx is not None:
            ctx, self.ctx, self.cur = self.ctx, None, None
            ctx.__exit__(None, None, None)

    def __enter__(self) -> Paging:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
