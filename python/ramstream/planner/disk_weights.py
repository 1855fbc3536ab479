"""The weights' part of the disk tier (nvme_weights, issue 29): which streamed blocks keep their
FROZEN weights (a LoRA base, a quantized layer's packed codes) in the scratch file instead of
pinned host RAM. Pure arithmetic on the candidate of plan.py; disk.py calls it before it sizes the
optimizer state's share, so frozen weights go to disk first: they are only read (no write wear),
and the numbers do not change (the same bytes come back).

- RAM and pinned memory: "streamed_weights" less the blocks' frozen bytes, plus "weight_staging",
  the streamer's ring of STREAM_WINDOW aligned buffers of the largest disk block's frozen bytes
  (weights/disk_slab.py DiskWeights). Trained parameters of those blocks stay in RAM (their slabs
  are the host AdamW's buckets).
- Reads per step: every disk block once in the forward and once more in the backward, except
  the last STREAM_WINDOW streamed blocks, which stay loaded from the forward into the backward
  (weights/streamer.py). A recompute in backward runs while its block is loaded: no extra read.
  timing.with_disk_reads adds them to the disk's time.
- nvme_weights="auto": nothing while the candidate fits in RAM; otherwise, when the profile knows
  a disk, the fewest streamed blocks with frozen weights, from the back of the stack (the last
  ones are read once per step), whose frozen bytes less the staging ring cover what RAM lacks;
  all of them when that is not enough (the optimizer's share, disk.py, then does the rest).
- True: every streamed block with frozen weights; an int k: the last k streamed blocks; a list:
  those of its indices that stream; False: none.

Between steps (a larger step makes more blocks stream: replan.py replan_stream) the run's placement
is given as `applied` = (blocks on disk now, blocks whose frozen weights' place is fixed: those
streaming now; every block when the run can put none on disk: no disk store and no folder given).
The blocks on disk stay there, the others fixed stay in RAM, and only the blocks that start
streaming may go to disk, by the same rule: with True every one of them; with "auto" the fewest
from the back whose frozen bytes, with those on disk already, less the staging ring cover what RAM
lacks; with an int k or a list none (the option named wrap()'s blocks; the new ones stay in RAM:
reason_in_ram). With no block on disk yet (wrap() opened no store, a folder was given: the runtime
opens the store then) "auto" also needs the profile to know the disk, as at wrap(), and the ring
is a new one: fewer new blocks than the ring's NVME_WEIGHTS_WINDOW buffers free no RAM. The disk's
budget (disk.py fits) bounds the blocks in either case; a step whose blocks do not fit it is
refused with the arithmetic (disk.py error_lines).
"""

from __future__ import annotations

from .rules import NVME_WEIGHTS_WINDOW

_GIB = 2**30


def frozen_bytes(ctx, i: int) -> int:
    """Block i's frozen bytes as the plan stores them (quantized when ctx.quant says so)."""
    b = ctx.shape.blocks[i]
    return max(0, ctx.weight(b) - b.trained_bytes)


def staging(sizes: list[int]) -> int:
    """The streamer's staging ring for disk blocks of `sizes` bytes (DiskWeights.staging_bytes)."""
    return min(NVME_WEIGHTS_WINDOW, len(sizes)) * max(sizes, default=0)


def reads_per_step(
    disk: list[int], streamed: list[int], sizes: dict, window: int = NVME_WEIGHTS_WINDOW
) -> int:
    """Bytes read from disk per step (module docstring): twice, once for the blocks kept loaded
    from the forward into the backward (the last `window` streamed blocks: weight_window + 1)."""
    kept = set(sorted(streamed)[-window:])
    return sum(sizes[i] * (1 if i in kept else 2) for i in disk)


def choose(option, streamed: list[int], sizes: dict, need: int, known: bool, applied=None) -> list[int]:
    """The disk blocks for `option` (module docstring); need: the RAM the candidate lacks (<= 0:
    it fits), known: the profile knows a disk (needed by "auto" at wrap()); applied: the run's
    placement between steps (module docstring), None at wrap()."""
    order = [i for i in sorted(streamed) if sizes[i] > 0]
    if applied is not None:
        return _choose_more(option, order, sizes, need, applied, known)
    if option is False or not order:
        return []
    if option is True:
        return order
    if isinstance(option, list):
        return [i for i in order if i in set(option)]
    if isinstance(option, int):
        return order[len(order) - option :] if option else []
    if need <= 0 or not known:  # "auto"
        return []
    out: list[int] = []
    for i in reversed(order):
        out.insert(0, i)
        if sum(sizes[j] for j in out) - staging([sizes[j] for j in out]) >= need:
            break
    return out


