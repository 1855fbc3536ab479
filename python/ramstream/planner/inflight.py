"""The optimizer decisions taken while training, from what the run measured; pure arithmetic.

The runtime measures (runtime/optimizer_split.py after step 2, runtime/refiner.py over its
windows) and hands a record of numbers (planner/training.py) to planner/revise.py
revise_training(), which answers with the decide_* functions below; the runtime applies the answer
through the engine's mechanisms (engine/layout.py relocate, move_buckets) and returns the history
entry, which the session records (runtime/session.py TrainingSession). The same functions predict
those decisions in the plan (planner/policy.py): one rule, used twice.

The engine's buckets reach the planner as BucketFacts (runtime/measure.py bucket_facts): numbers
only, no tensors.

- choose_mapped_fraction: the share of the update the GPU does over PCIe ("mapped") where the host
  AdamW and PCIe finish together. Host share: per parameter the host streams the state through RAM
  and PCIe carries the gradient down and the new weight up (working dtype, each direction). Mapped
  share: the GPU kernel reads and writes the moments (and a low-precision model's fp32 master) over
  PCIe. With fraction f mapped the optimizer takes about max(host(1-f), pcie(f)); both are linear
  in f, so the best f is where they cross.
- resident_peak / resident_fits: offload="auto" after SWITCH_AFTER_STEPS: whether the whole state
  fits on the device (a resident run's peak from the offloaded run's measured memory).
- share_room / choose_placements: when it does not, the VRAM left under the cap holds part of it:
  the first buckets in forward order go "device", the rest split between "mapped" and "host".
- choose_refined / host_trial_fits: optimizer_mode="auto" refines that split from the rates the
  run achieved (runtime/refiner.py's module docstring has the schedule and the model)."""

from __future__ import annotations

from .rules import HOST_TRIAL_SHARE, MARGIN_BYTES, MAX_REFINEMENTS, MIN_GAIN
from .training import BucketFacts, Decision


def choose_mapped_fraction(
    *,
    numel: int,
    host_params_per_s: float,
    pcie_bytes_per_s: float,
    working_bytes: int,
    moment_bytes: int,
    master_on_host: bool,
) -> tuple[float, dict]:
    """The mapped fraction f in [0, 1] minimising max(host time, PCIe time), with the arithmetic."""
    host_pcie = working_bytes  # per direction, host share
    mapped_pcie = 2 * moment_bytes + (4 if master_on_host else 0)
    t_host_all = numel / host_params_per_s
    t_pcie = lambda f: numel * (f * mapped_pcie + (1 - f) * host_pcie) / pcie_bytes_per_s  # noqa: E731
    t_host = lambda f: (1 - f) * t_host_all  # noqa: E731
    # t_host(f) = t_pcie(f)  ->  f = (t_host_all - t_pcie(0)) / (t_host_all + t_pcie(1) - t_pcie(0))
    denom = t_host_all + t_pcie(1.0) - t_pcie(0.0)
    f = 0.0 if denom <= 0 else min(1.0, max(0.0, (t_host_all - t_pcie(0.0)) / denom))
    info = {
        "fraction": f,
        "host_params_per_s": host_params_per_s,
        "pcie_bytes_per_s": pcie_bytes_per_s,
        "pcie_bytes_per_param_host": host_pcie,
        "pcie_bytes_per_param_mapped": mapped_pcie,
        "t_host_only_s": t_host_all,
        "t_pcie_host_only_s": t_pcie(0.0),
        "t_estimate_s": max(t_host(f), t_pcie(f)),
    }
    return f, info


def resident_peak(now: int, persistent: int, grads: int, transient: int) -> int:
    """The device peak a resident run is expected to reach: the memory between steps + the
    persistent state + the larger of the offloaded run's transient (peak - allocated between
    steps: activations, gradients in flight) and the resident gradients + a quarter of the smaller
    (activations and gradients overlap part-way through backward)."""
    return now + persistent + max(transient, grads) + min(transient, grads) // 4


