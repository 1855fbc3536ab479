"""How processes share the buckets: the strategy interface, and its single-process form.

The gradient intake, the updater and the weight return never ask whether data parallel is on;
they call a strategy. SingleProcess (here) is the trivial one: this process owns every bucket,
a gradient may cross to the host on its own, nothing is reduced or broadcast.
DataParallel (distributed.py) has the same methods: gradients are summed onto each bucket's
owner rank on the device, only the owner updates, and the owner's new weights are broadcast.

Every method runs on the training thread (broadcasts run on DataParallel's own comm thread).
"""

from __future__ import annotations

import torch


class SingleProcess:
    """One process: every bucket is owned here."""

    distributed = False  # for Engine.dp (the API's "is data parallel on?"); nothing branches
    world = 1

    def __init__(self, dev) -> None:
        self.dev = dev

    def owns(self, b) -> bool:
        """Whether this process keeps b's host state and runs its update."""
        return True

    # ---- gradient intake ----------------------------------------------------------------------
    def lands_alone(self, s) -> bool:
        """True: s's gradient is copied to its bucket's landing buffer as soon as it is produced;
        False: it is gathered into the bucket's device staging buffer first (small gradients on
        a GPU, so that they cross PCIe in one copy)."""
        return s.direct or self.dev.type == "cpu"

    def new_staging(self, b) -> tuple[torch.Tensor, int]:
        """(device staging buffer, the bucket offset it starts at): the small slots' tail."""
        return self.dev.staging(b.numel - b.small_lo, b.dtype), b.small_lo

    def complete(self, b) -> bool:
        """b got every gradient this pass is expected to bring (a slot that got none in the last
        step is not waited for)."""
        return all(x.micro_arrived for x in b.slots if x.expected)

    def begin_backward(self, buckets) -> None:
        pass

    def on_bucket_complete(self, b, flush) -> None:
        """b is complete on this process: flush(b) hands its gradients on, now."""
        flush(b)

    def end_backward(self, buckets, flush) -> None:
        """The pass ended: buckets with gradients not handed on yet (incomplete ones) go now."""
        for b in buckets:
            if b.micro_list:
                flush(b)

    def reduce(self, b, arrived: list) -> list:
        """The slots whose gradients the owner updates from b's landing (and staging) buffer."""
        return arrived

    def on_abandoned_pass(self) -> None:
        """A backward pass raised before its end; the engine is about to drop what it gathered."""

    # ---- updater --------------------------------------------------------------------------------
    def all_reduce_norm(self, sq_norm: float) -> float:
        """The squared global norm of the gradient updated with, from this process's share."""
        return sq_norm

    # ---- weight return --------------------------------------------------------------------------
    def broadcast(self, b) -> bool:
        """Queues b's new weights from its owner to every process; True when b's weights on this
        process will change (it must be waited for). Here: they are already in place."""
        return False

    def wait(self, b) -> bool:
        """Orders the work queued after this call after b's broadcast; True when it did (which
        covers the owner's own update), False when b's weights come from this process's update
        alone (the caller waits for that)."""
        return False

    def close(self) -> None:
        pass


def make_strategy(distributed: bool, *, buckets, dev, wait_job, mapped_fraction: float):
    """SingleProcess, or DataParallel over the initialised torch.distributed process group."""
    if not distributed:
        return SingleProcess(dev)
    if mapped_fraction > 0:
        raise ValueError(
            "ramstream: data parallel runs the update on the host "
            "(optimizer_mode='cpu'); 'gpu' is not supported with it yet"
        )
    from .distributed import DataParallel

    return DataParallel(buckets, dev, wait_job)
