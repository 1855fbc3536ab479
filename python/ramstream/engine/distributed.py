"""Data parallel for the offload engine: each rank owns a share of the buckets.

Gradients of a bucket are summed onto its owner (dist.reduce: NCCL on the GPU, before they
leave it; gloo for the CPU engine); only the owner keeps that bucket's host state (fp32 master,
moments: 1/N of the single-process memory) and runs its update; the new weights are then
broadcast from the owner to every rank. Two process groups keep the two streams of
collectives ordered independently: reduces are issued by the training thread during backward,
in descending bucket order whatever order the buckets complete in on this rank (its graph may
differ from the others'), broadcasts by a comm thread in bucket order once the owner's update
is done. Every rank issues
the same collectives in the same order, so replicas stay bit-identical.
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
    def __init__(self, engine) -> None:
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError("ramstream: distributed=True needs torch.distributed initialised "
                               "(dist.init_process_group) first")
        self.engine = engine
        self.rank = dist.get_rank()
        self.world = dist.get_world_size()
        backend = dist.get_backend()
        self.grad_group = dist.new_group(backend=backend)
        self.weight_group = dist.new_group(backend=backend)
        self.owner = balanced_owners([b.numel for b in engine.buckets], self.world)
        self._q: queue.Queue = queue.Queue()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="ramstream-comm", daemon=True)
        self._stream = torch.cuda.Stream(engine.device) if engine.device.type == "cuda" else None
        self._thread.start()

    def owns(self, b) -> bool:
        return self.owner[b.index] == self.rank

    # ---- gradients (training thread, during backward) ---------------------------------------
    def reduce(self, b, flat: torch.Tensor) -> None:
        """Sums `flat` (the bucket's gradients, on the compute device) onto the owner."""
        dist.reduce(flat, dst=self.owner[b.index], op=dist.ReduceOp.SUM, group=self.grad_group)

    def all_reduce_scalar(self, x: float) -> float:
        t = torch.tensor([x], dtype=torch.float64,
                         device=self.engine.device if dist.get_backend() == "nccl" else "cpu")
        dist.all_reduce(t, group=self.grad_group)
        return float(t.item())

    # ---- weights (comm thread, after the owner's update) ---------------------------------
    def broadcast_after_update(self, b) -> None:
        """Queues the broadcast of b's new weights; b.bcast_done is set once it has landed."""
        b.bcast_done.clear()
        self._q.put(b)

    def _run(self) -> None:
        if self._stream is not None:
            torch.cuda.set_device(self.engine.device)
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
        e = self.engine
        if self.owns(b):
            e.worker.wait(b.update_seq)
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

    def wait(self, b) -> None:
        b.bcast_done.wait()
        if self._error is not None:
            raise RuntimeError(f"ramstream: weight broadcast failed: {self._error!r}") from self._error
        if self._stream is not None and b.bcast_event is not None:
            torch.cuda.current_stream(self.engine.device).wait_event(b.bcast_event)

    def state_from_owner(self, b, tensors: list[torch.Tensor | None], like: list[torch.Tensor]):
        """Every rank gets the owner's copy of a bucket's state tensors (for state_dict)."""
        out = []
        for t, ref in zip(tensors, like):
            dev = self.engine.device if dist.get_backend() == "nccl" else torch.device("cpu")
            buf = (t.to(dev) if t is not None else torch.empty_like(ref, device=dev))
            dist.broadcast(buf, src=self.owner[b.index], group=self.weight_group)
            out.append(buf.cpu())
        return out

    def close(self) -> None:
        self._q.put(None)
        self._thread.join(timeout=30)


def broadcast_model(model: torch.nn.Module, src: int = 0) -> None:
    """Rank `src`'s parameters and buffers to every rank (at wrap time)."""
    with torch.no_grad():
        for t in list(model.parameters()) + list(model.buffers()):
            dist.broadcast(t.data, src=src)
