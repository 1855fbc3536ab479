"""Buckets: parameters grouped, in forward order, into flat host/device buffers of ~bucket_bytes.

A bucket is the unit of transfer and update: its parameters are views of one flat device
buffer (one H2D copy brings all its weights back), its gradients land in one pinned buffer, and
its fp32 master and moments are flat host tensors. Slots are never split across buckets.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

import torch


@dataclass(eq=False)
class Slot:
    """One parameter's place: which bucket, at which element offset, in which param group."""

    param: torch.nn.Parameter
    index: int  # position in the optimizer's param_groups order (state_dict key)
    group: int  # param group index
    numel: int
    bucket: "Bucket | None" = None
    offset: int = 0  # element offset inside the bucket
    step: int = 0  # AdamW steps taken by this parameter (torch's state["step"])
    arrivals: int = 0  # gradients received since the last optimizer step
    micro_arrived: bool = False  # received in the current backward
    direct: bool = True  # its gradient is copied to the host on its own (large slot) pass
    expected: bool = True  # a gradient is expected in every backward pass
    updated: bool = False  # its update for the current step is queued
    streamed: bool = False  # its weights live in pinned host memory (weights/)
    engine_wait: object = None  # Engine.wait_bucket (held weakly), for the read guard

    @property
    def shape(self) -> torch.Size:
        return self.param.shape


@dataclass(eq=False)
class Bucket:
    index: int
    slots: list[Slot]
    numel: int
    state_offset: int  # element offset of this bucket in the whole state
    small_lo: int = 0  # small slots (gathered on the device first) start here
    placement: str = "host"  # "host", "mapped" or "device" (see layout.py)
    dtype: torch.dtype = torch.float32  # working (model) dtype
    device: torch.device = torch.device("cpu")
    device_flat: torch.Tensor | None = None  # the model's params are views of it
    master: torch.Tensor | None = None  # fp32, host
    exp_avg: torch.Tensor | None = None  # fp32 or bf16, host
    exp_avg_sq: torch.Tensor | None = None
    landing: torch.Tensor | None = None  # pinned, working dtype: gradients in, weights out
    acc: torch.Tensor | None = None  # fp32 host sum of micro-batches (accumulation only)
    streamed: bool = False  # its weights live in `slab.home`, on the device only while used
    slab: object = None  # weights.slab.Slab of a streamed bucket
    # per-step bookkeeping
    micro_list: list = field(default_factory=list)  # arrived, not yet queued
    pending_landing_checked: bool = False
    staging: torch.Tensor | None = None  # device flat gradient staging (multi-slot buckets)
    staging_lo: int = 0  # the bucket offset staging[0] stands for
    sq_norm: float = 0.0
    pending: bool = False  # an update of this bucket's weights is in flight
    last_seq: int = 0  # last engine job queued for this bucket
    landing_seq: int = 0  # last engine job that reads the landing buffer
    update_seq: int = 0  # engine job that produces the pending update
    h2d_event: object = None  # device event: the new weights are on the device
    bcast_done: threading.Event = field(default_factory=threading.Event)  # data parallel
    bcast_event: object = None
    disk: object = None  # disk_tier.DiskTier holding the state (None: in RAM)

    def __post_init__(self) -> None:
        self.bcast_done.set()

    @property
    def expected_slots(self) -> int:
        return sum(1 for s in self.slots if s.expected)

    def nbytes(self, dtype: torch.dtype) -> int:
        return self.numel * torch.empty((), dtype=dtype).element_size()


GPU_UPDATED = ("mapped", "device")  # placements whose AdamW is the CUDA kernel (gpu_updates.py)
DIRECT_BYTES = 1 << 20  # a gradient this large is copied to the host on its own
ALIGN_BYTES = 512  # every parameter starts 512-byte aligned, as torch's allocator places
# tensors (GPU kernels pick their code path by pointer alignment)


def _align(n: int, elems: int) -> int:
    return (n + elems - 1) // elems * elems


def build_buckets(slots: list[Slot], bucket_bytes: int, elem_size: int = 4) -> list[Bucket]:
    """Packs slots (already in forward order) into buckets of at most bucket_bytes (a slot larger
    than that gets a bucket of its own); sets each slot's bucket and offset. Inside a bucket the
    large slots come first and the small ones form a contiguous tail [small_lo, numel), so that
    small gradients are gathered into one device staging buffer and cross PCIe in one copy."""
    buckets: list[Bucket] = []
    cur: list[Slot] = []
    cur_numel = 0
    state_offset = 0
    limit = max(1, bucket_bytes // elem_size)
    align = max(1, ALIGN_BYTES // elem_size)

    def close() -> None:
        nonlocal cur, cur_numel, state_offset
        if not cur:
            return
        b = Bucket(index=len(buckets), slots=cur, numel=0, state_offset=state_offset)
        for s in cur:
            s.direct = len(cur) == 1 or s.numel * elem_size >= DIRECT_BYTES
        off = 0
        for s in [s for s in cur if s.direct]:
            s.bucket, s.offset = b, off
            off = _align(off + s.numel, align)
        b.small_lo = off
        for s in [s for s in cur if not s.direct]:
            s.bucket, s.offset = b, off
            off = _align(off + s.numel, align)
        b.numel = off
        buckets.append(b)
        state_offset += off
        cur, cur_numel = [], 0

    for s in slots:
        if cur and cur_numel + s.numel > limit:
            close()
        cur.append(s)
        cur_numel += _align(s.numel, align)
        if cur_numel >= limit:
            close()
    close()
    return buckets


def runs(slots, key) -> list[tuple[int, int, tuple]]:
    """Maximal runs of consecutive items (with .offset, .numel) of equal key(item) (None = skip the slot), as
    (start_offset, numel, key) over the bucket's element range."""
    out: list[tuple[int, int, tuple]] = []
    for s in slots:
        k = key(s)
        if k is None:
            continue
        if out and out[-1][2] == k and out[-1][0] + out[-1][1] == s.offset:
            start, n, _ = out[-1]
            out[-1] = (start, n + s.numel, k)
        else:
            out.append((s.offset, s.numel, k))
    return out
