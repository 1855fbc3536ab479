"""Activation paging's hooks: saved tensors of chosen blocks go to host RAM in forward and come back
ahead of the backward pass (saved_tensors_hooks); find_blocks() (blocks.py) finds the blocks.

Mechanism only: which blocks page is decided by the caller (planner.py, wrap()). Works with a CUDA
device (pinned arena buffers, a D2H and an H2D copy stream ordered by events) and with the CPU as
the "device" (plain copies into pooled host buffers, no streams), so CI tests the same logic.
The host buffers, the copy engines and the saved-tensor records live in buffers.py.

    off = ActivationOffloader(find_blocks(model), torch.device("cuda"), prefetch_depth=1)
    off.attach(); off.set_paged({0, 1, 2})
    loss = model(x); loss.backward()    # blocks 0-2 kept their large saved tensors on the host
    off.detach()
"""

from __future__ import annotations

import threading
import time
import weakref
from collections.abc import Callable, Iterable

import torch
import torch.nn as nn

from .._faults import fault_point
from ..blocks import ranges_text as _ranges
from .buffers import (
    Call,
    CpuCopies,
    CudaCopies,
    Entry,
    HostBuf,
    HostPool,
    Kept,
    Saved,
    byte_view,
    check_version,
    version_probe,
)
from .records import PassRecords, top_hooks_are_checkpoint

__all__ = ["ActivationOffloader"]

_NO_CALL = 1 << 62  # "no block called yet": the next call starts a forward pass


