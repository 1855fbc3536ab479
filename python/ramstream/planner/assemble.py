"""Turns one chosen candidate of plan_training() into a Plan, and the text of its memory lines."""

from __future__ import annotations

from .disk import memory as disk_memory
from .result import Plan
from .timing import step_of

_GIB = 2**30


def _shares(split: dict, total: int) -> dict:
    return {k: split[k] / total for k in ("device", "mapped", "host")}


def _round(r: dict, total: int) -> dict:
    out = {"split": _shares(r, total), **r.get("refine_rates", {})}
    if r.get("host_trial"):
        out["host_trial"] = True
    return {**out, "reverted": True} if r.get("reverted") else out


def line(name: str, parts: dict, have: int, what: str) -> str:
    body = " + ".join(f"{k} {v / _GIB:.2f}" for k, v in parts.items() if v)
    need = sum(parts.values())
    return f"{name}: needs {need / _GIB:.2f} GiB ({body or 'nothing'}) vs {have / _GIB:.2f} GiB {what}"


def why_optimizer(c: dict, shape, m: str, moment: str) -> str:
    """The plan's optimizer line: the split of the trained parameters and the VRAM room behind it."""
    sp, n = c["split"], max(1, shape.trained_numel)
    return (
        f"optimizer: of {shape.trained_numel / 1e6:.1f}M trained params {sp['device'] / n:.0%} in VRAM (room "
        f"{max(0, c['room']) / _GIB:.2f} GiB = usable - peak {c['peak'] / _GIB:.2f} - margin 0.50), "
        f"{sp['mapped'] / n:.0%} updated by the GPU over PCIe, {sp['host'] / n:.0%} on the host; moments {m}"
        + (" (fp32 state does not fit in RAM)" if m == "bfloat16" and moment == "auto" else "")
    )


def make_plan(ctx, c: dict, mode: str, reasons: list[str]) -> Plan:
    sh = ctx.shape
    n = len(sh.blocks)
    step, bound = step_of(c["bounds"])
    vram = {**c["vram"], "total": sum(c["vram"].values()), "budget": ctx.budget}
    ram = {**c["ram"], "total": sum(c["ram"].values()), "budget": ctx.ram}
    pinned = {**c["pinned"], "total": sum(c["pinned"].values()), "budget": ctx.pin}
    if pinned["total"] > ctx.pin:
        reasons.append(
            f"pinned {pinned['total'] / _GIB:.2f} GiB > the page-lock budget {ctx.pin / _GIB:.2f} GiB per rank: "
            "the excess is ordinary memory and its copies are slower (raise RAMSTREAM_PIN_BUDGET)"
        )
    cut = max(c.get("split", {}).get("pin_cut", 0), c.get("initial_split", {}).get("pin_cut", 0))
    if cut:
        reasons.append(
            f"optimizer: {cut / 1e6:.1f}M parameters updated by the host instead of the GPU over PCIe: their "
            f"mapped state does not fit the page-lock budget {ctx.pin / _GIB:.2f} GiB per rank beside the "
            "landing buffers and streamed weights (the runtime keeps such buckets on the host; "
            "RAMSTREAM_PIN_BUDGET raises the budget)"
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
    split = c["split"]
    total = max(1, sum(split[k] for k in ("device", "mapped", "host")))
    memory = {"vram": vram, "ram": ram, "pinned": pinned}
    disk = disk_memory(c)
    if disk is not None:
        memory["disk"] = disk
    return Plan(
        mode=mode,
        weights={
            "resident": [i for i in range(n) if i not in set(c["streamed"])],
            "streamed": c["streamed"],
            # streamed blocks whose frozen weights are in nvme_dir's file (planner/disk_weights.py)
            "disk": list((c.get("disk_weights") or {}).get("blocks", [])),
        },  # fmt: skip
        activations=c["modes"],
        optimizer={
            "placement": placement,
            "vram_share": c["share"],
            "moment_dtype": c["moment"],
            # the split the run trains at once optimizer_mode="auto" has refined it (runtime/refiner.py
            # after steps 4 and 6, on the rates timing.refiner_rates predicts); the step is timed on it
            "split": _shares(split, total),
            "numel": {k: split[k] for k in ("device", "mapped", "host")},
            "initial_split": _shares(c.get("initial_split", split), total),  # after step 2
            "refinements": [_round(r, total) for r in c.get("refinements", [])],
            # the share of the host-updated state (master + moments) in nvme_dir's file (planner/disk.py)
            "nvme_share": c["disk"]["share"] if c.get("disk") else 0.0,
        },
        quantize=ctx.quant,
        memory=memory,
        predicted={"step_s": step, "tokens_per_s": sh.tokens / step if step > 0 else None, "bound": bound},
        bounds=c["bounds"],
        reasons=reasons,
        shape={
            "name": sh.name,
            "dtype": sh.dtype,
            "autocast": sh.autocast,
            "batch": sh.batch,
            "seq": sh.seq,
            "blocks": n,
            "trained_numel": sh.trained_numel,
            "frozen_numel": sh.frozen_numel,
        },  # fmt: skip
    )
