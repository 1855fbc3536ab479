"""planner/wrap_rules.py and planner/quantize.py's rooms: wrap()'s size rules as pure functions over
numbers, checked against hand arithmetic (the runtime's counting of a live model is
tests/test_recompute_auto.py's and tests/test_quant_plan.py's)."""

from __future__ import annotations

import pytest

from ramstream.planner import wrap_rules as wr
from ramstream.planner.quantize import device_room, host_room, smallest_host_state

GIB = 2**30


def test_lora_like_is_less_than_a_tenth_trained():
    assert wr.lora_like(9, 100) and not wr.lora_like(10, 100) and not wr.lora_like(50, 100)
    assert not wr.lora_like(0, 0)  # no elements: not LoRA-like
    assert wr.lora_like(0, 1)  # nothing trains: a frozen model


def test_weight_share():
    assert wr.weight_share(1, 100) == 0.7  # LoRA-like
    assert wr.weight_share(50, 100) == 0.5  # full fine-tuning
    assert wr.weight_share(50, 100, recompute_all=True) == 0.7
    assert wr.weight_share(0, 0) == 0.5


def test_front_blocks_to_stream_takes_the_fewest_from_the_front():
    # 100 B of weights, blocks of 30, 20, 10: under 75 B takes one block, under 50 two, under 41 three
    assert wr.front_blocks_to_stream(100, [30, 20, 10], 100) == 0
    assert wr.front_blocks_to_stream(100, [30, 20, 10], 75) == 1
    assert wr.front_blocks_to_stream(100, [30, 20, 10], 50) == 2
    assert wr.front_blocks_to_stream(100, [30, 20, 10], 41) == 3
    assert wr.front_blocks_to_stream(100, [30, 20, 10], 0) == 3  # every block, even if not enough
    assert wr.front_blocks_to_stream(100, [], 0) == 0


def test_grad_inflight_bytes_is_a_tenth_within_bounds():
    assert wr.grad_inflight_bytes(4 * GIB) == 4 * GIB // 10
    assert wr.grad_inflight_bytes(80 * GIB) == GIB
    assert wr.grad_inflight_bytes(0) == 1 << 20


def _rule(**kw):
    base = dict(n_blocks=4, trained=50, total=100, block_bytes=0, weights=0, state=0, usable=100 * GIB)
    return wr.auto_recompute(**{**base, **kw})


def test_full_fine_tuning_recomputes_above_90_percent():
    state = wr.moments_and_gradients(10**9, 2)
    assert state == 10**9 * 10  # two fp32 moments + a bf16 gradient an element
    weights = 2 * 10**9
    usable = int((weights + state) / 0.9)
    r = _rule(weights=weights, state=state, usable=usable + 10)
    assert not r.on and r.rule == "full_ft" and r.log_line() is None
    assert "<= 90% of" in r.why()
    r = _rule(weights=weights, state=state, usable=usable - 10)
    assert r.on and r.rule == "full_ft"
    assert r.why() == (
        f"full fine-tuning, weights {weights / GIB:.2f} + moments and gradients {state / GIB:.2f} GiB > 90% of "
        f"{(usable - 10) / GIB:.2f} GiB"
    )
    assert r.log_line() == (
        f"activation_checkpointing=auto: full fine-tuning; weights {weights / GIB:.2f} GiB + moments and "
        f"gradients {state / GIB:.2f} GiB > 90% of {(usable - 10) / GIB:.2f} GiB usable: every block "
        "recomputes in backward, so that VRAM keeps a share of the optimizer state"
    )
    # never with the optimizer on the host or without ramstream's CUDA kernels
    assert _rule(weights=weights, state=state, usable=1, optimizer_mode="cpu").rule == "optimizer cpu"
    assert not _rule(weights=weights, state=state, usable=1, optimizer_mode="cpu").on
    r = _rule(weights=weights, state=state, usable=1, kernels=False)
    assert not r.on and r.rule == "no kernels"


