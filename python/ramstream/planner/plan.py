"""plan_training(): where the weights, activations and optimizer state of a ModelShape live on a
HardwareProfile, and how long a step takes; pure arithmetic (no torch, no device work).

Rule (a), the one offload="auto" follows: when stock training fits in usable VRAM (free VRAM less
vram_headroom) with every activation kept, i.e. weights + gradients (working dtype) + AdamW state
(fp32 moments, and an fp32 master when the working dtype is 16-bit) + activations + logits, the
plan is "resident": everything on the GPU, torch's fused AdamW.

Otherwise "offload": the optimizer state lives in host RAM (optionally a share of the trained
parameters keeps its whole state in VRAM, sized to the VRAM left over); weights are resident or
the fewest blocks are streamed, from the front of the stack as wrap() streams them; per block the
activations are kept, paged (from the front: choose_paged_blocks) or recomputed. Every number of streamed blocks is tried and the
fitting plan with the shortest predicted step wins (fewer streamed blocks on a tie).

Step-time model (seconds; rates from the profile):
    gpu_compute_s = step flops / (matmul_tflops x MATMUL_EFFICIENCY) + AdamW on the GPU
    PCIe: D2H carries gradients of host-updated parameters and paged activations; H2D the updated
      weights, streamed weights twice (forward and backward) and paged activations. While both
      directions carry data each runs at duplex_gbps; the longer one's rest at its own rate.
    host_adamw_s  = host-updated params x 28 B (20 B with bf16 moments) / adamw_gbps
    exposed_s     = what cannot overlap: the embeddings' and block 0's gradients arrive last in
      backward and their weights are needed first in the next forward (their D2H + host AdamW +
      H2D), plus block 0's first fetch when it is streamed
    step_s        = max(gpu_compute_s, h2d_s, d2h_s, host_adamw_s) + exposed_s
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from .activations import choose_paged_blocks, fraction_to_blocks
from .measure import ADAMW_STATE_BYTES
from .profile import HardwareProfile
from .result import Plan, PlanError
from .shape import ModelShape
from .suggest import suggestions

MATMUL_EFFICIENCY = 0.5  # share of the profile's matmul peak a training step reaches
DEVICE_ADAMW_GBPS = 2000.0  # torch's fused AdamW on the GPU: state traffic in GB/s (HBM bound)
ACT_OVERLAP = 0.9  # share of activation copies hidden behind compute, until measured
GRAD_INFLIGHT_MAX = 1 << 30  # gradients crossing PCIe at once: min(1 GiB, VRAM / 10), as the engine
STREAM_WINDOW = 3  # streamed blocks on the GPU at once: the one running and weight_window=2 ahead
FROZEN_BASE_SHARE = 0.1  # blocks with less trained share than this are a frozen base (LoRA)
QUANT_BYTES = {"none": None, "int8": 1 + 4 / 64, "nf4": 0.5 + 4 / 64}  # bytes per quantized value
_GIB = 2**30


# ---- the pieces of one candidate plan ----------------------------------------------------------


@dataclass
class _Ctx:
    shape: ModelShape
    prof: HardwareProfile
    budget: int
    ram: int
    pin: int
    quant: str
    opt_mode: str
    act_opt: object
    max_slowdown: float
    inflight_cap: int

    @property
    def wb(self) -> int:
        return self.shape.elem_bytes

    def weight(self, part) -> int:
        q = QUANT_BYTES[self.quant]
        if q is None or not part.frozen_matrix_numel:
            return part.weight_bytes
        return int(
            part.weight_bytes - part.frozen_matrix_numel * self.wb + math.ceil(part.frozen_matrix_numel * q)
        )

    def flop_rate(self) -> float | None:
        t = self.prof.matmul_tflops
        return t * 1e12 * MATMUL_EFFICIENCY if t else None


def _master(wb: int) -> int:
    return 4 if wb < 4 else 0


def _pcie(ctx: _Ctx, up: float, down: float) -> tuple[float, float]:
    """(h2d_s, d2h_s) for the bytes each way (module docstring)."""
    p = ctx.prof
    both = min(up, down)
    t_both = both / (p.duplex_gbps * 1e9) if both else 0.0
    up_s = (up - both) / (p.h2d_gbps * 1e9) if up > both else 0.0
    down_s = (down - both) / (p.d2h_gbps * 1e9) if down > both else 0.0
    return t_both + up_s, t_both + down_s


def _times(ctx: _Ctx, streamed, paged_bytes: int, recompute, moment: str, share: float) -> dict:
    sh, wb, p = ctx.shape, ctx.wb, ctx.prof
    T, rate = sh.tokens, ctx.flop_rate()
    flops = sum((q.fwd_flops_per_token + q.bwd_flops_per_token) * T for q in sh.parts)
    flops += sum(sh.blocks[i].fwd_flops_per_token * T for i in recompute)
    n_tr = sh.trained_numel
    n_dev = share * n_tr
    state = ADAMW_STATE_BYTES[moment]
    compute = (flops / rate if rate else 0.0) + n_dev * state / (DEVICE_ADAMW_GBPS * 1e9)
    mapped = ctx.opt_mode == "gpu"
    n_host = 0.0 if mapped else n_tr - n_dev
    n_map = n_tr - n_dev if mapped else 0.0
    mb = 2 if moment == "bfloat16" else 4
    streamed_tr = sum(sh.blocks[i].trained_numel for i in streamed)
    streamed_w = sum(ctx.weight(sh.blocks[i]) for i in streamed)
    map_bytes = n_map * (2 * mb + _master(wb))
    down = n_host * wb + paged_bytes + map_bytes
    up = max(0.0, n_host - streamed_tr * (1 - share)) * wb + 2 * streamed_w + paged_bytes + map_bytes
    h2d, d2h = _pcie(ctx, up, down)
    host = n_host * state / (p.adamw_gbps * 1e9) if n_host else 0.0
    tail = (sh.embed.trained_numel + sh.blocks[0].trained_numel) * (1 - share) if sh.blocks else 0
    exposed = 0.0
    if tail and not mapped:
        exposed = (
            tail * wb / (p.d2h_gbps * 1e9)
            + tail * state / (p.adamw_gbps * 1e9)
            + tail * wb / (p.h2d_gbps * 1e9)
        )
    if 0 in streamed:
        exposed += ctx.weight(sh.blocks[0]) / (p.h2d_gbps * 1e9)
    bounds = {
        "gpu_compute_s": compute,
        "h2d_s": h2d,
        "d2h_s": d2h,
        "host_adamw_s": host,
        "exposed_s": exposed,
    }
    return bounds


def _step(bounds: dict) -> tuple[float, str]:
    overl = {k: bounds[k] for k in ("gpu_compute_s", "h2d_s", "d2h_s", "host_adamw_s")}
    bound = max(overl, key=overl.get)
    return overl[bound] + bounds["exposed_s"], bound[:-2]


def _activations(ctx: _Ctx, avail: int, step0: float, t0: dict) -> tuple[list[str], int, int, str]:
    """(modes per block, device bytes of the activations, paged bytes, reason) within `avail`
    device bytes; the device bytes exceed avail when nothing fits."""
    sh = ctx.shape
    n = len(sh.blocks)
    acts = [sh.act_bytes(i) for i in range(n)]
    bnd = [sh.boundary_bytes(i) for i in range(n)]
    rate = ctx.flop_rate()

    def cost(modes):
        """Device bytes, paged bytes of `modes` (transients: two paged blocks in flight, one
        recomputed block rebuilt)."""
        pg = [acts[i] for i in range(n) if modes[i] == "page"]
        rc = [acts[i] for i in range(n) if modes[i] == "recompute"]
        dev = sum(acts[i] for i in range(n) if modes[i] == "keep") + sum(
            bnd[i] for i in range(n) if modes[i] == "recompute"
        )
        dev += 2 * max(pg, default=0) + max(rc, default=0)
        return dev, sum(pg)

    opt = ctx.act_opt
    if opt is True or isinstance(opt, float):
        idx = range(n) if opt is True else fraction_to_blocks(opt, n)
        modes = ["page" if i in set(idx) else "keep" for i in range(n)]
        dev, pg = cost(modes)
        return modes, dev, pg, f"activation_offload={opt!r}: paging {len(list(idx))} of {n} blocks"
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
    frozen = sum(b.trained_numel for b in sh.blocks) < FROZEN_BASE_SHARE * sum(
        b.trained_numel + b.frozen_numel for b in sh.blocks
    )
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


def _offload(ctx: _Ctx, streamed: list[int], moment: str) -> dict:
    """One offload candidate: memory per component, activations, times, whether it fits."""
    sh, wb = ctx.shape, ctx.wb
    n = len(sh.blocks)
    ss = set(streamed)
    vram = {
        "weights": ctx.weight(sh.embed)
        + ctx.weight(sh.head)
        + sum(ctx.weight(sh.blocks[i]) for i in range(n) if i not in ss),
        "stream_window": min(len(ss), STREAM_WINDOW) * max((ctx.weight(sh.blocks[i]) for i in ss), default=0),
        "gradients_in_flight": min(sh.trained_numel * wb, ctx.inflight_cap),
        "logits": sh.logits_bytes,
        "outside_activations": sh.outside_act_bytes,
    }
    t0 = _times(ctx, streamed, 0, [], moment, 0.0)
    step0, _ = _step(t0)
    modes, act_dev, paged, act_why = _activations(ctx, ctx.budget - sum(vram.values()), step0, t0)
    vram["activations"] = act_dev
    mb = 2 if moment == "bfloat16" else 4
    share = 0.0
    per_param = wb + _master(wb) + 2 * mb
    left = ctx.budget - sum(vram.values())
    if ctx.opt_mode == "auto" and sh.trained_numel and left > 0:
        share = math.floor(min(1.0, left / (sh.trained_numel * per_param)) * 100) / 100
    vram["optimizer_share"] = int(share * sh.trained_numel * per_param)
    n_off = sh.trained_numel * (1 - share)
    mapped = ctx.opt_mode == "gpu"
    streamed_w = sum(ctx.weight(sh.blocks[i]) for i in ss)
    ram = {
        "optimizer_state": int(n_off * (4 + 2 * mb)) if not mapped else int(n_off * (_master(wb) + 2 * mb)),
        "gradient_landing": int(n_off * wb) if not mapped else 0,
        "streamed_weights": streamed_w,
        "paged_activations": paged,
    }
    pinned = {
        "gradient_landing": ram["gradient_landing"],
        "streamed_weights": streamed_w,
        "paged_activations": paged,
        "mapped_state": ram["optimizer_state"] if mapped else 0,
    }
    rc = [i for i in range(n) if modes[i] == "recompute"]
    bounds = _times(ctx, streamed, paged, rc, moment, share)
    # candidates are compared without the VRAM share: streaming blocks to make room for
    # optimizer state would trade PCIe time for host time the share only estimates
    select_s = _step(_times(ctx, streamed, paged, rc, moment, 0.0))[0]
    return dict(select_s=select_s, vram=vram, ram=ram, pinned=pinned, modes=modes, share=share, bounds=bounds, act_why=act_why,
                streamed=sorted(ss), moment=moment)  # fmt: skip


def _fits(ctx: _Ctx, c: dict) -> tuple[bool, bool]:
    return sum(c["vram"].values()) <= ctx.budget, sum(c["ram"].values()) <= ctx.ram


def _resident(ctx: _Ctx, moment: str) -> dict:
    """Stock training on the GPU: every weight, gradient, AdamW state and activation in VRAM."""
    sh, wb = ctx.shape, ctx.wb
    mb = 2 if moment == "bfloat16" else 4
    n = len(sh.blocks)
    vram = {
        "weights": sum(ctx.weight(q) for q in sh.parts),
        "gradients": sh.trained_numel * wb,
        "optimizer_state": sh.trained_numel * (2 * mb + _master(wb)),
        "activations": sum(sh.act_bytes(i) for i in range(n)),
        "logits": sh.logits_bytes,
        "outside_activations": sh.outside_act_bytes,
    }
    bounds = _times(ctx, [], 0, [], moment, 1.0)
    return dict(
        vram=vram, ram={}, pinned={}, modes=["keep"] * n, share=1.0, bounds=bounds, streamed=[], moment=moment
    )


def _parse_param_offload(v, n: int) -> list[int] | None:
    """None for "auto", else the streamed block indices, as wrap() reads the option (a fraction
    streams the front of the stack)."""
    from ..activations.blocks import chosen_blocks, parse_block_choice

    choice = parse_block_choice("param_offload", v)
    return None if choice == "auto" else chosen_blocks("param_offload", choice, n)


def _make_plan(ctx: _Ctx, c: dict, mode: str, reasons: list[str]) -> Plan:
    sh = ctx.shape
    n = len(sh.blocks)
    step, bound = _step(c["bounds"])
    vram = {**c["vram"], "total": sum(c["vram"].values()), "budget": ctx.budget}
    ram = {**c["ram"], "total": sum(c["ram"].values()), "budget": ctx.ram}
    pinned = {**c["pinned"], "total": sum(c["pinned"].values()), "budget": ctx.pin}
    if pinned["total"] > ctx.pin:
        reasons.append(
            f"pinned {pinned['total'] / _GIB:.2f} GiB > the page-lock budget {ctx.pin / _GIB:.2f} GiB per rank: "
            "the excess is ordinary memory and its copies are slower (raise RAMSTREAM_PIN_BUDGET)"
        )
    placement = (
        "device"
        if mode == "resident"
        else "host"
        if mode == "cpu"
        else ("mapped" if ctx.opt_mode == "gpu" else "host")
    )
    if ctx.prof.matmul_tflops is None:
        reasons.append("no GPU matmul rate in the profile: gpu_compute_s counts only the optimizer")
    return Plan(
        mode=mode,
        weights={"resident": [i for i in range(n) if i not in set(c["streamed"])], "streamed": c["streamed"]},
        activations=c["modes"],
        optimizer={"placement": placement, "vram_share": c["share"], "moment_dtype": c["moment"]},
        quantize=ctx.quant,
        memory={"vram": vram, "ram": ram, "pinned": pinned},
        predicted={"step_s": step, "tokens_per_s": sh.tokens / step if step > 0 else None, "bound": bound},
        bounds=c["bounds"],
        reasons=reasons,
        shape={
            "name": sh.name,
            "dtype": sh.dtype,
            "batch": sh.batch,
            "seq": sh.seq,
            "blocks": n,
            "trained_numel": sh.trained_numel,
            "frozen_numel": sh.frozen_numel,
        },  # fmt: skip
    )


def _line(name: str, parts: dict, have: int, what: str) -> str:
    body = " + ".join(f"{k} {v / _GIB:.2f}" for k, v in parts.items() if v)
    need = sum(parts.values())
    return f"{name}: needs {need / _GIB:.2f} GiB ({body or 'nothing'}) vs {have / _GIB:.2f} GiB {what}"


def plan_training(
    shape: ModelShape,
    profile: HardwareProfile,
    *,
    param_offload="auto",
    activation_offload="auto",
    optimizer_mode: str = "auto",
    moment_dtype="auto",
    quantize: str = "none",
    vram_headroom: float = 0.10,
    max_activation_slowdown: float = 0.15,
    _suggest: bool = True,
) -> Plan:
    """The plan for training `shape` on `profile` (module docstring); pure arithmetic, thread-safe.

    Args:
        param_offload: "auto" (the fewest streamed blocks that give the shortest step), True (all
            blocks streamed), False (none; PlanError when that cannot fit), a fraction in [0, 1]
            (that share of the blocks, from the front, as wrap()) or a list of block indices.
        activation_offload: "auto" (keep, page or recompute per block), True (page every block),
            False (keep every block), or a fraction in [0, 1] (page that share, from the front).
        optimizer_mode: "auto" (resident when it fits, else host with a VRAM share), "cpu" (host
            AdamW, no VRAM share) or "gpu" (ramstream's CUDA AdamW on state in pinned host memory).
        moment_dtype: "auto" (fp32 unless host RAM forces bf16), "float32"/"fp32", "bfloat16"/"bf16".
        quantize: "none", "int8" or "nf4": how frozen block weight matrices are stored.
        vram_headroom: share of free VRAM left unused, in [0, 1).
        max_activation_slowdown: the step slowdown activation paging may cost (>= 0).

    Returns a Plan. Raises PlanError (a MemoryError) with the arithmetic per component and the
    options that would fit, ValueError / TypeError for a bad argument.
    """
    from ..options import parse_activation_offload, parse_mode, parse_moment_dtype

    if not isinstance(shape, ModelShape):
        raise TypeError(f"plan_training: shape must be a ModelShape, got {type(shape).__name__}")
    if not isinstance(profile, HardwareProfile):
        raise TypeError(f"plan_training: profile must be a HardwareProfile, got {type(profile).__name__}")
    n = len(shape.blocks)
    where = "plan_training:"
    forced = _parse_param_offload(param_offload, n)
    act = parse_activation_offload(activation_offload)
    mode = parse_mode(optimizer_mode, where=f"{where} optimizer_mode")
    moment = parse_moment_dtype(moment_dtype, where=where)
    if quantize not in QUANT_BYTES:
        raise ValueError(f"{where} quantize={quantize!r} is not accepted; accepted: 'none', 'int8', 'nf4'")
    for name, v, hi in (
        ("vram_headroom", vram_headroom, 1.0),
        ("max_activation_slowdown", max_activation_slowdown, None),
    ):
        if (
            isinstance(v, bool)
            or not isinstance(v, (int, float))
            or not math.isfinite(v)
            or v < 0
            or (hi and v >= hi)
        ):
            raise ValueError(
                f"{where} {name}={v!r} is not accepted; accepted: a number in [0, {hi or 'inf'})"
            )
    p = profile
    rates = ("h2d_gbps", "d2h_gbps", "duplex_gbps", "adamw_gbps") if p.vram_total else ()
    for name in rates:
        v = getattr(p, name)
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v <= 0:
            raise ValueError(
                f"{where} profile.{name}={v!r} is not accepted; accepted: a finite number > 0 (GB/s)"
            )
    budget = int(p.vram_free * (1 - vram_headroom))
    ctx = _Ctx(shape, p, budget, p.ram_per_rank, p.pin_per_rank, quantize, mode, act, float(max_activation_slowdown),
               min(GRAD_INFLIGHT_MAX, p.vram_total // 10))  # fmt: skip
    moments = ["float32", "bfloat16"] if moment == "auto" else [moment]
    head = [
        f"usable VRAM {budget / _GIB:.2f} GiB = free {p.vram_free / _GIB:.2f} GiB x (1 - headroom {vram_headroom:g}); "
        f"RAM {ctx.ram / _GIB:.2f} GiB per rank ({p.local_world_size} on this machine)"
    ]
    if not p.vram_total:  # the CPU engine: everything in host RAM
        for m in moments:
            c = _resident(ctx, m)
            c["ram"], c["vram"] = c["vram"], {}
            if sum(c["ram"].values()) <= ctx.ram:
                return _make_plan(
                    ctx, c, "cpu", head + [_line("no GPU: RAM", c["ram"], ctx.ram, "available")]
                )
        raise PlanError(
            f"plan_training: {shape.name} does not fit in host RAM: "
            + _line("RAM", c["ram"], ctx.ram, "available"),
            arithmetic={"ram": {**c["ram"], "budget": ctx.ram}},
            options=[],
        )
    # (a) resident: stock training fits
    if mode == "auto" and forced in (None, []) and act in ("auto", False) and p.vram_total:
        for m in moments:
            c = _resident(ctx, m)
            if sum(c["vram"].values()) <= budget:
                why = _line("resident: stock training fits, VRAM", c["vram"], budget, "usable")
                return _make_plan(ctx, c, "resident", head + [why])
    # (b) offload: every number of streamed blocks (or the given ones), each moment dtype
    sets = [forced] if forced is not None else [list(range(k)) for k in range(n + 1)]
    tried = []
    for m in moments:
        best = None
        for st in sets:
            c = _offload(ctx, st, m)
            tried.append(c)
            v_ok, r_ok = _fits(ctx, c)
            if v_ok and r_ok:
                step = c["select_s"]
                if best is None or step < best[0] * (1 - 1e-3):
                    best = (step, c)
        if best is not None:
            c = best[1]
            reasons = head + [
                _line("VRAM", c["vram"], budget, "usable"),
                _line("RAM", c["ram"], ctx.ram, "available"),
                f"weights: {len(c['streamed'])} of {n} blocks streamed (from the front of the stack, as wrap())"
                + (f", param_offload={param_offload!r}" if forced is not None else ""),
                c["act_why"],
                f"optimizer: host AdamW on {1 - c['share']:.0%} of {shape.trained_numel / 1e6:.1f}M trained params, "
                f"{c['share']:.0%} in VRAM; moments {m}"
                + (" (fp32 state does not fit in RAM)" if m == "bfloat16" and moment == "auto" else ""),
            ]
            return _make_plan(ctx, c, "offload", reasons)
    # (d) nothing fits
    lo_v = min(tried, key=lambda c: sum(c["vram"].values()))
    lo_r = min(tried, key=lambda c: sum(c["ram"].values()))
    arithmetic = {"vram": {**lo_v["vram"], "budget": budget}, "ram": {**lo_r["ram"], "budget": ctx.ram}}
    lines = [
        f"plan_training: {shape.name} ({shape.dtype}, batch {shape.batch} x seq {shape.seq}) does not fit",
        "  " + _line("VRAM (least-VRAM plan)", lo_v["vram"], budget, f"usable (free {p.vram_free / _GIB:.2f} GiB less {vram_headroom:.0%})"),
        "  " + _line("RAM (least-RAM plan)", lo_r["ram"], ctx.ram, "available per rank"),
    ]  # fmt: skip
    options = suggestions(shape, profile, param_offload, activation_offload, optimizer_mode, moment, quantize,
                           vram_headroom, max_activation_slowdown) if _suggest else []  # fmt: skip
    lines.append(
        "  would fit: "
        + ("; ".join(options) if options else "none of bf16 moments, int8/nf4, a smaller batch or seq")
    )
    raise PlanError("\n".join(lines), arithmetic=arithmetic, options=options)
