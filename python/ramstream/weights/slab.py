"""A slab: one flat run of a streamed block's weights, at home in pinned host memory.

A slab holds parameters of one dtype as views of one flat device tensor (`flat`). Its weights
live in `home`, a pinned host tensor of the same dtype and size, and visit the device only while
the block runs:

  load()   the device storage is allocated (on the copy stream) and filled from `home` by one
           H2D copy; every parameter's .data becomes its view of the device tensor.
  evict()  every parameter's .data becomes its view of `home` (so model.state_dict() and
           load_state_dict() read and write the home copy), and the device storage is resized to
           zero: the memory goes back to torch's caching allocator, stream-ordered after the
           kernels that read it.

Autograd keeps what forward saved (a parameter, a transposed view of one) pointing at the device
storage object, not at its memory: the storage is refilled (load) before the block's backward
runs, and the refill copies through an alias tensor of its own, so the saved tensors' version
counters do not move. The weights are never changed on the device (updated weights of trained
parameters are written into `home` by the host optimizer), so eviction copies nothing back.
"""

from __future__ import annotations

import torch


def _unguarded():
    """Pointing a parameter at other storage reads no weight: it must not wait for the
    parameter's pending update (engine/guard.py), or evicting a chunk in backward would wait
    for the host AdamW that its own gradients just started. (A load waits for the update
    before it copies: the streamer's Block.ready.)"""
    return torch._C.DisableTorchFunctionSubclass()


class Copier:
    """Where a slab's copies run. The CPU version copies at once (the engine's `device="cpu"`
    mode, which CI tests); CudaCopier queues them on a copy stream ordered by events."""

    type = "cpu"
    stream = None  # the copy stream (CudaCopier), for traces

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def host_buffer(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        return torch.empty(numel, dtype=dtype)

    def fill(self, dst: torch.Tensor, src: torch.Tensor, nbytes: int):
        """Allocates dst's storage (nbytes) and copies src into it; returns an event or None."""
        dst.untyped_storage().resize_(nbytes)
        dst.copy_(src)
        return None

    def after_compute(self) -> None:
        """Copies queued from now on start after the compute queued so far (CUDA)."""

    def wait(self, event) -> None:
        """Work queued on the current stream after this call sees the filled slab."""

    def synchronize(self) -> None:
        pass


class CudaCopier(Copier):
    type = "cuda"

    def __init__(self, device: torch.device) -> None:
        super().__init__(device)
        # a high-priority stream: a weight load is on the critical path of the next block
        self.stream = torch.cuda.Stream(device, priority=-1)

    def host_buffer(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        from ..functional import pinned_empty

        return pinned_empty(numel, dtype)

    def fill(self, dst: torch.Tensor, src: torch.Tensor, nbytes: int):
        compute = torch.cuda.current_stream(self.device)
        # after the compute queued so far: the blocks evicted before this load are free then, so
        # the loaded blocks stay within the window even when the host runs far ahead of the GPU
        self.stream.wait_stream(compute)
        with torch.cuda.stream(self.stream):
            # allocated from the copy stream's pool: no wait on compute is needed to reuse it,
            # and record_stream makes its release wait for the compute work that reads it
            dst.untyped_storage().resize_(nbytes)
            dst.copy_(src, non_blocking=True)
            ev = torch.cuda.Event()
            ev.record(self.stream)
        dst.record_stream(compute)
        return ev

    def after_compute(self) -> None:
        self.stream.wait_stream(torch.cuda.current_stream(self.device))

    def wait(self, event) -> None:
        if event is not None:
            torch.cuda.current_stream(self.device).wait_event(event)

    def synchronize(self) -> None:
        self.stream.synchronize()


def make_copier(device: torch.device) -> Copier:
    return CudaCopier(device) if device.type == "cuda" else Copier(device)


class Slab:
    """Parameters of one dtype, as views of one flat device tensor, at home in `home`.

    Args:
        params: the parameters (one dtype), in the order their views are laid out.
        offsets: each parameter's element offset in the flat tensor.
        numel: the flat tensor's size in elements (>= offset + numel of every parameter).
        flat: the device tensor the parameters are views of (the engine's bucket buffer for
            trained parameters), or None to make one here (frozen parameters).
        home: the pinned host tensor holding the weights, or None to make one here.
        copier: where copies run (make_copier).
        values: for each parameter, its current weights (any device), copied into `home`
            (None: the parameter's own data).
    """

    def __init__(self, params, offsets, numel: int, *, copier: Copier, flat=None, home=None, values=None):
        self.params = list(params)
        self.offsets = list(offsets)
        self.numel = numel
        self.dtype = self.params[0].dtype
        self.copier = copier
        device = copier.device
        self.nbytes = numel * self.params[0].element_size()
        if home is None:
            home = copier.host_buffer(numel, self.dtype).zero_()  # padding included
        self.home = home
        if flat is None:
            flat = torch.empty(numel, dtype=self.dtype, device=device)
        self.flat = flat
        # an alias of the flat storage with a version counter of its own, for the refills
        self._alias = torch.empty(0, dtype=self.dtype, device=device)
        self._alias.set_(flat.untyped_storage(), 0, (numel,))
        with torch.no_grad():
            for i, (p, off) in enumerate(zip(self.params, self.offsets)):
                v = p.data if values is None or values[i] is None else values[i]
                self.home[off : off + p.numel()].copy_(v.reshape(-1))
        self.dviews = [flat[o : o + p.numel()].view(p.shape) for p, o in zip(self.params, self.offsets)]
        self.hviews = [self.home[o : o + p.numel()].view(p.shape) for p, o in zip(self.params, self.offsets)]
        self.loaded = True  # the storage is allocated until the first evict()
        self.event = None
        self.evict()

    def load(self) -> None:
        """Queues the H2D copy of `home` into the device storage; the parameters become device
        views. Call wait() before work that reads them."""
        if self.loaded:
            return
        self.event = self.copier.fill(self._alias, self.home, self.nbytes)
        with _unguarded():
            for p, v in zip(self.params, self.dviews):
                p.data = v
        self.loaded = True

    def wait(self) -> None:
        self.copier.wait(self.event)

    def evict(self) -> None:
        """The parameters become views of `home`; the device storage is released."""
        if not self.loaded:
            return
        with _unguarded():
            for p, v in zip(self.params, self.hviews):
                p.data = v
        self.flat.untyped_storage().resize_(0)
        self.loaded = False
        self.event = None

    def device_bytes(self) -> int:
        return self.flat.untyped_storage().nbytes()
