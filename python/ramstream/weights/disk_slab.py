"""A disk slab: a streamed block's frozen weights at home in one record of a DiskStore (issue 29).

One component for every front end (OffloadModel's nvme/nvme_layers today). `DiskWeights` owns the
store (one per streamer, one record per disk slab) and a ring of `ahead` + 1 aligned staging
buffers, each the size of the largest record; a `DiskSlab` is one block's frozen tensors (every
dtype, packed as bytes, each view 512-byte aligned):

  load()   takes a staging buffer and queues the read of the record into it; every tensor's .data
           becomes its view of the device bytes. Once the read is done (found by a later load or
           wait, or waited for by wait()), the device storage is allocated and filled from the
           staging buffer (Copier.fill, as a Slab's load): a prefetched block's read runs on the
           store's threads while the blocks before it compute.
  evict()  every tensor's .data becomes an empty stand-in (shape (0,), its dtype: any use outside
           the block's run fails loudly instead of reading freed memory); the device storage is
           released and so is the staging buffer (frozen: nothing is written back).

So pinned RAM for disk blocks is the ring (window-sized), not the model. At rest the weights are
only on disk: `paged()` brings them into RAM for a while (state_dict, load_state_dict: written back
to the record when asked), `restore()` brings them home for good (the block stops being on disk).
"""

from __future__ import annotations

import contextlib
import os

import torch

from .slab import _unguarded

_ALIGN = 512  # bytes: every tensor's view starts here (element alignment of every dtype)


def _stand_in(dtype: torch.dtype) -> torch.Tensor:
    return torch.empty(0, dtype=dtype)


def nvme_folder(path, env=os.environ, where: str = "OffloadModel") -> str:
    """The folder of the scratch file: nvme_path (a directory; a file path, RamTorch's form,
    means its directory: ramstream names its own file there), else RAMSTREAM_NVME_DIR; neither:
    ValueError naming both."""
    folder = path if path is not None else env.get("RAMSTREAM_NVME_DIR")
    if not folder:
        raise ValueError(
            f"{where}: weights on disk (nvme, nvme_layers) need a folder: pass nvme_path=<a directory> "
            "or set RAMSTREAM_NVME_DIR"
        )
    folder = os.fspath(folder)
    return folder if os.path.isdir(folder) else (os.path.dirname(folder) or ".")


def layout(tensors) -> tuple[list[int], int]:
    """Byte offsets of `tensors` packed in one record (each aligned to 512 bytes), and its size."""
    offsets, off = [], 0
    for t in tensors:
        offsets.append(off)
        off = (off + t.numel() * t.element_size() + _ALIGN - 1) // _ALIGN * _ALIGN
    return offsets, off


