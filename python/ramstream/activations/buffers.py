"""The host side of activation paging (ActivationOffloader in hooks.py): pooled host buffers,
the copy engines that move bytes between the device and those buffers (CUDA streams and events, or
plain copies when the CPU is the device), and the records that tie a saved tensor to its host copy.

Test-only switches (module attributes, read at every copy): ``_TEST_POISON`` fills every host
buffer handed out and every device buffer an H2D copy lands in with 0xFF bytes (NaN in every float
dtype) before the copy, so bytes that a missing wait lets through are never right by chance;
``_TEST_SKIP_WAIT`` names one wait of the CUDA engine to leave out (one of ``SKIPPABLE_WAITS``),
so the GPU tests can show that they fail without it.
"""

from __future__ import annotations

import threading
import weakref
from collections import deque

import torch

from .._faults import fault_point

_TEST_POISON = False
_TEST_SKIP_WAIT: str | None = None
SKIPPABLE_WAITS = ("d2h_after_compute", "h2d_after_d2h", "compute_after_h2d")

__all__ = [
    "HostBuf",
    "HostPool",
    "byte_view",
    "CpuCopies",
    "CudaCopies",
    "Call",
    "Entry",
    "Saved",
    "Kept",
    "version_probe",
    "check_version",
]


# ---- host buffer pool --------------------------------------------------------------------------
# Pooled buffers of at least this size get their own page-locked allocation (not a slab block),
# so that what the pool gives back after a large batch goes back to the driver in full: pinned
# bytes then exceed the pool's kept bytes by at most the slabs holding its smaller buffers.
OWN_PAGES_MIN = 256 << 10


def _size_class(n: int) -> int:
    """Rounds a byte count up to one of 8 classes per power of two (<= 12.5 % waste, >= 4 KiB)."""
    if n <= 4096:
        return 4096
    step = max(4096, 1 << (n.bit_length() - 4))
    return (n + step - 1) // step * step


class HostBuf:
    """One pooled host buffer (a uint8 tensor of a size class) and the last copy reading it."""

    __slots__ = ("t", "size", "event", "tick")

    def __init__(self, t: torch.Tensor, size: int) -> None:
        self.t = t  # uint8 host tensor of `size` bytes
        self.size = size
        self.event = None  # the last copy reading from it (CUDA event) or None
        self.tick = 0  # when it was last given back (HostPool.seq): least recently used first


def _drop(bufs: list[HostBuf]) -> None:
    """Lets buffers go back to the arena, once the last copy reading them has finished (the arena
    does not track streams)."""
    for b in bufs:
        if b.event is not None:
            b.event.synchronize()
            b.event = None