def _choose_more(option, order: list[int], sizes: dict, need: int, applied, known: bool) -> list[int]:
    """choose() between steps: the blocks on disk now, and of the blocks not placed yet (those that
    start streaming) every one with True, the fewest from the back that cover `need` with "auto"
    (no disk rates needed once a block is on disk: the store exists; without one, `known` as at
    wrap()), none otherwise."""
    on, placed = set(applied[0]), set(applied[1])
    out = [i for i in order if i in on]
    new = [i for i in order if i not in placed]
    if option is True:
        return sorted(out + new)
    if option != "auto" or need <= 0 or (not out and not known):
        return out
    for i in reversed(new):
        if sum(sizes[j] for j in out) - staging([sizes[j] for j in out]) >= need:
            break
        out = sorted(out + [i])
    return out


def reason_in_ram(option, store: bool, folder: bool = False) -> str:
    """Why blocks that start streaming between steps keep their frozen weights in RAM (store: the
    run has a disk store; folder: nvme_dir or RAMSTREAM_NVME_DIR names one, so one may be opened)."""
    if not store and not folder:
        return (
            "no disk store: wrap() put no block's frozen weights on disk and no folder was given "
            "(nvme_dir, RAMSTREAM_NVME_DIR) to open one mid-run"
        )
    if not store and option == "auto":
        return "RAM fits them, or the disk's rates are unknown (nvme_weights='auto'; no disk store opened)"
    if option is True or option == "auto":
        return "RAM fits them (nvme_weights='auto')" if option == "auto" else "they hold no frozen weight"
    return f"nvme_weights={option!r} named wrap()'s blocks; blocks that start streaming later stay in RAM"


def apply(ctx, c: dict, rows: list, option) -> tuple[dict, list]:
    """(c, rows) with the frozen weights of the chosen blocks on disk: RAM and pinned components
    of c and of each row's RAM (rows: disk.py's (RAM, state bytes, kept bytes)); c["disk_weights"]
    holds the choice (None: no block)."""
    streamed = list(c.get("streamed", []))
    sizes = {i: frozen_bytes(ctx, i) for i in streamed}
    need = max((sum(r.values()) for r, _, _ in rows), default=0) - ctx.ram
    disk = choose(option, streamed, sizes, need, ctx.disk.known and not ctx.disk.assumed, ctx.disk.applied)
    if not disk:
        return {**c, "disk_weights": None}, rows
    moved = sum(sizes[i] for i in disk)
    ring = staging([sizes[i] for i in disk])

    def less(parts: dict) -> dict:
        return {**parts, "streamed_weights": parts.get("streamed_weights", 0) - moved, "weight_staging": ring}

    info = {"blocks": disk, "bytes": moved, "staging": ring, "option": option, "need": need,
            "read_per_step": reads_per_step(disk, streamed, sizes), "largest": max(sizes[i] for i in disk),
            "budget": ctx.disk.budget, "free": ctx.disk.free, "read_gbps": ctx.disk.read_gbps,
            "dir": ctx.disk.directory, "ram_without": max(sum(r.values()) for r, _, _ in rows)}  # fmt: skip
    c = {**c, "ram": less(c["ram"]), "pinned": less(c.get("pinned", {})), "disk_weights": info}
    return c, [(less(r), t, k) for r, t, k in rows]


def reason(ctx, c: dict) -> list[str]:
    """One line for the weights on disk (none when no block is)."""
    w = c.get("disk_weights")
    if not w:
        return []
    from ..blocks import ranges_text

    why = (
        f"as RAM needs {w['ram_without'] / _GIB:.2f} GiB without it vs {ctx.ram / _GIB:.2f} GiB available"
        if w["option"] == "auto"
        else f"nvme_weights={w['option']!r}"
    )
    rate = (
        f", {w['read_per_step'] / (w['read_gbps'] * 1e9) * 1e3:.0f} ms of disk reads per step at "
        f"{w['read_gbps']:.3g} GB/s"
        if w["read_gbps"]
        else " (the disk's read rate unknown: its time is not in the step)"
    )
    where = f" in {w['dir']}" if w["dir"] else ""
    return [
        f"disk: frozen weights of blocks {ranges_text(w['blocks'])} on disk{where}: {w['bytes'] / _GIB:.2f} GiB, "
        f"{why}; RAM {(w['bytes'] - w['staging']) / _GIB:.2f} GiB less (staging ring {w['staging'] / _GIB:.2f} "
        f"GiB); read only (no write wear), {w['read_per_step'] / 1e9:.2f} GB read per step{rate}"
    ]
