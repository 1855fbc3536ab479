"""Data parallel for the offload engine: each rank owns a share of the buckets.

Gradients of a bucket are summed onto its owner (dist.reduce: NCCL on the GPU, before they
leave it; gloo for the CPU engine); only the owner keeps that bucket's host state (fp32 master,
moments: 1/N of the single-process memory) and runs its update; the new weights are then
broadcast from the owner to every rank. Two process groups keep the two streams of
collectives ordered independently: reduces are issued by the training thread during backward,
in descending bucket order whatever order the buckets complete in on this rank (its graph may
differ from the others'), broadcasts by a comm thread in bucket order once the owner's update
is done. A streamed bucket's weights (weights/) are broadcast from the owner's pinned home to
every rank's, before the block's next load. Every rank issues the same collectives in the same
order, so replicas stay bit-identical.
"""

from __future__ import annotations

import queue
import threading

import torch
import torch.distributed as dist


def balanced_owners(sizes: list[int], world: int) -> list[int]:
    """Assigns each bucket to the rank with the least work so far (largest buckets first)."""
    load = [0] * world
    owner = [0] * len(sizes)
    for i in sorted(range(len(sizes)), key=lambda i: -sizes[i]):
        r = min(range(world), key=lambda r: (load[r], r))
        owner[i] = r
        load[r] += sizes[i]
    return owner


