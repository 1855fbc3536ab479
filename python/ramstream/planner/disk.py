"""The disk tier's part of plan_training() (nvme_offload, issue 29): which share of the host-updated
optimizer state lives in a scratch file on disk, the RAM it frees, the disk bytes and the lines
that explain it. Pure arithmetic on the HardwareProfile's disk_* fields; timing.with_disk times it.

The host-updated state is what the host AdamW reads and writes: per host parameter its fp32 master
and two moments (4 + 2 x 4 B, 4 + 2 x 2 with bf16 moments). nvme_share is a share of those bytes;
the gradient landing buffers, the streamed weights and the GPU-updated ("mapped") state stay in RAM.
An fp32 model's streamed block keeps its master as its streamed weight (engine/updater.py): that
master is in RAM either way, so the share is sized as if those masters went to disk first and freed
nothing (the engine's choice of buckets is not the planner's to assume).

- nvme_offload="auto": no disk while the plan fits in RAM; else, when the profile knows a disk
  (profile_hardware(nvme_dir=...)), the smallest share that fits with rules.NVME_RAM_MARGIN of RAM
  kept for the disk's staging buffers, tried after bf16 moments (the cheaper change), and
  refused when its bytes exceed rules.DISK_FREE_SHARE of the disk's free space.
- True: every byte of it (share 1.0); a number in [0, 1]: that share; False: none.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from . import disk_weights as _weights
from .policy import BUCKET_BYTES
from .rules import DISK_FREE_SHARE, NVME_RAM_MARGIN

ACCEPTED = "'auto', True, False or a share in [0, 1]"
_GIB = 2**30


@dataclass(frozen=True)
class Disk:
    """The parsed option and what the profile says of the disk (rates in GB/s, None: unknown)."""

    option: object  # "auto" or a share in [0, 1]
    known: bool  # the profile has the disk's rates (nvme_dir was measured or rates were given)
    read_gbps: float | None = None
    write_gbps: float | None = None
    free: int | None = None
    directory: str | None = None
    assumed: bool = False  # suggest.py's "what if there were a disk with room" (free space unbounded)
    weights: object = False  # nvme_weights (disk_weights.py): "auto", True, False, k or block indices
    # between steps: (blocks whose frozen weights are on disk, blocks whose place is fixed); None at wrap()
    applied: tuple | None = None

    @property
    def budget(self) -> int | None:
        """The bytes the scratch file may take: DISK_FREE_SHARE of the free space; None: unknown."""
        return None if self.free is None or self.assumed else int(self.free * DISK_FREE_SHARE)


def parse(value, where: str) -> object:
    """nvme_offload as "auto" or a share in [0, 1] (True 1.0, False 0.0); ValueError otherwise."""
    if isinstance(value, str) and value == "auto":
        return "auto"
    if isinstance(value, bool):
        return 1.0 if value else 0.0
    if isinstance(value, (int, float)) and math.isfinite(value) and 0 <= value <= 1:
        return float(value)
    raise ValueError(f"{where} nvme_offload={value!r} is not accepted; accepted: {ACCEPTED}")


def tier(prof, option, where: str, assume: bool = False, weights=False, applied=None) -> Disk:
    """The Disk of `prof` (its disk_* fields checked: ValueError naming the field) for `option`."""
    for name in ("disk_read_gbps", "disk_write_gbps", "disk_free"):
        v = getattr(prof, name, None)
        if v is None:
            continue
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0:
            what = "bytes >= 0" if name == "disk_free" else "GB/s > 0"
            raise ValueError(
                f"{where} profile.{name}={v!r} is not accepted; accepted: None or a finite number of {what}"
            )
    r, w = getattr(prof, "disk_read_gbps", None), getattr(prof, "disk_write_gbps", None)
    known = bool(r and w)
    from ..options import parse_nvme_weights

    return Disk(parse(option, where), known or assume, r if known else None, w if known else None,
                getattr(prof, "disk_free", None), getattr(prof, "disk_dir", None), assume,
                parse_nvme_weights(weights, where), _applied(applied, where))  # fmt: skip


def _applied(value, where: str):
    """_disk_applied as (on disk, placed) tuples of block indices; None stays None."""
    if value is None:
        return None
    try:
        on, placed = (tuple(sorted(int(i) for i in v)) for v in value)
    except (TypeError, ValueError):
        raise ValueError(
            f"{where} _disk_applied={value!r} is not accepted; accepted: None or (blocks on disk, blocks placed)"
        ) from None
    return on, placed


def passes(disk: Disk) -> list:
    """The disk option of each pass over the candidates: a given share in one pass; "auto" first
    without a disk, then (a disk known) with the smallest share that fits."""
    if disk.option != "auto":
        return [disk.option]
    return [0.0, "auto"] if disk.known else [0.0]


def moment_order(moments: list[str], option) -> list[str]:
    """With "auto" the disk is tried after bf16 moments failed alone: bf16 first (fewer bytes)."""
    return moments[::-1] if option == "auto" else moments


def state_bytes(numel: int, mb: int) -> int:
    """Host-updated state per host parameter: fp32 master + two moments of mb bytes."""
    return numel * (4 + 2 * mb)


def apply(c: dict, rows: list, ram_budget: int, option, disk: Disk, mb: int) -> dict:
    """The candidate `c` with a share of its host-updated state on disk. rows: per optimizer split
    the run holds (step 2's and the refined one), (RAM components, host-updated state bytes, bytes
    of it that stay in RAM whatever the share: an fp32 streamed block's master). The largest RAM
    after the share becomes c["ram"]; c["disk"] records the share and its bytes (None: no disk)."""
    if option == 0.0 or not any(t for _, t, _ in rows):
        return {**c, "disk": None}
    need = [sum(ram.values()) + NVME_RAM_MARGIN - ram_budget for ram, _, _ in rows]
    if option == "auto":
        if max(need) <= 0:  # fits without the disk: pass 1 saw it (and refused it for VRAM)
            return {**c, "disk": None}
        share = min(1.0, max((keep + n) / t if t else 0.0 for (_, t, keep), n in zip(rows, need)))
    else:
        share = float(option)
    after = []
    for ram, t, keep in rows:
        d = math.ceil(share * t)
        freed = min(max(0, d - keep), ram.get("optimizer_state", 0))
        after.append((d, freed, {**ram, "optimizer_state": ram.get("optimizer_state", 0) - freed,
                                 "disk_staging": NVME_RAM_MARGIN}))  # fmt: skip
    d, freed, ram = max(after, key=lambda a: sum(a[2].values()))
    d = max(a[0] for a in after)
    budget = disk.budget
    info = {"share": share, "state_on_disk": d, "host_state": max(t for _, t, _ in rows), "ram_saved": freed,
            "ram_without": max(sum(r.values()) for r, _, _ in rows), "budget": budget, "free": disk.free,
            "read_gbps": disk.read_gbps, "write_gbps": disk.write_gbps, "dir": disk.directory, "option": option,
            "fits": budget is None or d <= budget,
            "bucket_state": min(d, state_bytes(BUCKET_BYTES // 4, mb))}  # fmt: skip
    return {**c, "ram": ram, "disk": info}


def fits(c: dict) -> bool:
    """The state and the frozen weights on disk (disk_weights.py) fit the disk's budget together."""
    d, w = c.get("disk"), c.get("disk_weights")
    if d is None and not w:
        return True
    budget = (d or w)["budget"]
    total = (d["state_on_disk"] if d else 0) + (w["bytes"] if w else 0)
    return budget is None or total <= budget


def memory(c: dict) -> dict | None:
    """Plan.memory["disk"]: the state and frozen weights on disk, the RAM they free, the bytes read and
    written per step, the disk's free space and budget."""
    d, w = c.get("disk"), c.get("disk_weights")
    if d is None and not w:
        return None
    state = d["state_on_disk"] if d else 0
    wb = w["bytes"] if w else 0
    return {"optimizer_state": state, "weights": wb, "total": state + wb, "budget": (d or w)["budget"],
            "free": (d or w)["free"], "ram_saved": (d["ram_saved"] if d else 0) + (wb - w["staging"] if w else 0),
            "written_per_step": state, "read_per_step": state + (w["read_per_step"] if w else 0),
            "weights_read_per_step": w["read_per_step"] if w else 0}  # fmt: skip


def _g(x) -> str:
    return f"{x / _GIB:.2f} GiB"


def reasons(ctx, c: dict) -> list[str]:
    """The lines for the disk choice: the frozen weights' (disk_weights.py), then the optimizer
    state's (none when no disk is known and none was asked for)."""
    disk, d = ctx.disk, c.get("disk")
    wl = _weights.reason(ctx, c)
    if d is None:
        if disk.known and not disk.assumed:
            fits = "RAM fits" if not wl else "RAM fits with the weights on disk"
            return wl + [
                f"disk: none of the optimizer state on disk (nvme_offload={_opt(disk.option)}: {fits})"
            ]
        return wl
    where = f" in {d['dir']}" if d["dir"] else ""
    why = (
        f"as RAM needs {_g(d['ram_without'])} without it vs {ctx.ram / _GIB:.2f} GiB available, "
        f"{_g(NVME_RAM_MARGIN)} kept for its buffers"
        if d["option"] == "auto"
        else f"nvme_offload={_opt(d['option'])}"
    )
    if d["read_gbps"] and d["write_gbps"]:
        s = d["state_on_disk"] / (d["read_gbps"] * 1e9) + d["state_on_disk"] / (d["write_gbps"] * 1e9)
        rates = f"read {d['read_gbps']:.3g} GB/s + write {d['write_gbps']:.3g} GB/s: {s * 1e3:.0f} ms of disk per step"
    else:
        rates = "the disk's rates unknown: its time is not in the step"
    room = (
        f", {_g(d['budget'])} of the disk's {_g(d['free'])} free allowed" if d["budget"] is not None else ""
    )
    return wl + [
        f"disk: {d['share']:.1%} of the host-updated optimizer state (master + moments, {_g(d['host_state'])}) "
        f"on disk{where}: {_g(d['state_on_disk'])}, {why}; RAM {_g(d['ram_saved'])} less; {rates}; "
        f"{d['state_on_disk'] / 1e9:.1f} GB written per step (SSD wear){room}"
    ]


def _opt(option) -> str:
    return repr(option) if isinstance(option, str) else f"{option:g}"


def error_lines(
    tried: list[dict], ram_budget: int, vram_budget: int | None = None
) -> tuple[list[str], dict | None]:
    """PlanError's disk line and arithmetic: of the candidates with optimizer state or frozen
    weights on disk (those whose VRAM fits `vram_budget` when any does), the one whose RAM fits with
    the fewest disk bytes, else the least-RAM one (nothing when no candidate had a disk). The line
    lists both parts, the weights' blocks and their sum."""
    disked = [c for c in tried if c.get("disk") or c.get("disk_weights")]
    if not disked:
        return [], None
    if vram_budget is not None:
        disked = [c for c in disked if sum(c["vram"].values()) <= vram_budget] or disked

    def total(c: dict) -> int:
        return (c["disk"]["state_on_disk"] if c.get("disk") else 0) + (
            c["disk_weights"]["bytes"] if c.get("disk_weights") else 0
        )

    fit = [c for c in disked if sum(c["ram"].values()) <= ram_budget]
    c = min(fit, key=total) if fit else min(disked, key=lambda c: sum(c["ram"].values()))
    d, w = c.get("disk"), c.get("disk_weights")
    some = d or w
    have = "unknown free space" if some["budget"] is None else (
        f"{_g(some['budget'])} allowed ({DISK_FREE_SHARE:.0%} of {_g(some['free'])} free)")  # fmt: skip
    parts = []
    if d:
        parts.append(
            f"{_g(d['state_on_disk'])} ({d['share']:.1%} of the host-updated optimizer state {_g(d['host_state'])})"
        )
    if w:
        from ..blocks import ranges_text

        parts.append(f"{_g(w['bytes'])} of frozen weights (blocks {ranges_text(w['blocks'])}, nvme_weights)")
    head = parts[0] if len(parts) == 1 else f"{_g(total(c))}: " + " + ".join(parts)
    line = f"  disk: needs {head} vs {have}" + ("" if fits(c) else ": too small")
    arith = {"optimizer_state": d["state_on_disk"] if d else 0, "weights": w["bytes"] if w else 0,
             "weight_blocks": list(w["blocks"]) if w else [], "total": total(c),
             "budget": some["budget"], "free": some["free"]}  # fmt: skip
    return [line], arith


def on_offload(ctx, c: dict, moment: str, option, host_memory) -> dict:
    """apply() on an offload candidate of plan.py (host_memory: plan._host_memory, passed in as
    this module does not import plan.py), then its step timed with the disk (timing.with_disk)."""
    mb = 2 if moment == "bfloat16" else 4
    ss, paged = set(c["streamed"]), c["ram"].get("paged_activations", 0)
    keep = 4 * sum(ctx.shape.blocks[i].trained_numel for i in ss) if ctx.wb == 4 else 0
    rows = [(host_memory(ctx, sp, moment, ss, paged)[0], state_bytes(sp["host"], mb), keep)
            for sp in (c.get("initial_split", c["split"]), c["split"])]  # fmt: skip
    # frozen weights first (read only: no write wear), then the optimizer state's share for the rest
    c, rows = _weights.apply(ctx, c, rows, ctx.disk.weights)
    return timed(apply(c, rows, ctx.ram, option, ctx.disk, mb))


def timed(c: dict) -> dict:
    """c with its bounds and select_s counting the disk's reads and writes (the state's, then the
    frozen weights' reads: timing.with_disk_reads)."""
    from .timing import step_of, with_disk, with_disk_reads

    d, w = c.get("disk"), c.get("disk_weights")
    if d is None and not w:
        return c
    bounds = c["bounds"]
    if d is not None:
        bounds = with_disk(bounds, d["state_on_disk"], d["read_gbps"], d["write_gbps"], d["bucket_state"])
    if w:
        bounds = with_disk_reads(bounds, w["read_per_step"], w["read_gbps"], w["largest"])
    return {**c, "bounds": bounds, "select_s": step_of(bounds)[0]}
