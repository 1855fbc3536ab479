"""Planner arithmetic as pure functions: how many blocks' activations to page, from measurements.

No torch, no I/O: wrap() measures (step time, per-block activation bytes, copy bandwidth) and calls
these; tests inject the numbers. Every function returns the arithmetic behind its answer so it can
go into memory_report(model)["events"].

Copy-time model for paging blocks 0..k-1 (each block's saved bytes b_i go out in forward on the D2H
stream and come back in backward on the H2D stream):

    copy_s(k)  = sum_{i<k} b_i / (d2h_gbps * 1e9) + b_i / (h2d_gbps * 1e9)
    hidden_s   = min(compute_overlap * copy_s(k), unpaged_step_s)   # copies hide behind compute,
                                                                    # never more than the step
    added_s(k) = copy_s(k) - hidden_s
    slowdown(k) = added_s(k) / unpaged_step_s
"""

from __future__ import annotations

import math

from ..blocks import fraction_to_blocks  # moved to the leaf blocks.py; still importable here

__all__ = ["choose_paged_blocks", "fraction_to_blocks", "copy_seconds", "estimate_overlap"]


def _number(
    name: str, value, *, lo: float | None = None, hi: float | None = None, lo_open: bool = False, where: str
) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"{where}: {name} must be a finite number, got {value!r}")
    v = float(value)
    if lo is not None and (v <= lo if lo_open else v < lo):
        raise ValueError(f"{where}: {name} must be {'>' if lo_open else '>='} {lo}, got {value!r}")
    if hi is not None and v > hi:
        raise ValueError(f"{where}: {name} must be <= {hi}, got {value!r}")
    return v


def copy_seconds(nbytes: int, d2h_gbps: float, h2d_gbps: float) -> float:
    """Seconds to copy `nbytes` to the host and back at the given bandwidths (GB/s, 1e9 bytes/s)."""
    return nbytes / (d2h_gbps * 1e9) + nbytes / (h2d_gbps * 1e9)


def _added(copy_s: float, unpaged_step_s: float, overlap: float) -> float:
    return copy_s - min(overlap * copy_s, unpaged_step_s)


