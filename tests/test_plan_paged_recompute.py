"""A block that both recomputes and pages (activation_checkpointing and activation_offload together)
pages only its checkpointed input, as the runtime does: the planner counts that, not the block's
whole activations.

Measured on the GPU machine (H200, 2026-12-05, bench/train/bench_defaults.py row R5 variant hand32:
GPT 6.85B bf16, 16 x 2048 tokens, chunked loss, 24 GiB cap, `param_offload=True,
activation_checkpointing=True, activation_offload=True`): the peak of the first two steps, before
any optimizer state moved into VRAM, was 8.35 GiB (vram_share's log line); the runtime paged one
boundary per block. The planner had counted 4 GiB of paged activations per block (128 GiB of RAM)
and called the run unfittable, though it trained at 3.61 s/step."""

from __future__ import annotations

import pytest

from ramstream.planner import ModelShape, plan_training
from ramstream.planner.profile import HardwareProfile

GIB = 2**30
HAND = dict(param_offload=True, activation_checkpointing=True, activation_offload=True)
MEASURED_PEAK_BEFORE_SHARE = 8.35 * GIB


def _prof(cap_gib: float, ram_gib: float = 124.0) -> HardwareProfile:
    """The H200 machine's rates of that run (its profile line: H2D 54.7, D2H 54.8 GB/s, host AdamW
    156 GB/s of fp32 state) under the cap."""
    v = int(cap_gib * GIB)
    return HardwareProfile(device="cuda", gpu_name="H200 (injected)", vram_total=140 * GIB, vram_free=v,
                           ram_total=int(125.8 * GIB), ram_available=int(ram_gib * GIB), pin_budget=62 * GIB,
                           h2d_gbps=54.7, d2h_gbps=54.8, duplex_gbps=49.5, adamw_gbps=156.0, matmul_tflops=790.0,
                           source="given")  # fmt: skip


def _r5():
    return ModelShape.gpt("6.85b", batch=16, seq=2048, dtype="bf16", loss="chunked")


def test_the_hand_options_of_row_r5_fit_with_the_boundaries_paged():
    sh = _r5()
    plan = plan_training(sh, _prof(24), **HAND)
    n = len(sh.blocks)
    assert plan.activations == ["recompute"] * n
    ram, vram = plan.memory["ram"], plan.memory["vram"]
    assert ram["paged_activations"] == sum(sh.boundary_bytes(i) for i in range(n))
    assert ram["paged_activations"] < sh.act_bytes(0) * n / 10  # not the blocks' whole activations
    before_share = vram["total"] - vram.get("optimizer_share", 0)
    assert abs(before_share - MEASURED_PEAK_BEFORE_SHARE) <= 0.15 * MEASURED_PEAK_BEFORE_SHARE
    assert any("only their checkpointed inputs" in r for r in plan.reasons)


def test_a_share_paged_with_every_block_recomputing_keeps_the_other_boundaries_on_the_device():
    sh = _r5()
    n = len(sh.blocks)
    half = plan_training(sh, _prof(24), **{**HAND, "activation_offload": 0.5})
    full = plan_training(sh, _prof(24), **HAND)
    assert half.activations == ["recompute"] * n
    paged = half.memory["ram"]["paged_activations"]
    assert paged == sum(sh.boundary_bytes(i) for i in range(n // 2))
    # the unpaged half keeps its boundaries in VRAM: more device bytes than paging them all
    assert half.memory["vram"]["activations"] > full.memory["vram"]["activations"]


@pytest.mark.parametrize("ckpt", [False, [0, 1]])
def test_blocks_that_do_not_recompute_page_their_whole_activations(ckpt):
    sh = ModelShape.gpt("1.8b", batch=8, seq=512, dtype="bf16", loss="chunked")
    plan = plan_training(
        sh, _prof(80), param_offload=False, activation_checkpointing=ckpt, activation_offload=True
    )
    n = len(sh.blocks)
    rc = set(ckpt or [])
    assert plan.activations == ["recompute" if i in rc else "page" for i in range(n)]
    want = sum(sh.boundary_bytes(i) if i in rc else sh.act_bytes(i) for i in range(n))
    assert plan.memory["ram"]["paged_activations"] == want


def test_with_checkpointing_auto_paging_replaces_the_rules_recompute():
    """activation_checkpointing="auto" with activation_offload=True: the rule's recompute gives way
    to paging whole blocks (what wrap() has applied: it takes "auto"'s recompute from these modes),
    unless the plan without recompute cannot fit, when every block recomputes and pages its input."""
    sh = ModelShape.gpt("1.8b", batch=8, seq=512, dtype="fp32", autocast="bf16", loss="chunked")
    roomy = plan_training(sh, _prof(24), param_offload=False, activation_offload=True)
    # the rule (full fine-tuning past 90 % of the cap) would recompute; paging takes its place
    assert any("pages the blocks instead of the rule's recompute" in r for r in roomy.reasons)
    assert roomy.activations == ["page"] * len(sh.blocks)
    tight = plan_training(_r5(), _prof(24), param_offload=True, activation_offload=True)
    assert tight.activations == ["recompute"] * len(_r5().blocks)
    assert tight.memory["ram"]["paged_activations"] == sum(_r5().boundary_bytes(i) for i in range(32))
