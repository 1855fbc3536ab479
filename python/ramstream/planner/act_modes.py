"""Per block, whether the plan keeps, pages or recomputes its saved activations within the device
bytes left for them (plan.py's candidates call choose_modes); pure arithmetic."""

from __future__ import annotations

from .activations import choose_paged_blocks, fraction_to_blocks
from .shape import lora_like
from .timing import ACT_OVERLAP

_GIB = 2**30


def choose_modes(ctx, avail: int, step0: float, t0: dict) -> tuple[list[str], int, int, str]:
    """(modes per block, device bytes of the activations, paged bytes, reason) within `avail`
    device bytes; the device bytes exceed avail when nothing fits."""
    sh = ctx.shape
    n = len(sh.blocks)
    acts = [sh.act_bytes(i) for i in range(n)]
    bnd = [sh.boundary_bytes(i) for i in range(n)]
    rate = ctx.flop_rate()

    def cost(modes, paged_inputs=frozenset()):
        """Device bytes, paged bytes of `modes` (transients: two paged blocks in flight, one
        recomputed block rebuilt); paged_inputs: recomputed blocks whose checkpointed input (their
        boundary) is paged instead of kept."""
        pg = [acts[i] for i in range(n) if modes[i] == "page"] + [bnd[i] for i in paged_inputs]
        rc = [acts[i] for i in range(n) if modes[i] == "recompute"]
        dev = sum(acts[i] for i in range(n) if modes[i] == "keep") + sum(
            bnd[i] for i in range(n) if modes[i] == "recompute" and i not in paged_inputs
        )
        dev += 2 * max(pg, default=0) + max(rc, default=0)
        return dev, sum(pg)

    opt = ctx.act_opt
    if opt is True or isinstance(opt, float):
        # a block that also recomputes pages only its checkpointed input, as the runtime does
        # (activations/: the saved tensors of a recomputed block are its input alone); recompute
        # asked for, not activation_checkpointing="auto"'s rule, which paging replaces (wrap()
        # applies "auto" from these modes: the blocks paged whole recompute nothing)
        idx = set(range(n) if opt is True else fraction_to_blocks(opt, n))
        rc = set() if ctx.recompute_auto else set(ctx.recompute)
        both = idx & rc
        modes = ["recompute" if i in rc else "page" if i in idx else "keep" for i in range(n)]
        dev, pg = cost(modes, frozenset(both))
        why = f"activation_offload={opt!r}: paging {len(idx)} of {n} blocks"
        if both:
            why += f" ({len(both)} of them recompute: only their checkpointed inputs, {pg / _GIB:.2f} GiB, are paged)"
        return modes, dev, pg, why
    keep = ["keep"] * n
    dev, _ = cost(keep)
    if dev <= avail or opt is False or n == 0:
        why = "every block's activations kept" + ("" if dev <= avail else " (activation_offload=False)")
        return keep, dev, 0, f"{why}: {dev / _GIB:.2f} GiB of {max(avail, 0) / _GIB:.2f} GiB left for them"
    step = max(step0, 1e-9)
    idle_up = max(0.0, step - t0["h2d_s"]) / step
    idle_down = max(0.0, step - t0["d2h_s"]) / step
    d2h = max(ctx.prof.d2h_gbps * idle_down, 1e-6)
    h2d = max(ctx.prof.h2d_gbps * idle_up, 1e-6)
    _, info = choose_paged_blocks(
        acts,
        unpaged_step_s=step,
        d2h_gbps=d2h,
        h2d_gbps=h2d,
        compute_overlap=ACT_OVERLAP,
        max_slowdown=ctx.max_slowdown,
    )
    k_free = info["k_within_slowdown"]
    frozen = lora_like(sh)
    pre_a = [0]
    for x in acts:
        pre_a.append(pre_a[-1] + x)
    options = []
    for k_page in sorted({0, k_free} | (set() if frozen else set(range(k_free, n + 1)))):
        # pages [0, k_page), recomputes [k_page, k_page + j), keeps the rest: the smallest j that fits
        max_pg = max(acts[:k_page], default=0)
        rc_bnd, max_rc, fit_j = 0, 0, None
        for j in range(0, n - k_page + 1):
            if j:
                i = k_page + j - 1
                rc_bnd, max_rc = rc_bnd + bnd[i], max(max_rc, acts[i])
            dev = (pre_a[n] - pre_a[k_page + j]) + rc_bnd + 2 * max_pg + max_rc
            if dev <= avail:
                fit_j = j
                break
        if fit_j is None:
            continue
        modes = ["page"] * k_page + ["recompute"] * fit_j + ["keep"] * (n - k_page - fit_j)
        copy_s = sum(info["copy_s_per_block"][:k_page])
        added = copy_s - min(ACT_OVERLAP * copy_s, step)
        rc = range(k_page, k_page + fit_j)
        added += sum(sh.blocks[i].fwd_flops_per_token * sh.tokens for i in rc) / rate if rate else 0.0
        options.append((added, k_page, modes, dev, pre_a[k_page]))
    if not options:  # the least device memory, for the error's arithmetic
        modes = min((["recompute"] * n, ["page"] * n), key=lambda m: cost(m)[0])
        dev, pg = cost(modes)
        return (
            modes,
            dev,
            pg,
            f"activations need {dev / _GIB:.2f} GiB at least, {max(avail, 0) / _GIB:.2f} GiB left",
        )
    added, k_page, modes, dev, pg = min(options, key=lambda o: (o[0], o[1]))
    n_rc = modes.count("recompute")
    why = (
        f"activations: {k_page} blocks paged (PCIe idle {min(idle_up, idle_down):.0%} of the step), {n_rc} recomputed"
        f"{' (frozen base: recompute beyond the free paging)' if frozen else ''}, {n - k_page - n_rc} kept: "
        f"{dev / _GIB:.2f} GiB of {avail / _GIB:.2f} GiB, about +{added * 1e3:.1f} ms"
    )
    return modes, dev, pg, why