class DiskWeights:
    """The store and staging ring of one streamer's disk slabs.

    Args:
        groups: for each disk slab, the tensors it holds (their layout fixes the record sizes).
        directory: the folder of the scratch file (created exclusively, mode 0600, its space
            reserved now: a full disk or an unwritable folder is an OSError naming the folder
            here, before any weight moved; removed by close(), garbage collection or exit).
        copier: where the H2D copies run (weights/slab.py).
        ahead: the streamer's `ahead`: the ring holds `ahead` + 1 staging buffers.
        where: the front end and option that named the folder, for the OSError.
    """

    def __init__(
        self, groups, directory: str, *, copier, ahead: int, where: str = "OffloadModel: nvme_path"
    ) -> None:
        self.sizes = [layout(g)[1] for g in groups]
        self.directory, self.copier, self.ahead, self.where = directory, copier, ahead, where
        self.store = self._open(self.sizes, f"the weights of {len(self.sizes)} blocks")
        # (store, record) of each slab's record: the first store's, then those of grow()
        self.records = [(self.store, i) for i in range(len(self.sizes))]
        self.grown: list = []  # the stores grow() opened, in order
        self.largest = max(self.sizes, default=0)
        self.ring_size = min(ahead + 1, len(self.sizes))
        self.free: list[torch.Tensor] = [self._buffer() for _ in range(self.ring_size)]
        self.stats = {"nvme_loads": 0, "nvme_bytes_read": 0, "staging_extra": 0, "reads_ahead": 0}
        self.pending: list[DiskSlab] = []  # loaded slabs whose read is in flight (load order)

    def _open(self, sizes: list[int], what: str):
        from ..disk import DiskStore

        try:
            return DiskStore(self.directory, sizes)
        except OSError as e:
            raise type(e)(
                e.errno,
                f"{self.where}={self.directory!r}: cannot hold {what} on disk ({sum(sizes)} bytes "
                f"needed): {e.strerror or e}",
            ) from e

    def grow(self, groups) -> list[DiskSlab]:
        """Records for more slabs (blocks that start streaming mid-run): a second file in the same
        folder, its space reserved at open as the first's (the first file cannot grow in place),
        each group's current weights written to its record; returns the DiskSlabs (evicted), whose
        records follow the existing ones. Call it with every slab evicted (the ring all free). A
        full disk or an unwritable folder is an OSError naming the folder; on any failure nothing
        changed (the new file is removed, the tensors keep their values where they were)."""
        sizes = [layout(g)[1] for g in groups]
        if not sizes:
            return []
        if len(self.free) != self.ring_size + self.stats["staging_extra"]:
            raise RuntimeError("DiskWeights.grow: a staging buffer is in use (evict every slab first)")
        store = self._open(sizes, f"the weights of {len(sizes)} more blocks")
        was = [[p.data for p in g] for g in groups]  # where they were: put back on a failure
        old = (list(self.sizes), list(self.records), self.largest, self.ring_size, list(self.free))
        made: list[DiskSlab] = []
        try:
            largest = max(self.largest, *sizes)
            ring = min(self.ahead + 1, len(self.sizes) + len(sizes))
            if largest > self.largest:  # every buffer of the ring is too small: a new ring
                self.free = []
            self.largest = largest
            while len(self.free) < ring + self.stats["staging_extra"]:
                self.free.append(self._buffer())
            self.ring_size = ring
            first = len(self.sizes)
            self.sizes += sizes
            self.records += [(store, i) for i in range(len(sizes))]
            for r, g in enumerate(groups):
                made.append(DiskSlab(self, first + r, list(g)))
        except BaseException:
            _put_back(groups, was)
            self.sizes, self.records, self.largest, self.ring_size, self.free = old
            store.close()
            raise
        self.grown.append(store)
        return made

    def shrink(self, slabs: list, was: list | None = None) -> None:
        """Undoes the grow() that returned `slabs`: each slab's tensors become `was` (per slab, the
        tensors they were before grow(), e.g. on the device), else ordinary host tensors holding
        the records' weights (restore()); its file is removed, the records as before (the ring stays
        as large: it is reused)."""
        if not slabs:
            return
        store = slabs[0].store
        for s in slabs:
            s.evict()
        if was is None:
            for s in slabs:
                s.restore()
        else:
            _put_back([s.params for s in slabs], was)
        keep = [i for i, (st, _) in enumerate(self.records) if st is not store]
        self.sizes = [self.sizes[i] for i in keep]
        self.records = [self.records[i] for i in keep]
        self.grown = [g for g in self.grown if g is not store]
        store.close()

    def poll(self) -> None:
        """Queues the H2D copy of every pending slab whose read is done (in load order)."""
        while self.pending and self.pending[0].read.done():
            s = self.pending.pop(0)
            s._fill()
            self.stats["reads_ahead"] += 1

    def _buffer(self) -> torch.Tensor:
        from ..ops.memory import pinned_empty  # aligned for O_DIRECT; page-locked with a GPU

        return pinned_empty(max(self.largest, 1), torch.uint8)

    def staging_bytes(self) -> int:
        """Bytes of the staging ring (`ahead` + 1 buffers of the largest record, plus any extra)."""
        return (self.ring_size + self.stats["staging_extra"]) * max(self.largest, 1)

    def take(self) -> torch.Tensor:
        if not self.free:  # more blocks loaded than the window (a hook that did not fire): grow
            self.stats["staging_extra"] += 1
            return self._buffer()
        return self.free.pop()

    def give(self, buf: torch.Tensor) -> None:
        self.free.append(buf)

    def slabs(self, groups) -> list[DiskSlab]:
        """Writes each group's current weights to its record; returns the DiskSlabs (evicted)."""
        return [DiskSlab(self, i, list(g)) for i, g in enumerate(groups)]

    def direct(self) -> bool:
        return self.store.direct

    def close(self) -> None:
        """Closes the stores: the files are removed. Idempotent."""
        for st in [self.store, *self.grown]:
            st.close()
        self.free = []


def _put_back(groups, was) -> None:
    with _unguarded():
        for g, w in zip(groups, was):
            for p, t in zip(g, w):
                p.data = t