# ---- the offloader ------------------------------------------------------------------------------
class ActivationOffloader:
    """Pages the large saved tensors of chosen blocks to host RAM and brings them back in backward.

    Args:
        blocks: the block modules (e.g. ``find_blocks(model)``), in forward order.
        device: the compute device: ``cuda[:N]`` (pinned arena buffers, copy streams, events) or
            ``cpu`` (the CPU engine: plain copies into pooled host buffers, used by CI).
        prefetch_depth: when backward reaches a block (the gradient of its output, or its first
            saved tensor), its saved tensors and those of the next ``prefetch_depth`` paged blocks
            in backward order start coming back.
        min_offload_bytes: saved tensors smaller than this stay on the device.
        d2h_lag: a paged block's forward starts once the copies to the host of the paged block
            ``d2h_lag`` calls before it have finished (the forward thread waits), which bounds the
            device memory held by copies still in flight.
        pool_window: the host buffer pool keeps, at the start of each step, at most the highest
            bytes in use over the last ``pool_window`` steps (and those in use now); free buffers
            beyond that are given back, least recently used first (HostPool in buffers.py).
        log: an optional callable taking one string (decisions, e.g. EventLog).

    A saved tensor is paged when its block is paged, the module is in training mode, grad is
    enabled, it is a plain strided tensor on ``device`` of at least ``min_offload_bytes`` and it is
    not a parameter or buffer (nor a view of one's storage). Storages are copied once per forward
    pass however many views of them are saved; a view covering less than half of its storage is
    copied as its byte span only. Unpacked tensors have the saved tensor's dtype, size, stride and
    storage offset (and alignment modulo 512 bytes). Nothing is paged inside the recomputation of
    torch.utils.checkpoint (its own hooks own those tensors) or during backward. A tensor saved
    in a hooked block and then modified in place raises torch's "modified by an inplace
    operation" error in backward, as without paging (torch checks no versions behind hooks, so
    the unpack hook does, for paged and kept tensors alike).

    Threading: forward hooks run on the forward thread; unpack runs on autograd's thread; host
    buffers are returned to the pool from whichever thread frees the last saved-tensor handle.
    """

    def __init__(
        self,
        blocks: Iterable[nn.Module],
        device,
        *,
        prefetch_depth: int = 1,
        min_offload_bytes: int = 1 << 20,
        d2h_lag: int = 2,
        pool_window: int = 2,
        log: Callable[[str], None] | None = None,
    ) -> None:
        blocks = list(blocks)
        if not blocks or not all(isinstance(b, nn.Module) for b in blocks):
            raise ValueError("ActivationOffloader: blocks must be a non-empty list of nn.Module")
        if len({id(b) for b in blocks}) != len(blocks):
            raise ValueError("ActivationOffloader: blocks must not list a module twice")
        for name, value, lo in (
            ("prefetch_depth", prefetch_depth, 1),
            ("d2h_lag", d2h_lag, 1),
            ("pool_window", pool_window, 1),
            ("min_offload_bytes", min_offload_bytes, 0),
        ):
            if isinstance(value, bool) or not isinstance(value, int) or value < lo:
                raise ValueError(f"ActivationOffloader: {name} must be an int >= {lo}, got {value!r}")
        device = torch.device(device)
        if device.type == "cuda":
            if not torch.cuda.is_available():
                raise RuntimeError(
                    f"ActivationOffloader: device {device} requested but torch sees "
                    "no CUDA GPU; pass device='cpu' for the CPU engine"
                )
            if device.index is None:
                device = torch.device("cuda", torch.cuda.current_device())
            self._copies = CudaCopies(device)
        elif device.type == "cpu":
            self._copies = CpuCopies(device)
        else:
            raise ValueError(f"ActivationOffloader: device must be 'cpu' or 'cuda[:N]', got {device}")
        self.blocks = blocks
        self.device = device
        self.prefetch_depth = prefetch_depth
        self.d2h_lag = d2h_lag
        self.min_offload_bytes = min_offload_bytes
        self.log = log or (lambda msg: None)
        self.measuring = False
        self._paged: frozenset[int] = frozenset()
        self._pool = HostPool(self._copies.pinned, window=pool_window)
        self._hooks: list = []
        self._tls = threading.local()
        self._pass = 0
        self._live: weakref.WeakSet = weakref.WeakSet()  # entries holding a host buffer
        self._aged_pass = -1
        self._backward_seen = False  # since the pool last aged: a new pass then starts a step
        self._abandoned = False  # the last pass's backward raised (release_abandoned)
        self._last_index = _NO_CALL
        self._last_call: Call | None = None
        self._records = PassRecords(len(blocks))
        self._counters = {
            "copies_d2h": 0,
            "copies_h2d": 0,
            "bytes_d2h": 0,
            "bytes_h2d": 0,
            "pack_s": 0.0,
            "unpack_s": 0.0,
            "h2d_stall_s": 0.0,
            "d2h_wait_s": 0.0,
            "h2d_wait_s": 0.0,
            "passes": 0,
            "live_entries": 0,
        }
        self._lock = threading.Lock()

    # ---- public -----------------------------------------------------------------------------
    @property
    def attached(self) -> bool:
        return bool(self._hooks)

    def attach(self) -> "ActivationOffloader":
        """Installs a forward pre-hook and an always-called forward hook on every block."""
        if self._hooks:
            return self
        self._pool.reopen()
        for i, b in enumerate(self.blocks):
            self._hooks.append(b.register_forward_pre_hook(lambda m, args, i=i: self._pre(i, m)))
            self._hooks.append(
                b.register_forward_hook(lambda m, args, out: self._post(m, out), always_call=True)
            )
        return self

    def detach(self) -> None:
        """Removes the hooks and drops the pooled buffers. Graphs built while attached still
        unpack correctly; their buffers are freed when those graphs die."""
        for h in self._hooks:
            h.remove()
        self._hooks = []
        self._last_call = None
        self._records.clear()
        self._last_index = _NO_CALL
        self._pool.close()

    def set_paged(self, indices: Iterable[int]) -> None:
        """Which blocks (indices into ``blocks``) page their activations from the next call on."""
        idx = set()
        for i in indices:
            if isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < len(self.blocks):
                raise ValueError(f"set_paged: indices must be ints in [0, {len(self.blocks)}), got {i!r}")
            idx.add(i)
        new = frozenset(idx)
        if new != self._paged:
            self.log(f"activation offload: paging blocks {_ranges(sorted(new))} of {len(self.blocks)}")
        self._paged = new

    @property
    def paged(self) -> list[int]:
        return sorted(self._paged)

    def set_measuring(self, on: bool) -> None:
        """While on, blocks that do not page still count the bytes they would page
        (``stats()["block_bytes"]``); costs the Python hook per saved tensor, copies nothing."""
        self.measuring = bool(on)

    def stats(self) -> dict:
        """Counters. Per forward pass (the latest one, a pass starting at the first block):
        ``bytes_paged_last_pass``, ``block_bytes`` (per block: bytes paged, or that would be
        paged for measured blocks). Host: ``host_bytes_held`` (pool, in use + free),
        ``host_bytes_in_use``, ``host_bytes_peak``, ``host_allocations``, ``host_reuses``,
        ``host_bytes_high_water`` (the most the pool keeps at the next step's start: the highest
        bytes in use over the last ``pool_window`` steps), ``host_bytes_given_back`` (cumulative)
        and ``host_trims`` (times a pinned pool gave the arena's cache back to the driver).
        Cumulative: ``copies_d2h``/``copies_h2d``, ``bytes_d2h``/``bytes_h2d``, ``pack_s`` and
        ``unpack_s`` (host time spent in the hooks; unpack_s includes ``h2d_wait_s``, autograd's
        thread waiting for the GPU before taking memory for a prefetch), ``d2h_wait_s`` (the
        forward thread waiting for the copies d2h_lag blocks back), ``h2d_stall_s`` (GPU time the compute
        stream waited for activations to come back, over the waits already run; 0 on the CPU
        engine), ``passes``; ``live_entries`` (paged ranges not yet consumed). Call it after a
        synchronize for complete stall figures."""
        pool = self._pool.stats()
        stall = self._copies.stall_seconds()
        with self._lock:
            self._counters["h2d_stall_s"] += stall
            c = dict(self._counters)
        return {
            "paged_blocks": self.paged,
            "bytes_paged_last_pass": self._records.pass_bytes,
            "block_bytes": list(self._records.block_bytes),
            **pool,
            **c,
        }

    # ---- forward hooks ----------------------------------------------------------------------
    def _stack(self) -> list:
        s = getattr(self._tls, "stack", None)
        if s is None:
            s = self._tls.stack = []
        return s

    def _active(self, module: nn.Module) -> bool:
        return (
            module.training
            and torch.is_grad_enabled()
            and not torch.is_inference_mode_enabled()
            and torch._C._current_graph_task_id() == -1  # not inside backward (recompute)
            and not top_hooks_are_checkpoint()
        )

    def _pre(self, i: int, module: nn.Module) -> None:
        stack = self._stack()
        if not self._active(module):
            stack.append((module, None, None))
            return
        if i <= self._last_index:
            self._new_pass()
        self._last_index = i
        self._age_pool()
        if not self._paged and not self.measuring:
            stack.append((module, None, None))
            return
        # every call gets a record (the chain that backward walks to prefetch); only paged or
        # measured blocks get saved-tensor hooks
        call = Call(i, self._pass, self._last_call)
        if self._last_call is not None:
            self._last_call.next = weakref.ref(call)
        self._last_call = call
        paged = i in self._paged
        ctx = None
        if paged:
            self._throttle_d2h(call)
        if paged or self.measuring:
            ctx = torch.autograd.graph.saved_tensors_hooks(
                lambda t, call=call, paged=paged: self._pack(t, call, paged), self._unpack
            )
            ctx.__enter__()
        stack.append((module, ctx, call))

    def _post(self, module: nn.Module, output) -> None:
        stack = self._stack()
        if not stack or stack[-1][0] is not module:  # not ours when our pre-hook never ran
            return
        _, ctx, call = stack.pop()
        if ctx is not None:
            ctx.__exit__(None, None, None)
        if call is None or not self._paged:
            return
        # when backward reaches this block's output, its own saved tensors and those of the
        # prefetch_depth paged blocks before it start coming back
        out = output
        if isinstance(out, (tuple, list)):
            out = next((o for o in out if isinstance(o, torch.Tensor)), None)
        elif isinstance(out, dict):
            out = next((o for o in out.values() if isinstance(o, torch.Tensor)), None)
        if isinstance(out, torch.Tensor) and out.requires_grad and out.grad_fn is not None:
            out.register_hook(lambda g, call=call: self._on_output_grad(call))

    def _age_pool(self) -> None:
        """Ends a step for the pool (HostPool.new_pass: gives back what recent steps did not use)
        at the first block call of a pass that follows a backward, or while nothing paged is
        alive. A pass starts whenever a block runs again (shared weights, blocks called out of
        order), possibly several per step: aging at every pass would drop buffers the step's later
        passes need. Entries kept alive without a backward (a graph held by an exception's
        traceback) do not stop the give-back once backward runs again."""
        if self._aged_pass == self._pass:
            return
        if not self._backward_seen:
            with self._lock:
                if self._counters["live_entries"] != 0:
                    return
        self._aged_pass = self._pass
        self._backward_seen = False
        held = self._pool.bytes_held
        gone = self._pool.new_pass()
        if gone:
            self.log(
                f"activation offload: host pool gave back {gone / 2**20:.1f} MiB of "
                f"{held / 2**20:.1f} MiB (keeps {self._pool.high_water / 2**20:.1f} MiB: the "
                f"most in use over the last {self._pool.window} steps)"
            )

    def _throttle_d2h(self, call: Call) -> None:
        """Before a paged block runs, the copies of the paged call d2h_lag calls back must have
        finished: device memory held by copies in flight stays bounded (the forward thread waits,
        so it runs at most that far ahead of the copies)."""
        seen, c = 0, call.prev
        while c is not None:
            if c.d2h_event is not None:
                seen += 1
                if seen >= self.d2h_lag:
                    self._host_wait(c.d2h_event, "d2h_wait_s")
                    return
            c = c.prev

    def _host_wait(self, event, counter: str) -> None:
        if event.query():
            return
        t0 = time.perf_counter()
        event.synchronize()
        with self._lock:
            self._counters[counter] += time.perf_counter() - t0

    def _on_output_grad(self, call: Call) -> None:
        t0 = time.perf_counter()
        self._backward_seen = True
        if call.bwd_event is None:
            call.bwd_event = self._copies.mark()
        self._fetch_call(call)
        self._prefetch_before(call)
        with self._lock:
            self._counters["unpack_s"] += time.perf_counter() - t0

    def _new_pass(self) -> None:
        self._pass += 1
        self._last_call = None
        self._records.new_pass(self.blocks)
        with self._lock:
            self._counters["passes"] += 1

    # ---- pack / unpack --------------------------------------------------------------------------
    def _pack(self, t: torch.Tensor, call: Call, paged: bool):
        fault_point("activations.pack")
        # a tensor that stays is wrapped with its version: behind hooks torch checks none
        if not self._records.pageable(t, self.device, self.min_offload_bytes):
            return Kept(t, call.index)
        t0 = time.perf_counter()
        with torch.no_grad():
            saved = self._page(t, call, paged)
        with self._lock:
            self._counters["pack_s"] += time.perf_counter() - t0
        return Kept(t, call.index) if saved is None else saved

    def _page(self, t: torch.Tensor, call: Call, paged: bool):
        rec = self._records
        recs, lo_t, hi_t, found = rec.lookup(t)
        if found is False:  # measured only, already counted
            return None
        if found is None:
            lo, hi = rec.span(t, lo_t, hi_t)
            n = hi - lo
            rec.block_bytes[call.index] += n
            if not paged:
                rec.add(recs, t, None, lo, hi)
                return None
            rec.pass_bytes += n
            buf = self._pool.take(n)
            self._copies.to_host(buf, byte_view(t.untyped_storage(), self.device, lo, n))
            found = Entry(self, call, buf, lo, n)
            self._live.add(found)
            found.d2h_event = call.d2h_event = self._copies.d2h_event()
            call.entries.append(weakref.ref(found))
            rec.add(recs, t, found, lo, hi)
            with self._lock:
                self._counters["copies_d2h"] += 1
                self._counters["bytes_d2h"] += n
                self._counters["live_entries"] += 1
        if not paged:
            return None
        item = t.element_size()
        layout = (t.dtype, tuple(t.shape), tuple(t.stride()), (lo_t - found.lo) // item)
        return Saved(found, *layout, version_probe(t), t._version, call.index)

    def _fetch(self, e: Entry) -> None:
        if e.gpu is not None or e.buf is None:
            return
        e.gpu, e.h2d_event = self._copies.to_device(e.buf, e.nbytes, after=e.d2h_event)
        with self._lock:
            self._counters["copies_h2d"] += 1
            self._counters["bytes_h2d"] += e.nbytes

    def _fetch_call(self, call: Call) -> None:
        if call.fetched:
            return
        call.fetched = True
        for r in call.entries:
            e = r()
            if e is not None:
                self._fetch(e)

    def _prefetch_before(self, call: Call) -> None:
        """Starts the H2D of the prefetch_depth paged calls that precede `call` in its pass.

        Before new device memory is taken for them, the compute stream must have reached the
        backward of the call after `call` (autograd's thread waits): restored blocks stay within
        prefetch_depth + 2 however far the host runs ahead of the GPU."""
        todo = self.prefetch_depth
        c = call.prev
        waited = False
        while c is not None and todo > 0 and c.pass_id == call.pass_id:
            if c.entries:
                if not c.fetched and not waited:
                    waited = True
                    nxt = call.next() if call.next is not None else None
                    if nxt is not None and nxt.bwd_event is not None:
                        self._host_wait(nxt.bwd_event, "h2d_wait_s")
                self._fetch_call(c)
                todo -= 1
            c = c.prev

    def _unpack(self, x):
        fault_point("activations.unpack")
        kind = type(x)
        if kind is Kept:
            check_version(x.t._version, x)
            return x.t
        if kind is not Saved:
            return x
        check_version(x.probe._version, x)
        t0 = time.perf_counter()
        self._backward_seen = True
        e = x.entry
        if e.call.bwd_event is None:
            e.call.bwd_event = self._copies.mark()
        if e.gpu is None:
            self._fetch_call(e.call)
            self._fetch(e)  # an entry shared from another call
            if e.gpu is None:
                raise RuntimeError(
                    "ramstream: this graph's paged activations were released "
                    "after a backward pass raised; run the forward pass again"
                )
        self._prefetch_before(e.call)
        self._copies.use_on_current(e)
        out = torch.empty(0, dtype=x.dtype, device=self.device).set_(
            e.gpu.untyped_storage(), x.offset, x.size, x.stride
        )
        with self._lock:
            self._counters["unpack_s"] += time.perf_counter() - t0
        return out

    def after_failed_step(self, failed: bool = False) -> int:
        """zero_grad(), or step() that raised (failed=True): when the last pass saw no backward
        (it failed in forward), was abandoned or its step failed, and nothing paged is alive, its
        buffers leave the pool's cache now (HostPool.forget_failed_pass), not two steps later."""
        with self._lock:
            alive = self._counters["live_entries"]
        if alive or (self._backward_seen and not self._abandoned and not failed):
            return 0
        self._abandoned = False
        gone = self._pool.forget_failed_pass()
        if gone:
            self.log(f"activation offload: a failed step's {gone / 2**20:.1f} MiB of host buffers given back")
        return gone

    def release_abandoned(self) -> int:
        """A backward pass raised: torch (2.13, CPU) keeps the failed graph's unexecuted nodes
        alive, with the host buffers and device copies of their paged activations. Frees those of
        every pass but, when a new backward runs, the current one's (it is that backward's)."""
        keep = self._pass if torch._C._current_graph_task_id() != -1 else None
        self._abandoned = keep is None  # outside a backward: the failed pass is the last one
        freed = 0
        for e in list(self._live):
            if e.call.pass_id == keep or e.buf is None:
                continue
            buf, e.buf, e.gpu = e.buf, None, None
            freed += e.nbytes
            self._release(buf, e.h2d_event if e.h2d_event is not None else e.d2h_event)
        return freed

    def _release(self, buf: HostBuf, event) -> None:
        self._pool.give(buf, event)
        with self._lock:
            self._counters["live_entries"] -= 1
