"""CUDA-side updates of "mapped" buckets: the GPU runs AdamW on state in pinned host memory."""

from __future__ import annotations

import torch

from ..ops import _raw


class MappedUpdates:
    """The updater's GPU half (training thread): queues the CUDA AdamW of mapped slots, and the
    squared norms of their gradients for clipping, on the device's update stream. The update
    writes the new weights in place; the weight return learns of it through the event."""

    def __init__(self, *, dev, device: torch.device, seed: int, inflight, weights, stats) -> None:
        self.dev, self.device, self.seed = dev, device, seed
        self.inflight, self.weights, self.stats = inflight, weights, stats
        self._norm = None  # float64 device scalar: sum of squared mapped gradients
        # a list while the split's refinement measures (runtime/refiner.py): (start event, end
        # event, numel, PCIe bytes each way) of every mapped bucket's launch; None otherwise
        self.timing: list | None = None

    def launch(self, b, slots, hyper_of, grad_scale: float) -> None:
        """Queues the CUDA AdamW of mapped slots on the update stream (after the compute that
        produced their gradients); their gradients are released once it has run."""
        self.inflight.throttle(sum(s.param.grad.nbytes for s in slots))
        stream = self.dev.begin_update()
        timed = self.timing is not None and b.placement == "mapped"
        start = self.dev.end_update(timing=True) if timed else None
        for s in slots:
            g = s.param.grad
            h = hyper_of(s.group)
            off = s.offset
            if b.master is None:  # fp32 weights are their own master
                param, out = s.param.data_ptr(), 0
            else:
                param, out = b.master.data_ptr() + 4 * off, s.param.data_ptr()
            esz = b.exp_avg.element_size()
            _raw.cuda_adamw_ptr(
                param=param,
                grad=g.data_ptr(),
                grad_dtype=g.dtype,
                exp_avg=b.exp_avg.data_ptr() + esz * off,
                exp_avg_sq=b.exp_avg_sq.data_ptr() + esz * off,
                moment_dtype=b.exp_avg.dtype,
                out=out,
                out_dtype=b.dtype,
                n=s.numel,
                offset=b.state_offset + off,
                lr=h.lr,
                beta1=h.beta1,
                beta2=h.beta2,
                eps=h.eps,
                weight_decay=h.weight_decay,
                step=s.step,
                grad_scale=grad_scale,
                seed=self.seed,
                stream=stream,
                device=self.device.index,
            )
            g.record_stream(self.dev.upd)
            s.param.grad = None
        self.stats["gpu_updates"] += len(slots)
        event = self.dev.end_update(timing=timed)
        if timed:  # the moments (and a low-precision model's fp32 master) cross PCIe each way
            numel = sum(s.numel for s in slots)
            per = 2 * b.exp_avg.element_size() + (4 if b.master is not None else 0)
            self.timing.append((start, event, numel, numel * per))
        self.inflight.track(event, sum(s.numel for s in slots) * b.dtype.itemsize)
        self.weights.updated_in_place(b, event)

    def take_timing(self) -> tuple[float, int, int]:
        """After the update stream has finished (synchronize): (seconds, numel, PCIe bytes each
        way) of the mapped launches timed since the last call."""
        seconds, numel, nbytes = 0.0, 0, 0
        for start, end, n, nb in self.timing or ():
            seconds += start.elapsed_time(end) / 1e3
            numel += n
            nbytes += nb
        if self.timing is not None:
            self.timing = []
        return seconds, numel, nbytes

    def norm_add(self, g: torch.Tensor) -> None:
        """Adds the squared norm of a mapped slot's gradient to a device scalar (clipping)."""
        if self._norm is None:
            self._norm = torch.zeros(1, dtype=torch.float64, device=self.device)
        stream = self.dev.begin_update()
        _raw.cuda_sq_norm(x=g, out=self._norm, accumulate=True, stream=stream, device=self.device.index)
        self.dev.end_update()

    def take_sq_norm(self) -> float:
        """Waits for the queued norms; returns their sum and starts the next one from zero."""
        if self._norm is None:
            return 0.0
        self.dev.upd.synchronize()
        total = float(self._norm.item())
        self._norm.zero_()
        return total

    def discard(self) -> None:
        if self._norm is not None:
            self._norm.zero_()
