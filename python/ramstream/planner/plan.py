"""plan_training(): where the weights, activations and optimizer state of a ModelShape live on a
HardwareProfile, and how long a step takes; pure arithmetic (no device work). It follows wrap()'s
default policy (policy.py) and predicts the step with timing.py's model.

- Blocks recompute when activation_checkpointing="auto" would (policy.auto_recompute); otherwise
  per block the activations are kept, paged (from the front: choose_paged_blocks) or recomputed
  to fit, as activation_offload="auto" would.
- param_offload="auto" streams the fewest front blocks that wrap() streams (policy.auto_streamed);
  when that plan cannot fit, every number of streamed blocks is tried and the fitting plan with
  the shortest predicted step is shown, with the option that gives it.
- The offloaded run's peak: the larger of the forward's (resident weights, the stream window,
  kept activations or the blocks' inputs, autocast's weight copies, the logits) and the
  backward's (the same without the copies and logits, with the gradients in flight).
- offload="auto" (optimizer_mode "auto"): resident, torch's fused AdamW, when the resident peak
  estimated from it (policy.resident_peak) fits in usable VRAM (free x (1 - vram_headroom)); wrap()
  then lays the state out in VRAM from the start (runtime/optimizer_split.py state_starts_on_device);
  else the optimizer state of the first parameters that fits in usable - peak - 512 MiB lives in
  VRAM ("device"), the rest is split between the GPU over PCIe ("mapped") and the host threads
  (policy.optimizer_split); the step is timed at the split the measured refinement after steps 4
  and 6 settles on (policy.refinement_rounds, _settle).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from . import delayed_split, policy
from . import disk as _disk
from .act_modes import choose_modes
from .assemble import line as _line
from .assemble import make_plan as _make_plan
from .assemble import why_optimizer
from .host_fit import cap_mapped_to_pin, plan_step_buffers
from .host_fit import master_bytes as _master
from .host_fit import moment_bytes as _mb
from .host_fit import offload_host_memory as _host_memory
from .inflight import resident_peak
from .measure import ADAMW_STATE_BYTES
from .policy import auto_recompute, auto_streamed, optimizer_split
from .profile import HardwareProfile
from .result import Plan, PlanError
from .rules import MARGIN_BYTES
from .shape import ModelShape
from .suggest import NOTHING_FITS, suggestions
from .timing import MATMUL_EFFICIENCY, step_of, step_times

STREAM_WINDOW = 3  # streamed blocks on the GPU at once: the one running and weight_window=2 ahead
QUANT_BYTES = {"none": None, "int8": 1 + 4 / 64, "nf4": 0.5 + 4 / 64}  # bytes per quantized value
_GIB = 2**30
__all__ = ["plan_training", "MATMUL_EFFICIENCY"]


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
    recompute: tuple = ()
    recompute_auto: bool = False  # ctx.recompute from activation_checkpointing="auto"'s rule
    refine: bool = True  # time the split optimizer_mode="auto" settles on (False: step 2's)
    disk: object = None  # disk.Disk: nvme_offload and the profile's disk
    accumulate: bool = False  # accumulation_steps > 1: the fp32 accumulator counts (host_fit.py)
    delayed: bool = False  # delayed_update: its buffers count (host_fit.py)

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


def _times(ctx: _Ctx, streamed, paged_bytes: int, modes, moment: str, split: dict) -> dict:
    wb, mb = ctx.wb, _mb(moment)
    return step_times(ctx.shape, ctx.prof, ctx.weight, streamed=streamed, modes=modes, paged_bytes=paged_bytes,
                      split=split, state_bytes=ADAMW_STATE_BYTES[moment],
                      mapped_bytes_per_param=2 * mb + _master(wb), delayed=ctx.delayed)  # fmt: skip


def _host_split(ctx: _Ctx) -> dict:
    n = ctx.shape.trained_numel
    if ctx.opt_mode == "gpu":
        return {"device": 0, "mapped": n, "host": 0}
    return {"device": 0, "mapped": 0, "host": n}


def _offload(ctx: _Ctx, streamed: list[int], moment: str) -> dict:
    """One offload candidate: memory per component, activations, the optimizer split, times."""
    sh, wb = ctx.shape, ctx.wb
    n = len(sh.blocks)
    ss = set(streamed)
    base = {
        "weights": ctx.weight(sh.embed)
        + ctx.weight(sh.head)
        + sum(ctx.weight(sh.blocks[i]) for i in range(n) if i not in ss),
        "stream_window": min(len(ss), STREAM_WINDOW) * max((ctx.weight(sh.blocks[i]) for i in ss), default=0),
        "outside_activations": sh.outside_act_bytes,
    }
    fwd_only = {
        "autocast_cache": sh.autocast_cache_bytes_without(ss | set(ctx.recompute)),
        "logits": sh.logits_bytes,
    }
    inflight = min(sh.trained_numel * wb, ctx.inflight_cap)
    acts = [sh.act_bytes(i) for i in range(n)]
    bnd = [sh.boundary_bytes(i) for i in range(n)]
    rc = set(ctx.recompute)
    if rc and not (ctx.act_opt is True or isinstance(ctx.act_opt, float)):
        modes = ["recompute" if i in rc else "keep" for i in range(n)]
        act_dev = sum(bnd[i] if i in rc else acts[i] for i in range(n)) + max(
            (acts[i] for i in rc), default=0
        )
        paged = 0
        act_why = f"activation_checkpointing: {len(rc)} of {n} blocks recompute"
    else:
        t0 = _times(ctx, streamed, 0, ["keep"] * n, moment, _host_split(ctx))
        avail = ctx.budget - sum(base.values()) - max(sum(fwd_only.values()), inflight)
        modes, act_dev, paged, act_why = choose_modes(ctx, avail, step_of(t0)[0], t0)
    fwd = sum(fwd_only.values())
    vram = {**base, "activations": act_dev}
    vram.update(fwd_only if fwd >= inflight else {"gradients_in_flight": inflight})
    peak = sum(vram.values())
    mb = _mb(moment)
    room = ctx.budget - peak - MARGIN_BYTES
    streamed_tr = sum(sh.blocks[i].trained_numel for i in ss)
    split = optimizer_split(trained=sh.trained_numel, streamed_trained=streamed_tr, room=room, mode=ctx.opt_mode,
                            wb=wb, mb=mb, prof=ctx.prof)  # fmt: skip
    split = cap_mapped_to_pin(ctx, split, moment, ss, paged)
    if ctx.delayed and ctx.opt_mode == "auto" and split["mapped"] + split["host"] > streamed_tr:
        split = delayed_split.choose(split, streamed_tr,
                                     lambda sp: step_of(_times(ctx, streamed, paged, modes, moment, sp))[0],
                                     lambda sp: cap_mapped_to_pin(ctx, sp, moment, ss, paged))  # fmt: skip
    share = split["device"] / sh.trained_numel if sh.trained_numel else 0.0
    vram["optimizer_share"] = split["device"] * split["device_bytes_per_param"]
    settled, bounds, rounds = _settle(ctx, streamed, paged, modes, moment, split, streamed_tr)
    # host memory for the largest of the first steps' split (the device share still on the host
    # until vram_share moves it after step 2: wrap()'s host_fit check counts it), the step-2 split
    # and the settled one (a refinement moves state)
    waits = "mapped" if ctx.delayed else "host"  # delayed: wrap() maps it (runtime/delayed_split.py)
    first = {**split, "device": 0, waits: split[waits] + split["device"]}
    ram, pinned = max((_host_memory(ctx, sp, moment, ss, paged) for sp in (first, split, settled)),
                      key=lambda rp: sum(rp[0].values()))  # fmt: skip
    return dict(select_s=step_of(bounds)[0], vram=vram, ram=ram, pinned=pinned, modes=modes, share=share,
                bounds=bounds, act_why=act_why, streamed=sorted(ss), moment=moment, split=settled, peak=peak,
                room=room, initial_split=split, refinements=rounds)  # fmt: skip


def _settle(ctx: _Ctx, streamed, paged: int, modes, moment: str, split: dict, streamed_tr: int):
    """(the split the run trains at, its step bounds, the refinement rounds): optimizer_mode="auto"
    re-solves the host / mapped split after steps 4 and 6 (policy.refinement_rounds); runtime/refiner.py
    undoes the first move when the steps after it took more than MIN_GAIN longer (here: their
    predicted steps), and then settles."""
    from .policy import host_trial, refinement_rounds
    from .rules import MAX_REFINEMENTS, MIN_GAIN

    bounds = _times(ctx, streamed, paged, modes, moment, split)
    if not ctx.refine or ctx.opt_mode != "auto" or not (split["mapped"] or split["host"] > streamed_tr):
        return split, bounds, []
    kw = dict(streamed_trained=streamed_tr, wb=ctx.wb, mb=_mb(moment), state_bytes=ADAMW_STATE_BYTES[moment],
              prof=ctx.prof)  # fmt: skip
    ss = set(streamed)
    rounds = [cap_mapped_to_pin(ctx, r, moment, ss, paged) for r in refinement_rounds(split, **kw)]
    now, t_now = split, bounds
    if rounds:
        first = _times(ctx, streamed, paged, modes, moment, rounds[0])
        if step_of(first)[0] > step_of(bounds)[0] * (1 + MIN_GAIN):
            return split, bounds, [{**rounds[0], "reverted": True}]
        now = rounds[-1]
        t_now = first if len(rounds) == 1 else _times(ctx, streamed, paged, modes, moment, now)
    if len(rounds) < MAX_REFINEMENTS:  # the last refinement kept its split: the refiner's host-only trial
        trial = host_trial(now, step_s=step_of(t_now)[0], **kw)
        if trial is not None:
            t_trial = _times(ctx, streamed, paged, modes, moment, trial)
            kept = step_of(t_trial)[0] <= step_of(t_now)[0]
            rounds = rounds + [trial if kept else {**trial, "reverted": True}]
            if kept:
                now, t_now = trial, t_trial
    return now, t_now, rounds


def _fits(ctx: _Ctx, c: dict) -> tuple[bool, bool, bool]:
    return sum(c["vram"].values()) <= ctx.budget, sum(c["ram"].values()) <= ctx.ram, _disk.fits(c)


def _resident(ctx: _Ctx, off: dict) -> dict:
    """The resident run after the switch, from the offloaded candidate `off` without streaming:
    weights, moments (and fp32 masters) and gradients on the GPU (policy.resident_peak)."""
    sh, wb = ctx.shape, ctx.wb
    moment = off["moment"]
    now = off["vram"]["weights"]
    persistent = sh.trained_numel * (2 * _mb(moment) + _master(wb))
    grads = sh.trained_numel * (wb + _master(wb))
    transient = max(0, off["peak"] - now)
    vram = {
        "weights": now,
        "optimizer_state": persistent,
        "gradients": grads if grads >= transient else grads // 4,
        "activations": transient if transient > grads else transient // 4,
    }
    assert sum(vram.values()) == resident_peak(now, persistent, grads, transient)
    split = {"device": sh.trained_numel, "mapped": 0, "host": 0}
    bounds = _times(ctx, [], 0, off["modes"], moment, split)
    return dict(vram=vram, ram={}, pinned={}, modes=off["modes"], share=1.0, bounds=bounds, streamed=[],
                moment=moment, split=split)  # fmt: skip


def _parse_param_offload(v, n: int) -> list[int] | None:
    """None for "auto", else the streamed block indices, as wrap() reads the option (a fraction
    streams the front of the stack)."""
    from ..blocks import chosen_blocks
    from ..options import parse_block_choice

    choice = parse_block_choice("param_offload", v)
    return None if choice == "auto" else chosen_blocks("param_offload", choice, n)


def plan_training(
    shape: ModelShape,
    profile: HardwareProfile,
    *,
    param_offload="auto", activation_offload="auto", activation_checkpointing="auto",
    optimizer_mode: str = "auto", moment_dtype="auto", quantize: str = "none",
    vram_headroom: float = 0.10, max_activation_slowdown: float = 0.15,
    nvme_offload="auto", nvme_weights="auto", accumulation_steps: int = 1, delayed_update=False,
    _suggest: bool = True, _refine: bool = True, _assume_disk: bool = False, _disk_applied=None,
) -> Plan:  # fmt: skip
    """The plan wrap() would follow for `shape` on `profile` (module docstring); pure arithmetic,
    thread-safe.

    Args:
        param_offload: "auto" (the blocks wrap() streams), True (all blocks streamed), False (none;
            PlanError when that cannot fit), a fraction in [0, 1] (that share of the blocks, from
            the front, as wrap()) or a list of block indices.
        activation_offload: "auto" (keep, page or recompute per block), True (page every block),
            False (keep every block), or a fraction in [0, 1] (page that share, from the front).
        activation_checkpointing: "auto" (wrap()'s rule), True, False, a fraction or block indices.
        optimizer_mode: "auto" (resident when it fits, else VRAM share, mapped and host), "cpu" (host
            AdamW, no VRAM share) or "gpu" (ramstream's CUDA AdamW on state in pinned host memory).
        moment_dtype: "auto" (fp32 unless host RAM forces bf16), "float32"/"fp32", "bfloat16"/"bf16".
        quantize: "none", "int8" or "nf4": how frozen block weight matrices are stored.
        vram_headroom: share of free VRAM left unused, in [0, 1).
        max_activation_slowdown: the step slowdown activation paging may cost (>= 0).
        nvme_offload: "auto" (when the plan does not fit in RAM and the profile knows a disk:
            the smallest share of the host-updated optimizer state on disk that fits, disk.py),
            True (all of it), False (none) or a share in [0, 1]; plan.optimizer["nvme_share"].
        nvme_weights: "auto" (when the plan does not fit in RAM and the profile knows a disk: the
            fewest streamed blocks' frozen weights on disk, from the back, before any optimizer
            state: disk_weights.py), True (every streamed block's), False, an int k (the last k
            streamed blocks) or block indices; plan.weights["disk"].
        accumulation_steps, delayed_update: wrap()'s (options.py); the host buffers they add (the
            fp32 accumulator, delayed_update's pending weights and second landing) count in RAM.

    Private: _assume_disk=True plans with an unbounded disk (suggest.py); _disk_applied=(on disk,
    placed) a running wrap()'s frozen weights between steps, only other blocks may go to disk
    (disk_weights.py); _refine=False times the split after step 2, not the refined one (the H200
    rows of tests/test_planner_h200.py).

    activation_checkpointing="auto" also makes every block recompute when the plan without it
    cannot fit (whatever the rule in policy.auto_recompute said).

    Returns a Plan. Raises PlanError (a MemoryError) with the arithmetic per component and the
    options that would fit, ValueError / TypeError for a bad argument.
    """
    if not isinstance(profile, HardwareProfile):
        raise TypeError(f"plan_training: profile must be a HardwareProfile, got {type(profile).__name__}")
    kw = dict(param_offload=param_offload, activation_offload=activation_offload,
              activation_checkpointing=activation_checkpointing, optimizer_mode=optimizer_mode,
              moment_dtype=moment_dtype, quantize=quantize, vram_headroom=vram_headroom,
              max_activation_slowdown=max_activation_slowdown, nvme_offload=nvme_offload, _refine=_refine,
              nvme_weights=nvme_weights, accumulation_steps=accumulation_steps, delayed_update=delayed_update,
              _assume_disk=_assume_disk, _disk_applied=_disk_applied)  # fmt: skip
    auto = isinstance(activation_checkpointing, str) and activation_checkpointing == "auto"
    if not auto or not profile.vram_total:
        return _plan_training(shape, profile, _suggest=_suggest, **kw)
    try:
        return _plan_training(shape, profile, _suggest=False, **kw)
    except PlanError:
        pass
    plan = _plan_training(shape, profile, _suggest=_suggest, **{**kw, "activation_checkpointing": True})
    plan.reasons.append(
        "activation_checkpointing=auto: every block recomputes, as the plan without it does not fit"
    )
    return plan


_OPTIONS = ("param_offload", "activation_offload", "activation_checkpointing", "optimizer_mode", "moment_dtype",
            "quantize", "vram_headroom", "max_activation_slowdown", "nvme_offload", "nvme_weights",
            "accumulation_steps", "delayed_update")  # fmt: skip


def _plan_training(
    shape: ModelShape, profile: HardwareProfile, *, _suggest: bool, _refine: bool, _assume_disk: bool,
    _disk_applied=None, **opts,
) -> Plan:  # fmt: skip
    """plan_training without the recompute fallback (opts: every name of _OPTIONS)."""
    (param_offload, activation_offload, activation_checkpointing, optimizer_mode, moment_dtype, quantize,
     vram_headroom, max_activation_slowdown, nvme_offload, nvme_weights, accumulation_steps,
     delayed_update) = (opts[k] for k in _OPTIONS)  # fmt: skip
    from ..blocks import chosen_blocks
    from ..options import parse_accumulation_steps as parse_accum
    from ..options import parse_activation_offload, parse_block_choice, parse_mode, parse_moment_dtype
    from ..options import parse_delayed_update as parse_delayed

    if not isinstance(shape, ModelShape):
        raise TypeError(f"plan_training: shape must be a ModelShape, got {type(shape).__name__}")
    if not isinstance(profile, HardwareProfile):
        raise TypeError(f"plan_training: profile must be a HardwareProfile, got {type(profile).__name__}")
    n = len(shape.blocks)
    where = "plan_training:"
    forced = _parse_param_offload(param_offload, n)
    act = parse_activation_offload(activation_offload)
    ckpt = parse_block_choice("activation_checkpointing", activation_checkpointing)
    mode = parse_mode(optimizer_mode, where=f"{where} optimizer_mode")
    delayed = parse_delayed(delayed_update, where) is not None
    if delayed and mode == "gpu":
        raise ValueError(f"{where} delayed_update needs the host AdamW: optimizer_mode 'auto' or 'cpu'")
    # delayed_update: no resident plan (no switch); "auto" keeps its GPU shares, not delayed (engine/delayed.py)
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
    for name in ("vram_total", "vram_free", "ram_total", "ram_available", "pin_budget"):
        v = getattr(p, name)
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0:
            raise ValueError(
                f"{where} profile.{name}={v!r} is not accepted; accepted: a finite number of bytes >= 0"
            )
    t = p.matmul_tflops
    if t is not None and (
        isinstance(t, bool) or not isinstance(t, (int, float)) or not math.isfinite(t) or t < 0
    ):
        raise ValueError(
            f"{where} profile.matmul_tflops={t!r} is not accepted; accepted: None or a finite number >= 0 (TFLOP/s)"
        )
    lws = p.local_world_size
    if isinstance(lws, bool) or not isinstance(lws, int) or lws < 1:
        raise ValueError(f"{where} profile.local_world_size={lws!r} is not accepted; accepted: an int >= 1")
    rates = ("h2d_gbps", "d2h_gbps", "duplex_gbps", "adamw_gbps") if p.vram_total else ()
    for name in rates:
        v = getattr(p, name)
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v <= 0:
            raise ValueError(
                f"{where} profile.{name}={v!r} is not accepted; accepted: a finite number > 0 (GB/s)"
            )
    budget = int(p.vram_free * (1 - vram_headroom))
    ctx = _Ctx(shape, p, budget, p.ram_per_rank, p.pin_per_rank, quantize, mode, act, float(max_activation_slowdown),
               policy.grad_inflight_bytes(p), refine=bool(_refine),
               disk=_disk.tier(p, nvme_offload, where, _assume_disk, nvme_weights, _disk_applied),
               accumulate=parse_accum(accumulation_steps, where) > 1,
               delayed=delayed)  # fmt: skip
    moments = ["float32", "bfloat16"] if moment == "auto" else [moment]
    head = [
        f"usable VRAM {budget / _GIB:.2f} GiB = free {p.vram_free / _GIB:.2f} GiB x (1 - headroom {vram_headroom:g}); "
        f"RAM {ctx.ram / _GIB:.2f} GiB per rank ({p.local_world_size} on this machine)"
    ]
    if not p.vram_total:  # the CPU engine: everything in host RAM
        return _cpu_plan(ctx, shape, moments, head)
    if ckpt == "auto":
        on, why = auto_recompute(shape, p.vram_free, ctx.weight, mode)
        ctx.recompute, ctx.recompute_auto = (tuple(range(n)) if on else ()), True
        said = "every block recomputes" if on else "off"
        if on and (act is True or isinstance(act, float)):  # paged whole instead (act_modes.py)
            said = "no recompute: activation_offload pages the blocks instead of the rule's recompute"
        head.append(f"activation_checkpointing=auto: {said} ({why})")
    else:
        ctx.recompute = tuple(chosen_blocks("activation_checkpointing", ckpt, n))
    k_auto = None
    if forced is None:
        every = bool(shape.blocks) and len(ctx.recompute) == n
        k_auto, room = auto_streamed(shape, p.vram_free, vram_headroom, ctx.weight, every)
        head.append(
            f"param_offload=auto: {k_auto} of {n} blocks streamed (resident weights <= {room / _GIB:.2f} GiB)"
        )
    # (a) resident: the offloaded run's peak predicts a resident one that fits
    if mode == "auto" and not delayed and forced in (None, []) and not k_auto and act in ("auto", False):
        # the moment dtype is wrap()'s (planner/host_fit.py pick_moment_dtype: by host RAM), kept by the switch
        fit = [m for m in moments if shape.trained_numel * (4 + 2 * _mb(m) + ctx.wb) <= ctx.ram]
        for m in fit[:1]:
            off = _offload(ctx, [], m)
            # bf16 chosen only for host RAM: on the device the moments are fp32 again (resident.py)
            final = "float32" if moment == "auto" else m
            c = _resident(ctx, {**off, "moment": final})
            if sum(c["vram"].values()) <= budget and _fits(ctx, off)[0]:
                why = _line("resident: the resident peak", c["vram"], budget, "usable")
                up = [f"state in VRAM from wrap() on, moments {final} (with the CUDA kernels; else on the host "
                      f"until the switch, moments {m})"]  # fmt: skip
                return _make_plan(ctx, c, "resident", head + [why, off["act_why"]] + up)
    # (b) offload: wrap()'s streamed blocks (or the given ones); when they cannot fit, the best of all
    first = [forced] if forced is not None else [list(range(k_auto))]
    rest = [] if forced is not None else [list(range(k)) for k in range(n + 1) if k != k_auto]
    tried, seen = [], {}  # seen: each candidate without the disk, computed once for every disk pass
    for sets, nv in ((s, o) for o in _disk.passes(ctx.disk) for s in (first, rest)):
        for m in _disk.moment_order(moments, nv):
            best = None
            for st in sets:
                off = seen[(tuple(st), m)] = seen.get((tuple(st), m)) or _offload(ctx, st, m)
                c = _disk.on_offload(ctx, off, m, nv, _host_memory)
                tried.append(c)
                if all(_fits(ctx, c)) and (best is None or c["select_s"] < best["select_s"] * (1 - 1e-3)):
                    best = c
            if best is not None:
                c = best
                note = "" if sets is first else (
                    f" (wrap()'s rule streams {k_auto}, which does not fit: pass param_offload={len(c['streamed'])}/{n})"
                )  # fmt: skip
                reasons = head + [
                    _line("VRAM", c["vram"], budget, "usable"),
                    _line("RAM", c["ram"], ctx.ram, "available"),
                    f"weights: {len(c['streamed'])} of {n} blocks streamed (from the front of the stack, as wrap())"
                    + (f", param_offload={param_offload!r}" if forced is not None else "")
                    + note,
                    c["act_why"],
                    why_optimizer(c, shape, m, moment),
                    *_disk.reasons(ctx, c),
                ]
                return _make_plan(ctx, c, "offload", reasons)
    # (d) nothing fits
    lo_v = min(tried, key=lambda c: sum(c["vram"].values()))
    lo_r = min([c for c in tried if _disk.fits(c)] or tried, key=lambda c: sum(c["ram"].values()))
    arithmetic = {"vram": {**lo_v["vram"], "budget": budget}, "ram": {**lo_r["ram"], "budget": ctx.ram}}
    disk_lines, disk = _disk.error_lines(tried, ctx.ram, budget)
    arithmetic.update({"disk": disk} if disk else {})
    lines = [
        f"plan_training: {shape.name} ({shape.dtype}, batch {shape.batch} x seq {shape.seq}) does not fit",
        "  " + _line("VRAM (least-VRAM plan)", lo_v["vram"], budget, f"usable (free {p.vram_free / _GIB:.2f} GiB less {vram_headroom:.0%})"),
        "  " + _line("RAM (least-RAM plan)", lo_r["ram"], ctx.ram, "available per rank"),
    ] + disk_lines  # fmt: skip
    options = suggestions(shape, profile, param_offload, activation_offload, optimizer_mode, moment, quantize,
                           vram_headroom, max_activation_slowdown, nvme_offload, plan_fn=plan_training,
                          fixed=dict(accumulation_steps=accumulation_steps, delayed_update=delayed_update)) if _suggest else []  # fmt: skip
    if _suggest:  # without it nothing was tried: no line rather than a wrong "none"
        lines.append("  would fit: " + ("; ".join(options) if options else NOTHING_FITS))
    raise PlanError("\n".join(lines), arithmetic=arithmetic, options=options)


def _cpu_plan(ctx: _Ctx, shape: ModelShape, moments: list[str], head: list[str]) -> Plan:
    """No GPU: the CPU engine keeps everything in host RAM (stock training's bytes)."""
    sh, wb = shape, ctx.wb
    n = len(sh.blocks)
    for nv, m in ((o, m) for o in _disk.passes(ctx.disk) for m in _disk.moment_order(moments, o)):
        ram = {
            "weights": sum(ctx.weight(q) for q in sh.parts),
            "gradients": sh.trained_numel * wb,
            "optimizer_state": sh.trained_numel * (2 * _mb(m) + _master(wb)),
            **plan_step_buffers(ctx, sh.trained_numel),
            "activations": sum(sh.act_bytes(i) for i in range(n)),
            "logits": sh.logits_bytes,
            "outside_activations": sh.outside_act_bytes,
        }
        split = {"device": 0, "mapped": 0, "host": sh.trained_numel}
        c = dict(vram={}, ram=ram, pinned={}, modes=["keep"] * n, share=0.0, streamed=[], moment=m, split=split,
                 bounds=_times(ctx, [], 0, ["keep"] * n, m, split))  # fmt: skip
        rows = [(ram, ram["optimizer_state"], 0)]
        c = _disk.timed(_disk.apply(c, rows, ctx.ram, nv, ctx.disk, _mb(m)))
        if sum(c["ram"].values()) <= ctx.ram and _disk.fits(c):
            why = _line("no GPU: RAM", c["ram"], ctx.ram, "available")
            return _make_plan(ctx, c, "cpu", head + [why] + _disk.reasons(ctx, c))
    disk_lines, disk = _disk.error_lines([c], ctx.ram)
    raise PlanError(
        f"plan_training: {shape.name} does not fit in host RAM: "
        + "\n".join([_line("RAM", c["ram"], ctx.ram, "available")] + disk_lines),
        arithmetic={"ram": {**c["ram"], "budget": ctx.ram}, **({"disk": disk} if disk else {})},
        options=[],
    )