class DiskSlab:
    """A block's frozen tensors (`params`: parameters or buffers, any dtypes) at home in record
    `record` of `disk`'s store; the streamer's Slab interface (load, wait, evict, ...)."""

    on_disk = True  # WeightStreamer.home_bytes counts it as disk, not pinned host memory

    def __init__(self, disk: DiskWeights, record: int, params: list) -> None:
        self.disk, self.record, self.params = disk, record, params
        self.store, self.index = disk.records[record]  # the file and its record there
        self.offsets, self.nbytes = layout(params)
        self.shapes, self.dtypes = [p.shape for p in params], [p.dtype for p in params]
        self.numel = self.nbytes
        self.dtype = torch.uint8
        self.copier = disk.copier
        self.flat = torch.empty(self.nbytes, dtype=torch.uint8, device=self.copier.device)
        self._alias = torch.empty(0, dtype=torch.uint8, device=self.copier.device)
        self._alias.set_(self.flat.untyped_storage(), 0, (self.nbytes,))
        self.dviews = self._views(self.flat)
        self.hviews = [_stand_in(p.dtype) for p in params]  # (streamer.apply's stand-ins)
        self.staging = self.read = None
        self.event = None
        buf = disk.take()
        try:
            rec = buf[: self.nbytes]
            rec.zero_()  # padding included
            with torch.no_grad():
                for p, v in zip(params, self._views(rec)):
                    v.copy_(p.data)
            self.store.write_from(self.index, rec).wait()
        finally:
            disk.give(buf)
        self.loaded = True
        self.evict()
        self.flat.untyped_storage().resize_(0)

    def _views(self, flat: torch.Tensor) -> list[torch.Tensor]:
        """Each tensor's view of `flat` (the record's bytes, on any device)."""
        out = []
        for shape, dtype, off in zip(self.shapes, self.dtypes, self.offsets):
            n = shape.numel() * dtype.itemsize
            out.append(flat[off : off + n].view(dtype).view(shape))
        return out

    def load(self) -> None:
        """Takes a staging buffer and queues the read of the record into it; the tensors become
        device views. The H2D copy is queued when the read is done: at wait(), or earlier at any
        load or wait of the streamer's disk slabs that finds it done (so a prefetch's read runs
        on the store's threads while the blocks before it compute). Call wait() before work that
        reads them."""
        if self.loaded:
            return
        buf = self.disk.take()
        try:
            self.read = self.store.read_into(self.index, buf[: self.nbytes])
        except BaseException:
            self.disk.give(buf)
            raise
        self.staging = buf
        self.disk.stats["nvme_loads"] += 1
        self.disk.stats["nvme_bytes_read"] += self.nbytes
        with _unguarded():
            for p, v in zip(self.params, self.dviews):
                p.data = v
        self.loaded = True
        self.disk.pending.append(self)
        self.disk.poll()

    def _fill(self) -> None:
        """The read done (waited for), the H2D copy of the staging buffer is queued."""
        if self.read is None:
            return
        read, self.read = self.read, None
        rec = read.wait()
        self.event = self.copier.fill(self._alias, rec, self.nbytes)

    def wait(self) -> None:
        self.disk.poll()
        if self.read is not None:
            self.disk.pending.remove(self)
            self._fill()
        self.copier.wait(self.event)

    def evict(self) -> None:
        """The tensors become empty stand-ins; the device storage and the staging buffer go back
        (the staging buffer once its read and its H2D copy are done)."""
        if not self.loaded:
            return
        with _unguarded():
            for p, v in zip(self.params, self.hviews):
                p.data = v
        if self.read is not None:  # never used: the read must end before the buffer is reused
            self.disk.pending.remove(self)
            read, self.read = self.read, None
            read.wait()
        if self.staging is not None:
            if self.event is not None:
                self.event.synchronize()  # the copy out of the staging buffer is done
            self.disk.give(self.staging)
            self.staging = None
        self.flat.untyped_storage().resize_(0)
        self.loaded = False
        self.event = None

    def device_bytes(self) -> int:
        return self.flat.untyped_storage().nbytes()

    def _read(self) -> torch.Tensor:
        from ..ops.memory import pinned_empty

        buf = pinned_empty(max(self.nbytes, 1), torch.uint8)[: self.nbytes]
        return self.store.read_into(self.index, buf).wait()

    @contextlib.contextmanager
    def paged(self, write_back: bool = False):
        """The tensors are views of a host copy read from the record for the duration (the slab
        must be evicted); yields the copy (uint8). With `write_back` the copy is written to the
        record afterwards. (Tensors taken from the parameters meanwhile, detached ones included,
        follow them back to the stand-ins: clone what must outlive the block.)"""
        if self.loaded:
            raise RuntimeError("DiskSlab.paged: the slab is loaded (evict it first)")
        rec = self._read()
        with _unguarded():
            for p, v in zip(self.params, self._views(rec)):
                p.data = v
        try:
            yield rec
            if write_back:
                self.store.write_from(self.index, rec).wait()
        finally:
            with _unguarded():
                for p, v in zip(self.params, self.hviews):
                    p.data = v

    def restore(self) -> None:
        """The tensors become ordinary host tensors holding the record's weights (for good)."""
        self.evict()
        rec = self._read()
        with _unguarded():
            for p, v in zip(self.params, self._views(rec)):
                p.data = v.clone()
