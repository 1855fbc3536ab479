"""delayed_update's optimizer split (plan.py): with optimizer_mode="auto" the GPU's mapped share is
not delayed, and the host share's update hides beside the next step's forward and backward
(timing.py: the host lane is the host AdamW alone), so the balance is the GPU lane (compute + the
mapped update) against the host AdamW, not choose_mapped_fraction's host against PCIe. wrap()
hands the result to the optimizer as its first split (runtime/delayed_split.py); the refiner then
measures as without delay."""

from __future__ import annotations

from .rules import DELAYED_SPLIT_STEPS


def choose(split: dict, streamed_trained: int, step_s, cap) -> dict:
    """The split with the mapped share of the parameters outside the VRAM share (streamed
    blocks' stay on the host) that minimises step_s(split) on a grid of DELAYED_SPLIT_STEPS + 1
    shares (0, 1/N, ..., 1; the first of equal ones); cap(split): the share cut to the page-lock
    budget (host_fit.cap_mapped_to_pin)."""
    rest = split["mapped"] + split["host"]
    movable = rest - streamed_trained
    best = None
    for k in range(DELAYED_SPLIT_STEPS + 1):
        m = movable * k // DELAYED_SPLIT_STEPS
        trial = cap({**split, "mapped": m, "host": rest - m})
        t = step_s(trial)
        if best is None or t < best[0] * (1 - 1e-9):
            best = (t, trial)
    return {**best[1], "mapped_fraction_of_rest": best[1]["mapped"] / max(1, movable), "delayed_split": True}