def test_lora_like_blocks_recompute_above_a_quarter_of_their_bytes():
    """Quantized blocks: their elements count at full size for the share (total), their packed
    bytes for VRAM (block_bytes): 1 trained element of 100 (99 quantized) is LoRA-like whatever
    the bytes, and the packed bytes alone decide."""
    r = _rule(trained=1, total=100, block_bytes=25 * GIB + 1, usable=100 * GIB, optimizer_mode="cpu")
    assert r.on and r.rule == "lora"  # optimizer_mode="cpu" does not matter to the LoRA rule
    assert r.log_line() == (
        "activation_checkpointing=auto: 1.0% of the blocks' parameters train (LoRA-like) and their weights "
        "(25.00 GiB) fill more than a quarter of 100.00 GiB: every block recomputes in backward"
    )
    assert r.why() == "LoRA-like, block weights 25.00 GiB > 25% of 100.00 GiB"
    r = _rule(trained=1, total=100, block_bytes=25 * GIB, usable=100 * GIB)
    assert not r.on and r.why() == "LoRA-like, block weights 25.00 GiB <= 25% of 100.00 GiB"
    # the same bytes with a tenth trained: the full fine-tuning rule (weights + state) decides
    r = _rule(trained=10, total=100, block_bytes=99 * GIB, weights=GIB, state=GIB, usable=100 * GIB)
    assert not r.on and r.rule == "full_ft"


def test_nothing_recomputes_without_a_gpu_blocks_elements_or_with_hf_checkpointing():
    big = dict(trained=1, total=100, block_bytes=99 * GIB, weights=99 * GIB, state=99 * GIB)
    assert _rule(**big).on
    for kw, rule in (
        (dict(usable=None), "cpu engine"),
        (dict(n_blocks=0), "no blocks"),
        (dict(hf_checkpointing=True), "hf checkpointing"),
        (dict(trained=0, total=0), "no elements"),
    ):
        r = _rule(**{**big, **kw})
        assert not r.on and r.rule == rule and r.log_line() is None and r.why()
    # no trained parameter at all (a frozen model): LoRA-like
    assert _rule(**{**big, "trained": 0}).rule == "lora"


def test_quantize_rooms():
    room, text = device_room(10 * GIB, 2 * GIB, 0.1, 0.7)
    assert room == int(12 * GIB * 0.9 * 0.7)
    assert (
        text
        == f"device: 70% of (10.00 GiB free + 2.00 GiB already there) after 10% headroom = {room / GIB:.2f} GiB"
    )
    assert smallest_host_state(10, 2) == 10 * (4 + 4 + 2)
    room, text = host_room(100 * GIB, 30 * GIB)
    assert room == int(0.9 * 100 * GIB) - 30 * GIB
    assert text == "host: 90% of 100.00 GiB available RAM - 30.00 GiB of host optimizer state = 60.00 GiB"
    assert host_room(GIB, 2 * GIB)[0] == 0


def test_the_plans_policy_asks_the_same_rules():
    """policy.auto_recompute / auto_streamed on a ModelShape give wrap_rules' answers on its numbers."""
    from ramstream.planner.policy import auto_recompute, auto_streamed
    from ramstream.planner.shape import BlockShape, ModelShape

    blk = BlockShape(name="b", trained_numel=10, trained_bytes=20, frozen_numel=990, frozen_bytes=1980)
    shape = ModelShape(
        name="m",
        blocks=(blk,) * 4,
        embed=BlockShape(name="embed"),
        head=BlockShape(name="head"),
        batch=1,
        seq=1,
    )
    w = lambda part: part.weight_bytes  # noqa: E731
    on, why = auto_recompute(shape, 4 * 2000 * 4 - 1, w, "auto")  # 8000 B of block weights > 25 %
    assert (
        on
        and why
        == wr.auto_recompute(
            n_blocks=4, trained=40, total=4000, block_bytes=8000, weights=8000, state=0, usable=31999
        ).why()
    )
    k, room = auto_streamed(shape, 10_000, 0.1, w)
    assert (
        room == pytest.approx(10_000 * 0.9 * 0.7)
        and k == wr.front_blocks_to_stream(8000, [2000] * 4, room) == 1
    )  # 6000 <= 6300
