"""The compute device as the engine sees it: copies between device and host, events, waits.

CudaDevice uses two copy streams (D2H for gradients, H2D for weights) ordered by events.
CpuDevice runs the same engine with the CPU as the "accelerator": copies are memcpy and events
are already complete, so CI (no GPU) tests the engine's logic and numerics.
"""

from __future__ import annotations

import torch

from ..trace import current as _trace_current


class CpuDevice:
    """Copies are synchronous; every event is complete when it is recorded."""

    type = "cpu"

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def host_buffer(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        return torch.empty(numel, dtype=dtype)

    def grad_to_host(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        tr = _trace_current()
        if tr is None:
            dst.copy_(src.reshape(-1))
            return
        with tr.stream_span("d2h", "grad", None, bytes=src.nbytes):
            dst.copy_(src.reshape(-1))

    def gather_on_device(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        dst.copy_(src.reshape(-1))

    def staging(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        return torch.empty(numel, dtype=dtype)

    def zeros(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        return torch.zeros(numel, dtype=dtype)

    def flush_to_host(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        tr = _trace_current()
        if tr is None:
            dst.copy_(src)
            return
        with tr.stream_span("d2h", "grads (staged)", None, bytes=src.nbytes):
            dst.copy_(src)

    def record_d2h(self):
        return None

    def wait_landing_reusable(self, event) -> None:
        pass

    def host_wait(self, event) -> None:
        pass

    def weights_to_device(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        if dst.data_ptr() != src.data_ptr():
            tr = _trace_current()
            if tr is None:
                dst.copy_(src)
                return
            with tr.stream_span("h2d", "weights", None, bytes=src.nbytes):
                dst.copy_(src)

    def record_h2d(self):
        return None

    def device_wait(self, event) -> None:
        pass

    def bind_thread(self) -> None:
        pass

    def synchronize(self) -> None:
        pass


class CudaDevice:
    """D2H and H2D copy streams; events order them against torch's current stream."""

    type = "cuda"

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.d2h = torch.cuda.Stream(device)
        self.h2d = torch.cuda.Stream(device)
        self.upd = torch.cuda.Stream(device)  # GPU-side AdamW of mapped buckets
        self._upd_handle = self.upd.cuda_stream

    def host_buffer(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        from ..functional import pinned_empty

        return pinned_empty(numel, dtype)

    def _d2h_after_compute(self) -> None:
        self.d2h.wait_stream(torch.cuda.current_stream(self.device))

    def grad_to_host(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        """Copies a gradient into pinned memory on the D2H stream; src may be freed at once."""
        self._d2h_after_compute()
        tr = _trace_current()
        t0 = tr.now(self.d2h) if tr is not None else None
        with torch.cuda.stream(self.d2h):
            dst.copy_(src.reshape(-1), non_blocking=True)
        src.record_stream(self.d2h)
        if tr is not None:
            tr.span("d2h", "grad", t0, tr.now(self.d2h), bytes=src.nbytes)

    def staging(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        return torch.empty(numel, dtype=dtype, device=self.device)

    def zeros(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        return torch.zeros(numel, dtype=dtype, device=self.device)

    def gather_on_device(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        """Device-to-device copy of a small gradient into the bucket's staging buffer."""
        dst.copy_(src.reshape(-1))

    def flush_to_host(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        self._d2h_after_compute()
        tr = _trace_current()
        t0 = tr.now(self.d2h) if tr is not None else None
        with torch.cuda.stream(self.d2h):
            dst.copy_(src, non_blocking=True)
        src.record_stream(self.d2h)
        if tr is not None:
            tr.span("d2h", "grads (staged)", t0, tr.now(self.d2h), bytes=src.nbytes)

    def record_d2h(self):
        ev = torch.cuda.Event()
        ev.record(self.d2h)
        return ev

    def wait_landing_reusable(self, event) -> None:
        """The next D2H into a landing buffer waits until the last H2D out of it finished."""
        if event is not None:
            self.d2h.wait_event(event)

    def host_wait(self, event) -> None:
        if event is not None:
            event.synchronize()

    def weights_to_device(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        tr = _trace_current()
        t0 = tr.now(self.h2d) if tr is not None else None
        with torch.cuda.stream(self.h2d):
            dst.copy_(src, non_blocking=True)
        if tr is not None:
            tr.span("h2d", "weights", t0, tr.now(self.h2d), bytes=src.nbytes)

    def record_h2d(self):
        ev = torch.cuda.Event()
        ev.record(self.h2d)
        return ev

    def device_wait(self, event) -> None:
        if event is not None:
            torch.cuda.current_stream(self.device).wait_event(event)

    def begin_update(self) -> int:
        """The update stream, ordered after the work queued so far on the current stream."""
        self.upd.wait_stream(torch.cuda.current_stream(self.device))
        return self._upd_handle

    def end_update(self, timing: bool = False):
        """An event on the update stream after the work queued there (timing=True: one that
        elapsed_time() can read, for the split's measured refinement, runtime/refiner.py)."""
        ev = torch.cuda.Event(enable_timing=timing)
        ev.record(self.upd)
        return ev

    def bind_thread(self) -> None:
        torch.cuda.set_device(self.device)

    def synchronize(self) -> None:
        self.d2h.synchronize()
        self.h2d.synchronize()
        self.upd.synchronize()


def check_param(p: torch.nn.Parameter, device: torch.device) -> None:
    """RuntimeError when p left the engine's device, TypeError for a dtype the engine cannot
    update."""
    if p.device != device:
        raise RuntimeError(
            f"ramstream: parameter of shape {tuple(p.shape)} is on {p.device} but the engine "
            f"runs on {device}; move the model back with model.to('{device}') (or "
            "unwrap() and wrap() again for another device)"
        )
    if p.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise TypeError(
            f"ramstream: parameters must be float32, bfloat16 or float16, got "
            f"{p.dtype} (shape {tuple(p.shape)})"
        )


def make_device(device: torch.device):
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise RuntimeError(
                f"ramstream: device {device} requested but torch sees no CUDA GPU; "
                "pass device='cpu' to run the engine on the CPU"
            )
        return CudaDevice(device)
    if device.type == "cpu":
        return CpuDevice(device)
    raise ValueError(f"ramstream: device must be 'cpu' or 'cuda[:N]', got {device}")