class HostPool:
    """Host buffers by size class, reused across steps; pinned arena memory on CUDA.

    take()/give() are thread-safe (entries die on autograd's device thread). new_pass() is the
    give-back, called by the offloader at the start of each step: the pool records the highest
    bytes in use since the previous call (one step's need) and drops free buffers, least recently
    used first, until it holds at most the highest of the last ``window`` steps' needs and of the
    bytes in use now. So ``window`` steps after a large batch, smaller batches of one shape hold
    what one of their steps uses (their saved bytes rounded up to size classes: at most 12.5 % or
    4 KiB more per buffer) and nothing of the large batch. A pinned pool that dropped buffers also
    gives the arena's cached memory back to the driver (empty_cache: synchronises the device),
    otherwise the memory would stay page-locked in the arena's cache.
    """

    def __init__(self, pinned: bool, window: int = 2) -> None:
        self.pinned = pinned
        self.window = window
        self.free: dict[int, list[HostBuf]] = {}
        self.lock = threading.Lock()
        self.seq = 0
        self.closed = False
        self.bytes_held = 0
        self.bytes_in_use = 0
        self.peak_held = 0
        self.allocations = 0
        self.reuses = 0
        self.step_peak = 0  # the highest bytes_in_use since the last new_pass
        self.needs: deque[int] = deque(maxlen=window)  # step_peak of the last `window` steps
        self.committed: list[int] = []  # needs as of the last successful optimizer step
        self.bytes_dropped = 0
        self.trims = 0

    def stats(self) -> dict:
        """The pool's byte counts (ActivationOffloader.stats() documents them)."""
        with self.lock:
            return {
                "host_bytes_held": self.bytes_held,
                "host_bytes_in_use": self.bytes_in_use,
                "host_bytes_peak": self.peak_held,
                "host_allocations": self.allocations,
                "host_reuses": self.reuses,
                "host_bytes_high_water": self.high_water,
                "host_bytes_given_back": self.bytes_dropped,
                "host_trims": self.trims,
            }

    @property
    def high_water(self) -> int:
        """What new_pass() keeps: the highest bytes in use over the last ``window`` steps and now."""
        return max([self.step_peak, *self.needs])

    def take(self, nbytes: int) -> HostBuf:
        size = _size_class(nbytes)
        with self.lock:
            lst = self.free.get(size)
            buf = lst.pop() if lst else None
            if lst is not None and not lst:
                del self.free[size]
            self.bytes_in_use += size
            self.step_peak = max(self.step_peak, self.bytes_in_use)
            if buf is not None:
                self.reuses += 1
        if buf is None:
            try:
                fault_point("activations.buffer")
                if self.pinned:
                    from ..ops.memory import pinned_empty

                    t = pinned_empty(size, torch.uint8, own_pages=size >= OWN_PAGES_MIN)
                else:
                    t = torch.empty(size, dtype=torch.uint8)
            except BaseException:  # out of memory: the buffer was never handed out
                with self.lock:
                    self.bytes_in_use -= size
                raise
            with self.lock:
                self.allocations += 1
                self.bytes_held += size
                self.peak_held = max(self.peak_held, self.bytes_held)
            buf = HostBuf(t, size)
        if _TEST_POISON:
            _drop([buf])  # its last H2D has run: the fill cannot corrupt it
            buf.t.fill_(0xFF)  # NaN in every float dtype
        return buf

    def give(self, buf: HostBuf, event) -> None:
        buf.event = event
        with self.lock:
            self.seq += 1
            buf.tick = self.seq
            self.bytes_in_use -= buf.size
            if not self.closed:
                self.free.setdefault(buf.size, []).append(buf)
                return
            self.bytes_held -= buf.size
        _drop([buf])

    def new_pass(self) -> int:
        """Ends a step: drops free buffers beyond the high-water mark (see the class). Returns the
        bytes dropped."""
        with self.lock:
            self.needs.append(self.step_peak)
            self.step_peak = self.bytes_in_use
        return self._drop_free_beyond(lambda: self.high_water)

    def commit(self) -> None:
        """An optimizer step succeeded: the needs recorded so far belong to completed steps."""
        with self.lock:
            self.committed = list(self.needs)

    def forget_failed_pass(self) -> int:
        """A step failed (out of memory in forward, say): the needs of its passes do not count,
        and free buffers beyond what the completed steps needed (and what is in use now) are
        dropped at once, so the failed step leaves the pinned bytes in use as they were. Returns
        the bytes dropped."""
        with self.lock:
            self.step_peak = self.bytes_in_use
            self.needs = deque(self.committed, maxlen=self.window)
        return self._drop_free_beyond(lambda: max([self.bytes_in_use, *self.needs]), newest_first=True)

    def _drop_free_beyond(self, keep_fn, newest_first: bool = False) -> int:
        """Drops free buffers, least recently used first (the failed pass's: newest first), until
        the pool holds at most keep_fn() bytes."""
        with self.lock:
            keep = keep_fn()
            excess = self.bytes_held - keep
            dropped: list[HostBuf] = []
            if excess > 0 and self.free:
                lru = sorted((b for lst in self.free.values() for b in lst), key=lambda b: (b.tick, -b.size))
                if newest_first:
                    lru.reverse()
                for b in lru:
                    if excess <= 0:
                        break
                    dropped.append(b)
                    excess -= b.size
                gone = {id(b) for b in dropped}
                for size in [s for s in self.free]:
                    lst = [b for b in self.free[size] if id(b) not in gone]
                    if lst:
                        self.free[size] = lst
                    else:
                        del self.free[size]
                n = sum(b.size for b in dropped)
                self.bytes_held -= n
                self.bytes_dropped += n
                del lru, b
        _drop(dropped)
        n = sum(b.size for b in dropped)
        # the last references go before the trim: a buffer still referenced here would reach the
        # arena's cache only after empty_cache() and stay page-locked there
        dropped.clear()
        if n and self.pinned:
            from ..ops.memory import empty_cache

            empty_cache()
            with self.lock:
                self.trims += 1
        return n

    def close(self) -> None:
        """Drops the free buffers; buffers still in use are dropped when given back."""
        with self.lock:
            self.closed = True
            dropped = [b for lst in self.free.values() for b in lst]
            self.bytes_held -= sum(b.size for b in dropped)
            self.free.clear()
        _drop(dropped)

    def reopen(self) -> None:
        with self.lock:
            self.closed = False


