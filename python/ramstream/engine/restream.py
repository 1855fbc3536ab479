"""Streaming more blocks between steps: a re-plan's lever (runtime/apply.py StreamLever).

The buckets of a resident block (wrap() laid them out so that none spans two blocks: Engine's
block_of) become streamed buckets, as layout.py would have made them at wrap(): a slab whose home in
pinned host memory takes the weights as they are on the device (the device buffer is released), the
fp32 master and moments stay where they are on the host (a bucket whose state was on the GPU,
"mapped" or "device", moves back to the host first: layout.relocate, values unchanged), and an fp32
bucket's home becomes its master (the same values: its weights are its master's copy). Nothing is
rounded or recomputed: the next updates read exactly what they would have read, so a run that
starts streaming a block trains bit for bit as one that never did."""

from __future__ import annotations

import torch

from . import layout


def streamable(engine, ids: dict) -> list:
    """The not yet streamed buckets whose parameters are all in `ids` ({id(parameter): block}),
    each wholly inside one block; ValueError when a bucket has some parameters in `ids` and some
    not (buckets laid out without Engine's block_of)."""
    out = []
    for b in engine.buckets:
        inside = [id(s.param) in ids for s in b.slots]
        if not any(inside) or b.streamed:
            continue
        if not all(inside) or len({ids[id(s.param)] for s in b.slots}) != 1:
            raise ValueError(
                f"ramstream: bucket {b.index} spans a block boundary; a block can start streaming between "
                "steps only when wrap() laid the buckets out by block"
            )
        out.append(b)
    return out


def stream_buckets(engine, ids: dict) -> list:
    """Makes the buckets of the parameters in `ids` ({id(parameter): block index}, a block's whole
    set) streamed; returns them. Quiescent: waits for every update in flight first."""
    from ..weights.slab import Slab, make_copier

    if engine.dp is not None or engine.delayed is not None or engine.disk is not None:
        raise ValueError(
            "ramstream: blocks start streaming between steps only without data parallel, delayed_update "
            "and optimizer state on disk (nvme_offload)"
        )
    todo = streamable(engine, ids)
    engine.synchronize()
    if engine.copier is None:
        engine.copier = make_copier(engine.device)
    homes = _homes(engine, todo)  # every pinned home first: a refusal leaves every bucket as it was
    for b, home in zip(todo, homes):
        if b.placement != "host":
            layout.relocate(engine, b, "host")
        params = [s.param for s in b.slots]
        # the slab fills its home from the weights now on the device, then releases b.device_flat
        b.slab = Slab(
            params, [s.offset for s in b.slots], b.numel, copier=engine.copier, flat=b.device_flat, home=home
        )
        if b.dtype == torch.float32 and b.master is not None:
            b.slab.home.copy_(b.master)  # equal values: the home is the master from now on
            b.master = b.slab.home
        b.streamed, b.h2d_event = True, None
        for s in b.slots:
            s.streamed = True
            engine.streamed[id(s.param)] = ids[id(s.param)]
    engine.dev.synchronize()
    return todo


def _homes(engine, buckets) -> list:
    """A pinned home per bucket (its working dtype, its size); MemoryError with the arithmetic when
    host memory refuses one (those taken so far are released)."""
    out = []
    try:
        for b in buckets:
            out.append(engine.copier.host_buffer(b.numel, b.dtype).zero_())
    except (RuntimeError, MemoryError) as e:
        need = sum(b.numel * b.dtype.itemsize for b in buckets)
        got = sum(t.nbytes for t in out)
        out.clear()
        raise MemoryError(
            f"ramstream: streaming {len(buckets)} more buckets needs {need / 2**30:.2f} GiB of pinned host "
            f"memory for their weights; {got / 2**30:.2f} GiB was taken when the next one was refused ({e})"
        ) from None
    return out
