"""Plan and PlanError: what plan_training() returns or raises (see plan.py for the model)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

_GIB = 2**30


class PlanError(MemoryError):
    """Nothing fits. ``arithmetic``: the per-component numbers; ``options``: what would fit."""

    def __init__(self, message: str, *, arithmetic: dict, options: list[str]) -> None:
        super().__init__(message)
        self.arithmetic, self.options = arithmetic, options


@dataclass
class Plan:
    """What lives where and the predicted step (see the module docstring); to_dict() is JSON-able."""

    mode: str  # "resident", "offload" or "cpu"
    weights: dict  # {"resident": [block indices], "streamed": [block indices], "disk": [streamed blocks
    #                whose frozen weights are on disk (nvme_weights)]}
    activations: list  # per block: "keep", "page" or "recompute"
    optimizer: dict  # {"placement": "device" | "host" | "mapped", "vram_share", "moment_dtype",
    #                  "split": shares {"device", "mapped", "host"} the run settles on (after the
    #                  refinement of runtime/refiner.py), "numel": the same in params, "initial_split":
    #                  the shares after step 2, "refinements": per move {"split", "host_params_per_s",
    #                  "pcie_bytes_per_s"(, "reverted")}, the last one {"split", "host_trial":
    #                  True(, "reverted")} when the refiner's host-only trial runs}
    quantize: str
    memory: dict  # {"vram": {component: bytes, ..., "total", "budget"}, "ram": {...}, "pinned": {...}}, and
    #               with state or weights on disk "disk": {"optimizer_state", "weights", "total", "budget"
    #               (None: unknown), "free", "ram_saved", "written_per_step", "read_per_step",
    #               "weights_read_per_step"} (planner/disk.py, disk_weights.py)
    predicted: dict  # {"step_s", "tokens_per_s", "bound"}
    bounds: dict  # seconds per resource: gpu_compute_s, h2d_s, d2h_s, host_adamw_s, mapped_update_s;
    #               exposed_s (the step beyond the largest of those), gpu_lane_s, host_lane_s,
    #               weight_stream_s, stream_stall_s, optimizer_pcie_s, issue_exposed_s,
    #               activation_copy_s (planner/timing.py); disk_s with state on disk
    reasons: list = field(default_factory=list)
    shape: dict = field(default_factory=dict)

    def to_dict(self) -> dict:
        return asdict(self)

    def explain(self) -> str:
        """The plan as readable lines."""

        def gib(x):
            return f"{x / _GIB:.2f} GiB"

        s, n = self.shape, len(self.activations)
        lines = [
            f"plan for {s.get('name')} ({s.get('dtype')}, batch {s.get('batch')} x seq {s.get('seq')}): {self.mode}"
        ]
        st = self.weights["streamed"]
        lines.append(
            f"  weights: {n - len(st)} of {n} blocks resident"
            + (f", streamed: {_ranges(st)}" if st else "")
            + (
                f", frozen weights on disk: {_ranges(self.weights['disk'])}"
                if self.weights.get("disk")
                else ""
            )
        )
        counts = {
            k: [i for i, a in enumerate(self.activations) if a == k] for k in ("keep", "page", "recompute")
        }
        lines.append("  activations: " + ", ".join(f"{k} {_ranges(v)}" for k, v in counts.items() if v))
        o = self.optimizer
        sp = o.get("split")
        lines.append(
            f"  optimizer: {o['placement']}, {o['vram_share']:.0%} of the state in VRAM, moments {o['moment_dtype']}"
            + (
                f" (device {sp['device']:.0%}, mapped {sp['mapped']:.0%}, host {sp['host']:.0%})"
                if sp
                else ""
            )
        )
        sp0, rounds = o.get("initial_split"), o.get("refinements") or []
        trial = rounds[-1] if rounds and rounds[-1].get("host_trial") else None
        moves = rounds[:-1] if trial else rounds
        if sp0 and moves:
            lines[-1] += (
                f", after {len(moves)} refinement{'s' if len(moves) > 1 else ''}"
                + (" (undone)" if moves[-1].get("reverted") else "")
                + f" of step 2's (device {sp0['device']:.0%}, mapped {sp0['mapped']:.0%}, host {sp0['host']:.0%})"
            )
        if trial:
            lines[-1] += ", host-only trial " + ("undone" if trial.get("reverted") else "kept")
        if self.quantize != "none":
            lines.append(f"  frozen block weights quantized: {self.quantize}")
        for where in ("vram", "ram", "pinned"):
            m = self.memory.get(where, {})
            parts = ", ".join(f"{k} {gib(v)}" for k, v in m.items() if k not in ("total", "budget") and v)
            lines.append(
                f"  {where}: {gib(m.get('total', 0))} of {gib(m.get('budget', 0))}"
                + (f" ({parts})" if parts else "")
            )
        d = self.memory.get("disk")
        if d and d.get("optimizer_state"):
            lines.append(
                f"  disk: {gib(d['optimizer_state'])} of the optimizer state ({o.get('nvme_share', 0):.1%} of the host's)"
                + (f" of {gib(d['budget'])}" if d.get("budget") is not None else "")
                + f", {d['written_per_step'] / 1e9:.1f} GB written per step"
            )
        if d and d.get("weights"):
            lines.append(
                f"  disk: {gib(d['weights'])} of frozen weights (blocks {_ranges(self.weights.get('disk', []))}), "
                f"{d['weights_read_per_step'] / 1e9:.2f} GB read per step, none written"
            )
        b = self.bounds
        lines.append(
            "  step: "
            + f"{self.predicted['step_s'] * 1e3:.1f} ms predicted, bound by {self.predicted['bound']} ("
            + ", ".join(f"{k[:-2]} {v * 1e3:.1f} ms" for k, v in b.items())
            + ")"
        )
        lines += [f"  - {r}" for r in self.reasons]
        return "\n".join(lines)


def _ranges(idx: list[int]) -> str:
    from ..blocks import ranges_text

    return ranges_text(idx) if idx else "none"