# ---- copies: CUDA streams or plain CPU copies ---------------------------------------------------
def byte_view(storage: torch.UntypedStorage, device: torch.device, lo: int, n: int) -> torch.Tensor:
    return torch.empty(0, dtype=torch.uint8, device=device).set_(storage, lo, (n,), (1,))


class CpuCopies:
    """The CPU as the device: copies are synchronous, events are None."""

    pinned = False

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def to_host(self, buf: HostBuf, src: torch.Tensor) -> None:
        buf.t[: src.numel()].copy_(src)

    def d2h_event(self):
        return None

    def to_device(self, buf: HostBuf, n: int, after=None) -> tuple[torch.Tensor, object]:
        out = torch.empty(n, dtype=torch.uint8, device=self.device)
        if _TEST_POISON:
            out.fill_(0xFF)
        out.copy_(buf.t[:n])
        return out, None

    def use_on_current(self, entry) -> None:
        pass

    def stall_seconds(self) -> float:
        return 0.0

    def mark(self):
        return None


class CudaCopies:
    """D2H and H2D streams; events order them against torch's current stream."""

    pinned = True

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.d2h = torch.cuda.Stream(device)
        self.h2d = torch.cuda.Stream(device)
        self._lock = threading.Lock()
        self._timed: list = []

    def to_host(self, buf: HostBuf, src: torch.Tensor) -> None:
        """Queues the copy after the work queued so far on the current stream; the source's memory
        is not reused by the caching allocator before the copy has run (record_stream)."""
        if _TEST_SKIP_WAIT != "d2h_after_compute":
            self.d2h.wait_stream(torch.cuda.current_stream(self.device))
        if buf.event is not None:  # the last H2D out of this buffer
            self.d2h.wait_event(buf.event)
            buf.event = None
        with torch.cuda.stream(self.d2h):
            buf.t[: src.numel()].copy_(src, non_blocking=True)
        src.record_stream(self.d2h)

    def d2h_event(self):
        ev = torch.cuda.Event()
        ev.record(self.d2h)
        return ev

    def to_device(self, buf: HostBuf, n: int, after=None) -> tuple[torch.Tensor, object]:
        """Allocates n bytes from the H2D stream's pool and queues the copy there."""
        with torch.cuda.stream(self.h2d):
            if after is not None and _TEST_SKIP_WAIT != "h2d_after_d2h":
                self.h2d.wait_event(after)
            out = torch.empty(n, dtype=torch.uint8, device=self.device)
            if _TEST_POISON:
                out.fill_(0xFF)
            out.copy_(buf.t[:n], non_blocking=True)
            ev = torch.cuda.Event()
            ev.record(self.h2d)
        return out, ev

    def use_on_current(self, entry) -> None:
        """The current stream waits for the entry's H2D; its memory stays reserved for the
        current stream's queued work after the entry dies. The first wait per entry and stream is
        bracketed by timing events: the GPU time it stalled (stall_seconds)."""
        cur = torch.cuda.current_stream(self.device)
        sid = cur.stream_id
        wait = _TEST_SKIP_WAIT != "compute_after_h2d"
        if entry.used_on == sid:
            if wait:
                cur.wait_event(entry.h2d_event)
            return
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record(cur)
        if wait:
            cur.wait_event(entry.h2d_event)
        end.record(cur)
        with self._lock:
            self._timed.append((start, end))
            if len(self._timed) > 100_000:  # never polled: keep the newest
                del self._timed[:50_000]
        entry.gpu.record_stream(cur)
        entry.used_on = sid

    def mark(self):
        """An event recorded on the current stream (where compute has got to)."""
        ev = torch.cuda.Event()
        ev.record(torch.cuda.current_stream(self.device))
        return ev

    def stall_seconds(self) -> float:
        """GPU time the compute stream waited for H2D copies, over the waits completed since the
        last call (a wait not yet run on the GPU is counted at a later call)."""
        with self._lock:
            timed, self._timed = self._timed, []
        total, pending = 0.0, []
        for start, end in timed:
            if end.query():
                total += start.elapsed_time(end) / 1e3
            else:
                pending.append((start, end))
        if pending:
            with self._lock:
                self._timed = pending + self._timed
        return total


