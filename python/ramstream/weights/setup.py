"""wrap(param_offload=...): wiring the weight streamer into a wrapped model for the blocks it is
given (the plan's, or the option's explicit choice; which blocks stream is decided by the planner:
planner/wrap_rules.py, policy.py), tied weights kept resident; the mechanism is slab.py and
streamer.py."""

from __future__ import annotations

from collections import Counter

import torch

from ..options import parse_param_offload  # noqa: F401  (setup.parse_param_offload: its old name)
from ..quant.packed import packed_buffers
from .slab import make_copier
from .streamer import Block, WeightStreamer, frozen_slabs

GIB = 2**30


def _nbytes(params) -> int:
    return sum(p.numel() * p.element_size() for p in params)


def block_params(blocks) -> list[list[torch.nn.Parameter]]:
    return [list(dict.fromkeys(b.parameters())) for b in blocks]


def weight_tensors(module) -> list[torch.Tensor]:
    """What streaming a module moves: its parameters and its quantized layers' packed buffers."""
    return list(dict.fromkeys(module.parameters())) + [t for _, _, t in packed_buffers(module)]


def streamed_bytes(model, streamed: dict) -> int:
    """Bytes of the streamed parameters and packed buffers (at home in pinned host memory)."""
    return _nbytes(t for t in weight_tensors(model) if id(t) in streamed)


def agree_streamed(indices: list[int], device: torch.device, log) -> list[int]:
    """Data parallel with param_offload="auto": every rank streams the front blocks the rank
    with the least room needs (free memory differs between GPUs; the buckets, which never span a
    streamed and a resident block, must be the same on every rank)."""
    import torch.distributed as dist

    t = torch.tensor([len(indices)], device=device if dist.get_backend() == "nccl" else "cpu")
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    k = int(t.item())
    if k != len(indices):
        log(f"param_offload=auto: streaming blocks 0-{k - 1}, as another data-parallel rank needs")
    return list(range(k))


def streamed_ids(model, blocks, indices: list[int], log) -> dict[int, int]:
    """{id(tensor): block index} for the parameters and packed quantized buffers of the streamed
    blocks; one also used outside its block (tied weights) stays resident."""

    def named(module):
        yield from module.named_parameters(remove_duplicate=False)
        yield from module.named_buffers(remove_duplicate=False)

    uses = Counter(id(p) for _, p in named(model))
    inside = Counter()
    for k in indices:
        for _, p in named(blocks[k]):
            inside[id(p)] += 1
    out, shared = {}, 0
    for k in indices:
        for p in weight_tensors(blocks[k]):
            if uses[id(p)] > inside[id(p)]:
                shared += 1
                continue
            out[id(p)] = k
    if shared:
        log(f"param_offload: {shared} parameters of streamed blocks are shared with other modules: resident")
    return out


def move_resident(model, device: torch.device, streamed: dict) -> None:
    """Moves every parameter and buffer not streamed to `device`; streamed ones (packed codes of
    quantized layers included) stay where they are (their slabs take them)."""
    with torch.no_grad():
        for m in model.modules():
            for p in list(m._parameters.values()):
                if p is not None and id(p) not in streamed and p.device != device:
                    p.data = p.data.to(device)
            for name, buf in list(m._buffers.items()):
                if buf is not None and id(buf) not in streamed and buf.device != device:
                    m._buffers[name] = buf.to(device)


def devices_of(model) -> dict:
    """{(module id, kind, name): device} of every parameter and buffer: where move_back returns them."""
    out = {}
    for m in model.modules():
        for kind, items in (("p", m._parameters), ("b", m._buffers)):
            for name, t in items.items():
                if t is not None:
                    out[(id(m), kind, name)] = t.device
    return out


def move_back(model, homes: dict) -> None:
    """Returns every parameter and buffer to the device devices_of recorded (a wrap() that ran out
    of device memory half way gives the model back as it came)."""
    with torch.no_grad():
        for m in model.modules():
            for kind, items in (("p", m._parameters), ("b", m._buffers)):
                for name, t in list(items.items()):
                    home = homes.get((id(m), kind, name))
                    if t is None or home is None or t.device == home:
                        continue
                    if kind == "p":
                        t.data = t.data.to(home)
                    else:
                        items[name] = t.to(home)