def resident_fits(
    *, usable: int, peak: int, now: int, persistent: int, grads: int, headroom: float
) -> tuple[bool, dict]:
    """Whether the resident switch fits: the predicted resident peak within usable x (1 -
    headroom). Returns (verdict, the numbers and the arithmetic as text)."""
    transient = max(0, peak - now)
    predicted = resident_peak(now, persistent, grads, transient)
    room = usable * (1 - headroom)
    g = 2**30
    text = (
        f"between steps {now / g:.2f} + state {persistent / g:.2f} + max(transient "
        f"{transient / g:.2f}, gradients {grads / g:.2f}) + 1/4 of the smaller = {predicted / g:.2f} GiB"
    )
    return predicted <= room, {"predicted_peak": predicted, "room": int(room), "text": text}


def share_room(*, usable: int, peak: int, headroom: float) -> int:
    """The VRAM bytes the optimizer state may take after a declined resident switch: usable x (1 -
    headroom) less the measured peak less MARGIN_BYTES (allocator slack, a larger last batch)."""
    return int(usable * (1 - headroom)) - int(peak) - MARGIN_BYTES


def choose_placements(buckets: list[BucketFacts], room: int, mapped_fraction_of) -> tuple[list[str], dict]:
    """Placements in bucket order: "device" for the first shareable buckets whose state fits in
    `room` bytes, then "mapped" for the first mapped_fraction_of(rest numel) of the remaining
    numel, "host" for the others (mapped_fraction_of None: the others keep their placement).
    Streamed buckets, those on disk and those without state keep their placement. Returns
    (placements, numbers)."""
    movable = [b for b in buckets if b.shareable]
    used, device_numel = 0, 0
    chosen: dict[int, str] = {}
    for b in movable:
        need = b.device_bytes
        if used + need > room:
            break
        used += need
        device_numel += b.numel
        chosen[b.index] = "device"
    rest = [b for b in movable if b.index not in chosen]
    rest_numel = sum(b.numel for b in rest)
    if mapped_fraction_of is None:  # the rest as placed
        mapped = sum(b.numel for b in rest if b.placement == "mapped")
        f = mapped / rest_numel if rest_numel else 0.0
    else:
        f = mapped_fraction_of(rest_numel) if rest_numel else 0.0
        mapped = 0
    for b in rest if mapped_fraction_of is not None else ():
        use_gpu = f > 0 and mapped + b.numel / 2 <= f * rest_numel
        chosen[b.index] = "mapped" if use_gpu else "host"
        mapped += b.numel if use_gpu else 0
    out = [chosen.get(b.index, b.placement) for b in buckets]
    info = {
        "device_numel": device_numel,
        "device_bytes": used,
        "mapped_numel": mapped,
        "host_numel": rest_numel - mapped,
        "mapped_fraction_of_rest": f,
    }
    return out, info


def refinable(b: BucketFacts) -> bool:
    """A bucket the refinement may move: shareable and on the host or mapped ("device" stays)."""
    return b.shareable and b.placement in ("host", "mapped")


def _times(buckets, placement_of, host_rate: float, pcie_rate: float) -> tuple[float, float]:
    """(host seconds, PCIe seconds) per step with placement_of(bucket) for every bucket."""
    host_numel, pcie = 0, 0
    for b in buckets:
        if not b.has_state:
            continue
        where = placement_of(b)
        if where == "host":
            host_numel += b.numel
            pcie += b.numel * b.working_bytes  # the gradient down (and the new weights up)
        elif where == "mapped":
            pcie += b.numel * b.mapped_pcie_bytes
    return host_numel / host_rate, pcie / pcie_rate


