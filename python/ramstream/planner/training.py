"""What a run measured while training, as the planner sees it, and the planner's answer: frozen
records of numbers (no tensors, no modules) that the runtime's deciders fill and hand to
planner/revise.py revise_training(), which answers with a Decision. One record per decision kind:

  ResidentCheck   offload="auto" after SWITCH_AFTER_STEPS: does the whole state fit on the device
                  (runtime/optimizer_split.py maybe_switch; planner/inflight.py decide_resident)
  ShareCheck      after a declined switch: which buckets' state goes to the VRAM left, and the
                  host / mapped split of the rest (maybe_share; inflight.decide_share)
  SplitWindow     optimizer_mode="auto": a measured window of steps (runtime/refiner.py): refine
                  the host / mapped split, undo the last move, or end the host-only trial
                  (inflight.decide_window)
  HostTrialCheck  after a window that moved nothing: does the host-only trial run
                  (inflight.decide_host_trial)
  PeakCheck       the watchdog, every step once the plan settled: does a step's peak (or an out
                  of memory) call for freeing VRAM, and how much (planner/levers.py decide_peak)
  FreeVram        which levers free it (levers.decide_free)
  KeepCheck       activation_checkpointing="auto" in LoRA after step 1: which recomputed blocks
                  keep their activations (runtime/keep.py; levers.decide_keep)

The deciders apply a Decision through the engine's and the activations' mechanisms and return
the history entries; the session (runtime/session.py TrainingSession) records them."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class BucketFacts:
    """One optimizer bucket as the planner sees it. placement: "device" | "mapped" | "host";
    working_bytes: the parameters' element size; moment_bytes: a moment's element size;
    low_precision: the working dtype is not fp32 (an fp32 master exists); has_state: this rank
    holds its state (data parallel: another rank's buckets have none)."""

    index: int
    numel: int
    placement: str
    working_bytes: int
    moment_bytes: int
    low_precision: bool
    streamed: bool = False
    on_disk: bool = False
    has_state: bool = True

    @property
    def device_bytes(self) -> int:
        """What the bucket's state adds to VRAM in the "device" placement."""
        return self.numel * (2 * self.moment_bytes + (4 if self.low_precision else 0))

    @property
    def mapped_pcie_bytes(self) -> int:
        """PCIe bytes each way per element when the GPU updates it over mapped memory."""
        return 2 * self.moment_bytes + (4 if self.low_precision else 0)

    @property
    def shareable(self) -> bool:
        """May take any placement (not streamed, not on disk, state held here)."""
        return not self.streamed and not self.on_disk and self.has_state


@dataclass(frozen=True)
class ResidentCheck:
    """step: the steps done; usable, peak, now: the device's bytes (the process's cap, the peak
    since the last reset, allocated now); persistent_bytes, grad_bytes: what a resident update adds
    for good and keeps during backward (engine/resident.py resident_split); headroom: vram_headroom."""

    step: int
    usable: int
    peak: int
    now: int
    persistent_bytes: int
    grad_bytes: int
    headroom: float


@dataclass(frozen=True)
class ShareCheck:
    """buckets: the optimizer's buckets in order; moment_bytes: a moment's element size;
    gpu_only: optimizer_mode="gpu" (every bucket not in VRAM is updated over mapped memory);
    host_params_per_s, pcie_bytes_per_s: the isolated rates the mapped fraction is solved with
    (unused with gpu_only); keep_rest: the buckets that do not go to VRAM keep their placement
    (delayed_update: its host / mapped split is the plan's, balanced for the delay)."""

    step: int
    usable: int
    peak: int
    headroom: float
    buckets: tuple[BucketFacts, ...]
    moment_bytes: int
    gpu_only: bool = False
    host_params_per_s: float = 0.0
    pcie_bytes_per_s: float = 0.0
    keep_rest: bool = False


@dataclass(frozen=True)
class SplitWindow:
    """A measured window of steps first..step (runtime/refiner.py). buckets: as placed now; the
    window's sums: host_numel / host_s (the host AdamW's elements and seconds), mapped_numel /
    mapped_s / mapped_bytes (the mapped kernels'), throttle_s, wall_s (the steps' wall time);
    host_alone, pcie_alone: the isolated rates (pcie_alone None: not measured); refinement: the
    number of this decision (1 for the first); placements_before / step_s_before: the placements
    and the measured step before the last move (empty / None: no move yet); trial: this window ran
    the host-only trial (placements_before are then the placements before it)."""

    step: int
    first: int
    buckets: tuple[BucketFacts, ...]
    host_numel: int
    host_s: float
    mapped_numel: int
    mapped_s: float
    mapped_bytes: int
    throttle_s: float
    wall_s: float
    host_alone: float
    pcie_alone: float | None
    refinement: int
    placements_before: tuple[str, ...] = ()
    step_s_before: float | None = None
    trial: bool = False

    @property
    def steps(self) -> int:
        return self.step - self.first + 1

    @property
    def step_s(self) -> float:
        """The window's seconds per step."""
        return self.wall_s / self.steps


@dataclass(frozen=True)
class HostTrialCheck:
    """window: the window just decided on; buckets: as placed after that decision was applied."""

    window: SplitWindow
    buckets: tuple[BucketFacts, ...]


@dataclass(frozen=True)
class PeakCheck:
    """The watchdog's per-step figures: oom: an allocation failed since the last check."""

    step: int
    usable: int
    peak: int
    oom: bool
    headroom: float


@dataclass(frozen=True)
class FreeVram:
    """need: the bytes to free (decide_peak's need_bytes); kept / kept_block_bytes: the blocks the
    keep policy let keep their activations and a block's bytes (the first lever); buckets: the
    buckets that may move (none when the resident optimizer holds the state); paged: the blocks
    that page their activations (None: no paging); n_blocks, block_bytes: the stack's length and
    the paged blocks' measured bytes per step; allow_host: "mapped" -> "host" is allowed."""

    step: int
    need: int
    buckets: tuple[BucketFacts, ...] = ()
    paged: tuple[int, ...] | None = None
    n_blocks: int = 0
    block_bytes: tuple[int, ...] = ()
    allow_host: bool = False
    kept: tuple[int, ...] = ()
    kept_block_bytes: int = 0


@dataclass(frozen=True)
class KeepCheck:
    """block_bytes: what each recomputed block's forward left allocated (measured in step 1's
    recomputes); candidates: the recomputed blocks, in order."""

    step: int
    usable: int
    peak: int
    headroom: float
    block_bytes: tuple[int, ...]
    candidates: tuple[int, ...]


@dataclass(frozen=True)
class Decision:
    """revise_training()'s answer. change: the history entry's "change" ("" : nothing to record);
    act: the runtime changes something (the switch, moves, blocks); numbers: the arithmetic, for
    the history entry and the log; placements: the buckets' targets in bucket order (empty: none
    move); moves: the watchdog's levers ({"lever", "bytes", ...}); blocks: the blocks kept (keep)
    or given back (the watchdog's first lever); again: after a refinement that moved buckets,
    measure one more window; settle: no window after this one (the refinement settles)."""

    change: str = ""
    act: bool = False
    numbers: dict = field(default_factory=dict)
    placements: tuple[str, ...] = ()
    moves: tuple[dict, ...] = ()
    blocks: tuple[int, ...] = ()
    again: bool = False
    settle: bool = False


MEASUREMENTS = (ResidentCheck, ShareCheck, SplitWindow, HostTrialCheck, PeakCheck, FreeVram, KeepCheck)