def block_frozen_slabs(blocks, k: int, streamed: dict, engine) -> list:
    """Slabs for block k's streamed parameters that no engine bucket holds: its frozen ones, and a
    quantized layer's packed codes (their weights move to pinned homes as the slabs are made)."""
    skip = {pid for pid, blk in streamed.items() if blk != k}
    skip |= {id(s.param) for s in engine.slots}
    packed = [t for _, _, t in packed_buffers(blocks[k]) if streamed.get(id(t)) == k]
    return frozen_slabs(blocks[k], skip | _not_streamed(blocks[k], streamed), engine.copier, extra=packed)


def stream_blocks(
    blocks, indices: list[int], streamed: dict, engine, frozen: dict | None = None, disk: dict | None = None
) -> list[Block]:
    """The streamer's Block of each index: the engine's slabs of its trained parameters, and slabs
    made here for its frozen ones (and a quantized layer's packed codes), or taken from `frozen`
    ({index: slabs}, made beforehand) or, for a block in `disk` ({index: [DiskSlab]}: its frozen
    tensors at home on disk, disk_slab.py), from there."""
    copier = engine.copier or make_copier(engine.device)
    engine.copier = copier
    by_block: dict[int, list] = {k: [] for k in indices}
    for b in engine.buckets:
        if b.streamed and streamed.get(id(b.slots[0].param)) in by_block:
            by_block[streamed[id(b.slots[0].param)]].append(b)
    out = []
    for k in indices:
        trained = by_block[k]
        skip = {id(s.param) for b in trained for s in b.slots}
        skip |= {pid for pid, blk in streamed.items() if blk != k}
        packed = [t for _, _, t in packed_buffers(blocks[k]) if streamed.get(id(t)) == k]
        if disk and k in disk:  # (anything else untrained, e.g. outside the optimizer: pinned as usual)
            on_disk = {id(p) for s in disk[k] for p in s.params}
            rest = [t for t in packed if id(t) not in on_disk]
            not_ours = skip | on_disk | _not_streamed(blocks[k], streamed)
            extra = list(disk[k]) + frozen_slabs(blocks[k], not_ours, copier, extra=rest)
        elif frozen is not None:
            extra = frozen[k]
        else:
            extra = frozen_slabs(blocks[k], skip | _not_streamed(blocks[k], streamed), copier, extra=packed)
        slabs = [b.slab for b in trained] + extra
        ready = [lambda b=b: engine.wait_bucket(b) for b in trained]
        out.append(Block(k, blocks[k], slabs, ready))
    return out


def build_streamer(
    blocks, indices: list[int], streamed: dict, engine, window: int, log, disk: dict | None = None
) -> WeightStreamer:
    """The streamer over the streamed blocks (`disk`: stream_blocks's disk slabs by block)."""
    out = stream_blocks(blocks, indices, streamed, engine, disk=disk)
    st = WeightStreamer(out, copier=engine.copier, ahead=window, log=log)
    nbytes = sum(b.nbytes for b in out)
    packed = sum(t.nbytes for k in indices for _, _, t in packed_buffers(blocks[k]) if id(t) in streamed)
    what = f", {packed / GIB:.2f} GiB of them packed quantized codes" if packed else ""
    log(
        f"param_offload: {len(out)} of {len(blocks)} blocks streamed ({nbytes / GIB:.2f} GiB of weights "
        f"in pinned host memory{what}, window {window})"
    )
    return st


def extend_streamer(
    old, blocks, indices: list[int], streamed: dict, engine, window: int, log, frozen: dict,
    disk: dict | None = None,
) -> WeightStreamer:  # fmt: skip
    """A streamer over `old`'s blocks (None: none) and the blocks `indices`, whose trained buckets
    the engine streams already (engine/restream.py) and whose other slabs are in `frozen`
    ({index: slabs}, block_frozen_slabs) or, for a block in `disk`, on disk ({index: [DiskSlab]},
    runtime/disk_weights.py extend): `old` is closed (its weights at home), its Blocks and
    statistics carried over."""
    new = stream_blocks(blocks, indices, streamed, engine, frozen, disk=disk)
    kept, owned = [], None
    if old is not None:
        owned, old.disk = old.disk, None  # its disk slabs stay on disk, in the new streamer
        old.close()
        kept = old.blocks
    st = WeightStreamer(
        sorted(kept + new, key=lambda b: b.index), copier=engine.copier, ahead=window, log=log
    )
    if old is not None:
        st.stats.update(old.stats)
    st.disk = owned
    return st


def _not_streamed(module, streamed: dict) -> set:
    return {id(p) for p in module.parameters() if id(p) not in streamed}
