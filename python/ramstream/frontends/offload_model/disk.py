"""OffloadModel's chunks on disk (RamTorch's nvme, nvme_layers, nvme_path; issue 29): which
chunks, their checks, and the DiskWeights (weights/disk_slab.py) of the streamer's disk blocks."""

from __future__ import annotations

import contextlib

from ...weights.disk_slab import DiskWeights, nvme_folder

ONLY_FROZEN = (
    "only frozen chunk weights (inference, a LoRA base) go to disk in this version: freeze them "
    "(requires_grad_(False)), or keep the chunk off disk (nvme_layers, pin)"
)


def disk_chunks(n: int, pinned, nvme: int, nvme_layers, indices) -> frozenset:
    """RamTorch's placement: nvme_layers (indices) when given, else the last chunk of each of
    `nvme` equal strides; minus the pinned chunks (a pinned chunk stays on the device)."""
    if nvme_layers is not None:
        disk = set(indices)
    elif nvme <= 0:
        disk = set()
    else:
        k = min(nvme, n)
        disk = {(i + 1) * n // k - 1 for i in range(k)}
    return frozenset(disk - set(pinned))


def check_disk(chunks, disk, nvme, nvme_layers, nvme_path) -> str | None:
    """The folder for the disk chunks (None when there are none): ValueError without one,
    NotImplementedError for a trained parameter in a disk chunk."""
    if not disk:
        return None
    folder = nvme_folder(nvme_path)
    for i in sorted(disk):
        names = [name for name, p in chunks[i].named_parameters() if p.requires_grad]
        if names:
            raise NotImplementedError(
                f"OffloadModel: nvme={nvme!r}, nvme_layers={nvme_layers!r} put chunk {i} on disk, whose "
                f"parameters {names[:4]} are trained; {ONLY_FROZEN}"
            )
    return folder


def open_disk(model, pinned) -> dict:
    """Opens the store for the disk chunks not in `pinned` and writes their weights there;
    returns {chunk index: [DiskSlab]} (the store held by model._hooks.disk). A folder that
    cannot hold them is an OSError naming it, raised before any weight moved."""
    disk = sorted(set(model._nvme) - set(pinned))
    if not disk:
        return {}
    check_disk(model.chunks, disk, model._nvme_args[0], model._nvme_args[1], model._nvme_path)
    groups = [[p for p in dict.fromkeys(model.chunks[i].parameters()) if p.numel() > 0] for i in disk]
    try:
        store = DiskWeights(groups, model._nvme_path, copier=model.copier, ahead=model.window - 1)
    except OSError:
        model._hooks.release()  # nothing streams yet: the model is left closed, its chunks untouched
        raise
    model._hooks.disk = store
    return {i: [s] for i, s in zip(disk, store.slabs(groups))}


def disk_slabs(model) -> list:
    streamer = model._hooks.streamer
    if streamer is None or model._hooks.disk is None:
        return []
    return [s for b in streamer.blocks for s in b.slabs if getattr(s, "disk", None) is not None]


def release_disk(hooks, slabs) -> None:
    """The disk chunks' weights back in host memory for good (a rebuild writes them again), and
    the store closed (its file removed)."""
    for s in slabs:
        s.restore()
    if hooks.disk is not None:
        hooks.disk.close()
        hooks.disk = None


@contextlib.contextmanager
def paged_disk(model, write_back: bool = False):
    """Every disk chunk's parameters are views of a host copy read from disk for the duration
    (state_dict, load_state_dict); with `write_back` the copies are written back afterwards.
    Yields the data pointers of the copies' storages."""
    slabs = disk_slabs(model)
    if slabs:
        model.streamer.evict_all()
        model.copier.synchronize()
    with contextlib.ExitStack() as stack:
        yield {stack.enter_context(s.paged(write_back)).untyped_storage().data_ptr() for s in slabs}


def disk_stats(disk) -> dict:
    """RamTorch's nvme_loads, and the bytes read from disk, the loads whose read was done before
    their block needed it, the staging ring's bytes and the file's I/O mode (None without disk
    chunks)."""
    if disk is None:
        return {
            "nvme_loads": 0,
            "nvme_bytes_read": 0,
            "nvme_reads_ahead": 0,
            "nvme_staging_bytes": 0,
            "nvme_direct": None,
        }
    return {
        "nvme_loads": disk.stats["nvme_loads"],
        "nvme_reads_ahead": disk.stats["reads_ahead"],
        "nvme_bytes_read": disk.stats["nvme_bytes_read"],
        "nvme_staging_bytes": disk.staging_bytes(),
        "nvme_direct": disk.direct(),
    }