def choose_refined(
    buckets: list[BucketFacts],
    *,
    host_params_per_s: float,
    pcie_bytes_per_s: float,
    min_gain: float = MIN_GAIN,
) -> tuple[list[str], dict]:
    """Placements in bucket order from measured rates, and the arithmetic: the model of
    choose_mapped_fraction minimised over bucket boundaries instead of a continuous fraction. The
    refinable buckets in forward order: the first k mapped, the others on the host. For each k:
    host time = (host-updated elements, streamed buckets' included) / host rate; PCIe time =
    (mapped elements x their mapped bytes + host elements x their working bytes) / PCIe rate. The
    best k minimises max(host, PCIe); it is taken when the predicted optimizer time falls by more
    than min_gain (else every bucket keeps its placement: info["move"] False)."""
    movable = [b for b in buckets if refinable(b)]
    now = {b.index: b.placement for b in buckets}
    cur_host, cur_pcie = _times(buckets, lambda b: now[b.index], host_params_per_s, pcie_bytes_per_s)
    t_now = max(cur_host, cur_pcie)
    # every boundary k in one pass: the fixed part (streamed host buckets; "device" adds nothing),
    # then the movable buckets' elements on the host and their bytes each way, host and mapped
    fixed_host, fixed_pcie = _times([b for b in buckets if not refinable(b)], lambda b: b.placement, 1.0, 1.0)
    host_left = sum(b.numel for b in movable)
    pcie_left = sum(b.numel * b.working_bytes for b in movable)
    pcie_mapped = 0
    best = None
    for k in range(len(movable) + 1):
        if k:
            b = movable[k - 1]
            host_left -= b.numel
            pcie_left -= b.numel * b.working_bytes
            pcie_mapped += b.numel * b.mapped_pcie_bytes
        th = (fixed_host + host_left) / host_params_per_s
        tp = (fixed_pcie + pcie_left + pcie_mapped) / pcie_bytes_per_s
        if best is None or max(th, tp) < best[0] * (1 - 1e-12):
            best = (max(th, tp), k, th, tp)
    t_new, k, t_host, t_pcie = best
    move = t_now > 0 and t_new < (1.0 - min_gain) * t_now
    mapped = {b.index for b in movable[:k]} if move else set()
    out = [
        ("mapped" if b.index in mapped else "host") if move and refinable(b) else b.placement for b in buckets
    ]
    numel = {p: sum(b.numel for b, w in zip(buckets, out) if w == p and b.has_state)
             for p in ("device", "mapped", "host")}  # fmt: skip
    movable_numel = sum(b.numel for b in movable)
    info = {
        "host_params_per_s": host_params_per_s,
        "pcie_bytes_per_s": pcie_bytes_per_s,
        "predicted_host_s": cur_host,
        "predicted_pcie_s": cur_pcie,
        "predicted_s_before": t_now,
        "best_host_s": t_host,
        "best_pcie_s": t_pcie,
        "predicted_s_after": t_new if move else t_now,
        "gain": (1.0 - t_new / t_now) if t_now > 0 else 0.0,
        "min_gain": min_gain,
        "move": move,
        "mapped_fraction_of_movable": (
            sum(b.numel for b in movable[:k]) / movable_numel if movable_numel else 0.0
        ),
        "numel": numel,
    }
    return out, info


def host_trial_fits(
    buckets: list[BucketFacts], *, host_params_per_s: float, step_s: float
) -> tuple[bool, dict]:
    """Whether the host-only trial runs: some refinable bucket is mapped, and the host AdamW of every
    bucket it would update (streamed buckets' and the refinable ones), at host_params_per_s, takes
    at most HOST_TRIAL_SHARE of step_s."""
    mapped = sum(b.numel for b in buckets if refinable(b) and b.placement == "mapped")
    numel = sum(b.numel for b in buckets if b.has_state and (b.streamed or refinable(b)))
    host_all = numel / host_params_per_s if host_params_per_s > 0 else float("inf")
    fits = bool(mapped) and step_s > 0 and host_all <= HOST_TRIAL_SHARE * step_s
    return fits, {"mapped_numel": mapped, "host_all_s": host_all, "host_trial_share": HOST_TRIAL_SHARE}


def host_only(buckets: list[BucketFacts]) -> list[str]:
    """The host-only trial's placements: every refinable bucket on the host."""
    return ["host" if refinable(b) else b.placement for b in buckets]


# ---- the in-training decisions, from planner/training.py's records (revise_training) -------------
def decide_resident(m) -> Decision:
    """ResidentCheck -> "resident" (act: switch) or "keep offloading", with resident_fits' numbers."""
    fits, n = resident_fits(
        usable=m.usable, peak=m.peak, now=m.now, persistent=m.persistent_bytes, grads=m.grad_bytes,
        headroom=m.headroom,
    )  # fmt: skip
    return Decision(change="resident" if fits else "keep offloading", act=fits, numbers=n)