def choose_paged_blocks(
    block_bytes: list[int],
    *,
    unpaged_step_s: float,
    d2h_gbps: float,
    h2d_gbps: float,
    compute_overlap: float,
    max_slowdown: float,
    must_free_bytes: int = 0,
) -> tuple[list[int], dict]:
    """Which blocks page their activations, chosen from the front of the stack.

    Front blocks go first: their activations wait longest between forward and backward, so their
    copies have the most compute to hide behind. Pages the largest k whose estimated slowdown
    (module docstring) is <= max_slowdown; when freeing ``must_free_bytes`` of device memory needs
    more blocks than that (the run would not fit otherwise), pages as many as that needs and reports
    the expected slowdown. Paging all blocks when even that does not free enough; ``info["fits"]``
    is then False.

    Args:
        block_bytes: saved-activation bytes of each block for one step (ints >= 0), forward order.
        unpaged_step_s: measured step time without activation paging (> 0).
        d2h_gbps, h2d_gbps: measured copy bandwidths in GB/s (> 0).
        compute_overlap: fraction of the copy time hidden behind compute, in [0, 1]
            (see estimate_overlap()).
        max_slowdown: the accepted slowdown as a fraction of unpaged_step_s (>= 0, e.g. 0.15).
        must_free_bytes: device bytes that must be freed to fit (>= 0; 0 = it fits unpaged).

    Returns (indices, info): the sorted block indices, and the arithmetic: ``copy_s_per_block``,
    ``budget_s``, ``k_within_slowdown``, ``k_to_fit``, ``paged_bytes``, ``copy_s``, ``added_s``,
    ``expected_slowdown``, ``fits``, ``reason`` (one line for the event log).
    """
    where = "choose_paged_blocks"
    if isinstance(block_bytes, (str, bytes)) or not hasattr(block_bytes, "__iter__"):
        raise ValueError(f"{where}: block_bytes must be a list of ints >= 0, got {block_bytes!r}")
    sizes = list(block_bytes)
    for b in sizes:
        if isinstance(b, bool) or not isinstance(b, int) or b < 0:
            raise ValueError(f"{where}: block_bytes must hold ints >= 0, got {b!r}")
    step = _number("unpaged_step_s", unpaged_step_s, lo=0.0, lo_open=True, where=where)
    d2h = _number("d2h_gbps", d2h_gbps, lo=0.0, lo_open=True, where=where)
    h2d = _number("h2d_gbps", h2d_gbps, lo=0.0, lo_open=True, where=where)
    overlap = _number("compute_overlap", compute_overlap, lo=0.0, hi=1.0, where=where)
    max_sd = _number("max_slowdown", max_slowdown, lo=0.0, where=where)
    if isinstance(must_free_bytes, bool) or not isinstance(must_free_bytes, int) or must_free_bytes < 0:
        raise ValueError(f"{where}: must_free_bytes must be an int >= 0, got {must_free_bytes!r}")

    per_block = [copy_seconds(b, d2h, h2d) for b in sizes]
    n = len(sizes)
    budget = max_sd * step
    # added_s(k) is non-decreasing in k: walk from the front while within the budget
    k_time, copy_s = 0, 0.0
    for i in range(n):
        if _added(copy_s + per_block[i], step, overlap) > budget * (1 + 1e-12):
            break
        copy_s += per_block[i]
        k_time = i + 1
    k_fit, freed = 0, 0
    fits = True
    if must_free_bytes > 0:
        k_fit = n
        for i in range(n):
            freed += sizes[i]
            if freed >= must_free_bytes:
                k_fit = i + 1
                break
        else:
            fits = False
    k = max(k_time, k_fit)
    copy_s = sum(per_block[:k])
    added = _added(copy_s, step, overlap)
    paged_bytes = sum(sizes[:k])
    slowdown = added / step
    if not fits:
        reason = (
            f"paging all {n} blocks frees {paged_bytes / 2**30:.2f} GiB < the "
            f"{must_free_bytes / 2**30:.2f} GiB needed to fit; expected slowdown "
            f"{slowdown:.1%}"
        )
    elif k_fit > k_time:
        reason = (
            f"paging {k} of {n} blocks to free {must_free_bytes / 2**30:.2f} GiB (needed to "
            f"fit); expected slowdown {slowdown:.1%} > max {max_sd:.1%}"
        )
    else:
        reason = (
            f"paging {k} of {n} blocks ({paged_bytes / 2**30:.2f} GiB): expected slowdown "
            f"{slowdown:.1%} <= max {max_sd:.1%} (copies {copy_s * 1e3:.1f} ms, "
            f"{overlap:.0%} hidden behind a {step * 1e3:.1f} ms step)"
        )
    info = {
        "n_blocks": n,
        "block_bytes": sizes,
        "copy_s_per_block": per_block,
        "unpaged_step_s": step,
        "d2h_gbps": d2h,
        "h2d_gbps": h2d,
        "compute_overlap": overlap,
        "max_slowdown": max_sd,
        "budget_s": budget,
        "must_free_bytes": must_free_bytes,
        "k_within_slowdown": k_time,
        "k_to_fit": k_fit,
        "paged_bytes": paged_bytes,
        "copy_s": copy_s,
        "added_s": added,
        "expected_slowdown": slowdown,
        "fits": fits,
        "reason": reason,
    }
    return list(range(k)), info


def estimate_overlap(unpaged_step_s: float, paged_step_s: float, copy_s: float) -> float:
    """The fraction of `copy_s` seconds of copies that a measured paged step hid behind compute:
    1 - (paged_step_s - unpaged_step_s) / copy_s, clipped to [0, 1] (1.0 when copy_s == 0)."""
    where = "estimate_overlap"
    a = _number("unpaged_step_s", unpaged_step_s, lo=0.0, lo_open=True, where=where)
    b = _number("paged_step_s", paged_step_s, lo=0.0, lo_open=True, where=where)
    c = _number("copy_s", copy_s, lo=0.0, where=where)
    if c == 0.0:
        return 1.0
    return min(1.0, max(0.0, 1.0 - (b - a) / c))