class DataParallel:
    """The data-parallel strategy: SingleProcess's interface (parallel.py) over a process group."""

    distributed = True

    def __init__(self, buckets, dev, wait_job) -> None:
        """buckets: the engine's, in forward order; dev: its device (devices.py); wait_job: blocks
        until an engine-thread job ran (the owner's update, before its broadcast)."""
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError(
                "ramstream: distributed=True needs torch.distributed initialised "
                "(dist.init_process_group) first"
            )
        self.dev = dev
        self.device = dev.device
        self.buckets = buckets
        self._wait_job = wait_job
        self.rank = dist.get_rank()
        self.world = dist.get_world_size()
        backend = dist.get_backend()
        self._nccl = backend == "nccl"  # device tensors only: host ones are staged (_broadcast_home)
        self.grad_group = dist.new_group(backend=backend)
        self.weight_group = dist.new_group(backend=backend)
        self.owner = balanced_owners([b.numel for b in buckets], self.world)
        self._next = -1  # the next bucket to reduce (descending order)
        self._ready: set[int] = set()  # complete buckets waiting for their turn
        self._q: queue.Queue = queue.Queue()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="ramstream-comm", daemon=True)
        self._stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        self._thread.start()

    def owns(self, b) -> bool:
        return self.owner[b.index] == self.rank

    # ---- gradients (training thread, during backward) ---------------------------------------
    def lands_alone(self, s) -> bool:
        """Never: a bucket's gradients are summed across ranks on the device first."""
        return False

    def new_staging(self, b) -> tuple[torch.Tensor, int]:
        """The whole bucket, zeros: a slot that gets no gradient on this rank adds zero."""
        return self.dev.zeros(b.numel, b.dtype), 0

    def complete(self, b) -> bool:
        """Every trainable slot is reduced in each pass, also one unfrozen after a step without
        it: the bucket is complete when all of them arrived."""
        return all(x.micro_arrived or not x.param.requires_grad for x in b.slots)

    def begin_backward(self, buckets) -> None:
        self._next = len(buckets) - 1

    def on_bucket_complete(self, b, flush) -> None:
        """Every rank must issue the reduces in the same order, but which bucket completes when
        depends on this rank's graph (a branch taken on one rank only), so buckets are reduced in
        descending index order (backward order of a model whose parameters are registered in
        forward order): b waits for the buckets after it; end_backward reduces whatever is
        left, in the same order."""
        self._ready.add(b.index)
        while self._next >= 0 and self._next in self._ready:
            self._ready.discard(self._next)
            flush(self.buckets[self._next])
            self._next -= 1

    def end_backward(self, buckets, flush) -> None:
        """The buckets not reduced yet, in on_bucket_complete's order."""
        for i in range(self._next, -1, -1):
            b = buckets[i]
            self._ready.discard(i)
            if b.micro_list or any(s.param.requires_grad and not s.micro_arrived for s in b.slots):
                flush(b)
        self._next = -1

    def reduce(self, b, arrived: list) -> list:
        """Sums b's staging buffer (its gradients, on the compute device) onto the owner. Every
        trainable slot of the bucket counts as arrived on every rank (a missing gradient is
        zero), so all ranks agree on steps; returns those slots."""
        if b.staging is None:
            b.staging, b.staging_lo = self.new_staging(b)
        for s in b.slots:
            if s.param.requires_grad and not s.micro_arrived:
                s.micro_arrived = True
                s.arrivals += 1
        dist.reduce(b.staging, dst=self.owner[b.index], op=dist.ReduceOp.SUM, group=self.grad_group)
        return [s for s in b.slots if s.param.requires_grad]

    def on_abandoned_pass(self) -> None:
        raise RuntimeError(
            "ramstream: a backward pass raised on this rank under data parallel; the other "
            "ranks wait in its collectives, so the process group cannot continue (as with "
            "DistributedDataParallel): restart from a checkpoint"
        )

    def all_reduce_norm(self, sq_norm: float) -> float:
        """The squared norm of the averaged gradient, from this rank's owned share."""
        return self.all_reduce_scalar(sq_norm) / self.world**2

    def all_reduce_scalar(self, x: float) -> float:
        t = torch.tensor(
            [x], dtype=torch.float64, device=self.device if dist.get_backend() == "nccl" else "cpu"
        )
        dist.all_reduce(t, group=self.grad_group)
        return float(t.item())

    # ---- weights (comm thread, after the owner's update) ---------------------------------
    def broadcast(self, b) -> bool:
        """Queues the broadcast of b's new weights; b.bcast_done is set once it has landed."""
        b.bcast_done.clear()
        self._q.put(b)
        return True

    def _run(self) -> None:
        if self._stream is not None:
            torch.cuda.set_device(self.device)
        while True:
            b = self._q.get()
            if b is None:
                return
            try:
                if self._error is None:
                    self._broadcast(b)
            except BaseException as e:  # noqa: BLE001 - re-raised by wait()
                self._error = e
            finally:
                b.bcast_done.set()

    def _broadcast(self, b) -> None:
        if self.owns(b):
            self._wait_job(b.update_seq)
        if b.streamed:
            self._broadcast_home(b)
            return
        if self._stream is None:
            dist.broadcast(b.device_flat, src=self.owner[b.index], group=self.weight_group)
            return
        with torch.cuda.stream(self._stream):
            if self.owns(b):
                self._stream.wait_event(b.h2d_event)
            dist.broadcast(b.device_flat, src=self.owner[b.index], group=self.weight_group)
            ev = torch.cuda.Event()
            ev.record(self._stream)
        b.bcast_event = ev

    def _broadcast_home(self, b) -> None:
        """A streamed bucket's weights live in its slab's home (pinned host memory; on the device
        only while its block runs): the owner's home, which its host AdamW wrote, goes into every
        rank's home. gloo takes the host tensor itself; NCCL goes through a device buffer on the
        comm stream (owner: H2D of its home; receivers: D2H into theirs). Either is complete
        before bcast_done is set, so the streamer's load of the block, which waits for it
        (Block.ready -> wait), needs no device-side wait. A receiver's home is last read by the
        load its backward consumed, which precedes its reduce of b, hence the owner's update and
        this broadcast."""
        src, home = self.owner[b.index], b.slab.home
        b.bcast_event = None
        if not self._nccl:
            dist.broadcast(home, src=src, group=self.weight_group)
            return
        with torch.cuda.stream(self._stream):
            buf = torch.empty(home.shape, dtype=home.dtype, device=self.device)
            if self.owns(b):
                buf.copy_(home, non_blocking=True)
            dist.broadcast(buf, src=src, group=self.weight_group)
            if not self.owns(b):
                home.copy_(buf, non_blocking=True)
        self._stream.synchronize()

    def wait(self, b) -> bool:
        """The owner's weights of b have landed here (covers the owner's update)."""
        b.bcast_done.wait()
        if self._error is not None:
            raise RuntimeError(f"ramstream: weight broadcast failed: {self._error!r}") from self._error
        if self._stream is not None and b.bcast_event is not None:
            torch.cuda.current_stream(self.device).wait_event(b.bcast_event)
        return True

    def state_from_owner(self, b, tensors: list[torch.Tensor | None], like: list[torch.Tensor]):
        """Every rank gets the owner's copy of a bucket's state tensors (for state_dict)."""
        out = []
        for t, ref in zip(tensors, like):
            dev = self.device if dist.get_backend() == "nccl" else torch.device("cpu")
            buf = t.to(dev) if t is not None else torch.empty_like(ref, device=dev)
            dist.broadcast(buf, src=self.owner[b.index], group=self.weight_group)
            out.append(buf.cpu())
        return out

    def close(self) -> None:
        self._q.put(None)
        self._thread.join(timeout=30)


def broadcast_model(model: torch.nn.Module, src: int = 0, device: torch.device | None = None) -> None:
    """Rank `src`'s parameters and buffers to every rank (at wrap time). With NCCL, tensors left
    in host memory (streamed blocks' weights) go through a copy on `device`."""
    nccl = dist.get_backend() == "nccl"
    with torch.no_grad():
        for t in list(model.parameters()) + list(model.buffers()):
            if nccl and t.device.type != "cuda":
                buf = t.data.to(device)
                dist.broadcast(buf, src=src)
                t.data.copy_(buf)
            else:
                dist.broadcast(t.data, src=src)