# ---- entries, handles, call records -------------------------------------------------------------
class Call:
    """One forward call of one block: the entries it paged (weakly), the calls before it (strong)
    and after it (weak), its last D2H event and the event marking that backward reached it."""

    __slots__ = (
        "index",
        "pass_id",
        "prev",
        "next",
        "entries",
        "fetched",
        "d2h_event",
        "bwd_event",
        "__weakref__",
    )

    def __init__(self, index: int, pass_id: int, prev) -> None:
        self.index = index
        self.pass_id = pass_id
        self.prev = prev
        self.next = None  # weakref to the next call of the pass
        self.entries: list[weakref.ref] = []
        self.fetched = False
        self.d2h_event = None
        self.bwd_event = None


class Entry:
    """A byte range [lo, lo + nbytes) of one device storage, copied into a host buffer.

    Lives as long as a handle (saved tensor) refers to it: when autograd frees the last one (after
    backward used it, or when the graph dies) the host buffer returns to the pool.
    """

    __slots__ = (
        "owner",
        "call",
        "buf",
        "lo",
        "nbytes",
        "d2h_event",
        "gpu",
        "h2d_event",
        "used_on",
        "__weakref__",
    )

    def __init__(self, owner, call: Call, buf: HostBuf, lo: int, nbytes: int) -> None:
        self.owner = owner
        self.call = call
        self.buf = buf
        self.lo = lo
        self.nbytes = nbytes
        self.d2h_event = None
        self.gpu: torch.Tensor | None = None
        self.h2d_event = None
        self.used_on = None

    def __del__(self) -> None:
        owner, buf = self.owner, self.buf
        if owner is None or buf is None:
            return
        self.buf = None
        try:
            owner._release(buf, self.h2d_event if self.h2d_event is not None else self.d2h_event)
        except Exception:  # pragma: no cover - interpreter shutdown
            pass


class Saved:
    """What pack returns for a paged tensor: its entry, its exact layout and what checks that it
    was not modified in place after it was saved (``probe``, ``version``: version_probe)."""

    __slots__ = ("entry", "dtype", "size", "stride", "offset", "probe", "version", "index")

    def __init__(
        self, entry: Entry, dtype, size, stride, offset: int, probe: torch.Tensor, version: int, index: int
    ) -> None:
        self.entry = entry
        self.dtype = dtype
        self.size = size
        self.stride = stride
        self.offset = offset  # in elements of dtype, from the start of the entry's bytes
        self.probe = probe
        self.version = version
        self.index = index  # the block that saved it (for the error message)


class Kept:
    """What pack returns for a tensor of a hooked block that stays on the device: the tensor and
    its version when it was saved. torch checks the versions of saved tensors only when no
    saved-tensor hooks are installed, so the hooks check them (check_version)."""

    __slots__ = ("t", "version", "index")

    def __init__(self, t: torch.Tensor, index: int) -> None:
        self.t = t.detach()  # not t: its grad_fn may be the node holding this (a cycle)
        self.version = t._version
        self.index = index


def version_probe(t: torch.Tensor) -> torch.Tensor:
    """A tensor sharing t's version counter but not its storage (detach() shares the counter;
    replacing its data keeps the counter and drops the storage reference): in-place writes to t
    or to any view of it show in probe._version while t's memory can be freed."""
    probe = t.detach()
    probe.data = t.new_empty(0)
    return probe


def check_version(current: int, x) -> None:
    """Raises torch's own error when a saved tensor was modified in place after it was saved."""
    if current != x.version:
        t = x.t if type(x) is Kept else x
        raise RuntimeError(
            "one of the variables needed for gradient computation has been modified by an "
            f"inplace operation: [{t.dtype} {list(t.size() if type(x) is Kept else t.size)}], "
            f"saved for backward in block {x.index}, is at version {current}; expected version "
            f"{x.version} instead. (ActivationOffloader checks the versions that torch does "
            "not check behind saved-tensor hooks; without paging torch raises the same error.)"
        )