def decide_share(m) -> Decision:
    """ShareCheck -> "keep optimizer placement" when share_room leaves nothing (room_bytes 0), else
    "optimizer state share" with choose_placements' placements; the rest's mapped fraction is
    choose_mapped_fraction's (1 with gpu_only), solved for the first bucket's dtypes."""

    def mapped_fraction_of(numel: int) -> float:
        if m.gpu_only:
            return 1.0
        b = m.buckets[0]
        f, _ = choose_mapped_fraction(
            numel=numel, host_params_per_s=m.host_params_per_s, pcie_bytes_per_s=m.pcie_bytes_per_s,
            working_bytes=b.working_bytes, moment_bytes=m.moment_bytes, master_on_host=b.low_precision,
        )  # fmt: skip
        return f

    room = share_room(usable=m.usable, peak=m.peak, headroom=m.headroom)
    if room <= 0:
        return Decision(change="keep optimizer placement", numbers={"room_bytes": 0})
    placements, info = choose_placements(list(m.buckets), room, None if m.keep_rest else mapped_fraction_of)
    return Decision(
        change="optimizer state share", act=True, numbers={"room_bytes": room, **info},
        placements=tuple(placements),
    )  # fmt: skip


def window_rates(w) -> tuple[float, float, dict]:
    """(host params/s, PCIe bytes/s, sources) of a SplitWindow: each the window's own ratio where it
    measured any (host elements / seconds; mapped bytes / seconds), else the isolated rate."""
    src: dict = {}
    if w.host_numel > 0 and w.host_s > 0:
        host, src["host"] = w.host_numel / w.host_s, "measured"
    else:
        host, src["host"] = w.host_alone, "isolated"
    if w.mapped_bytes > 0 and w.mapped_s > 0:
        pcie, src["pcie"] = w.mapped_bytes / w.mapped_s, "measured"
    else:
        pcie, src["pcie"] = (w.pcie_alone if w.pcie_alone is not None else 0.0), "isolated"
    src.update(host_alone=w.host_alone, pcie_alone=w.pcie_alone)
    return host, pcie, src


def decide_window(w) -> Decision:
    """SplitWindow -> in order (runtime/refiner.py's module docstring):
    - the host-only trial's window: "host-only trial kept" when its step was not slower than the
      step before it, else "host-only trial undone" (placements: those before it); settles;
    - a window after a move whose step got more than MIN_GAIN slower: "optimizer split reverted"
      (placements: those before the move); settles;
    - else choose_refined on the window's rates (window_rates): "optimizer split refined" (act,
      placements) or "keep optimizer split" (no rate to refine with: numbers["reason"]); again: a
      move gets one more window while fewer than MAX_REFINEMENTS decisions were taken."""
    step_s = w.step_s
    if w.trial:
        keep = step_s <= w.step_s_before
        return Decision(
            change="host-only trial kept" if keep else "host-only trial undone", act=not keep,
            numbers={"step_s": step_s, "step_s_before": w.step_s_before},
            placements=() if keep else tuple(w.placements_before), settle=True,
        )  # fmt: skip
    if w.step_s_before is not None and step_s > w.step_s_before * (1 + MIN_GAIN):
        return Decision(
            change="optimizer split reverted", act=True,
            numbers={"step_s": step_s, "step_s_before": w.step_s_before},
            placements=tuple(w.placements_before), settle=True,
        )  # fmt: skip
    host, pcie, src = window_rates(w)
    n = w.steps
    numbers = {
        "rate_sources": src,
        "host_s_per_step": w.host_s / n,
        "mapped_s_per_step": w.mapped_s / n,
        "mapped_bytes_per_step": w.mapped_bytes // n,
        "throttle_s_per_step": w.throttle_s / n,
        "step_s": step_s,
    }
    again = w.refinement < MAX_REFINEMENTS
    if host <= 0 or pcie <= 0:
        return Decision(
            change="keep optimizer split", numbers={**numbers, "reason": "no rate to refine with"}
        )
    targets, info = choose_refined(list(w.buckets), host_params_per_s=host, pcie_bytes_per_s=pcie)
    move = info["move"]
    return Decision(
        change="optimizer split refined" if move else "keep optimizer split", act=move,
        numbers={**numbers, **info}, placements=tuple(targets) if move else (), again=again,
    )  # fmt: skip


def decide_host_trial(m) -> Decision:
    """HostTrialCheck -> act when host_trial_fits (at the window's host rate and step), placements
    host_only's."""
    host, _, _ = window_rates(m.window)
    buckets = list(m.buckets)
    fits, info = host_trial_fits(buckets, host_params_per_s=host, step_s=m.window.step_s)
    return Decision(
        change="optimizer split host-only trial", act=fits, numbers=info,
        placements=tuple(host_only(buckets)) if fits else (),
    )  # fmt: skip
