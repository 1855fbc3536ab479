"""find_blocks on GPT, HF-like and Sequential structures, and the activation planner's
arithmetic with injected timings."""

from __future__ import annotations

import pytest
import torch.nn as nn

from ramstream.activations import find_blocks
from ramstream.planner import (
    choose_paged_blocks,
    copy_seconds,
    estimate_overlap,
    fraction_to_blocks,
)

from _models import make_model


# ---- find_blocks ---------------------------------------------------------------------------------
class _Attn(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.q, self.k = nn.Linear(d, d), nn.Linear(d, d)


class _Expert(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.fc = nn.Linear(d, d)


class _DecoderLayer(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.self_attn = _Attn(d)
        self.experts = nn.ModuleList(_Expert(d) for _ in range(4))  # a smaller repeated list


class _HFLike(nn.Module):
    """LlamaForCausalLM-like: model.embed_tokens, model.layers, model.norm, lm_head."""

    def __init__(self, d=16, n=3):
        super().__init__()
        self.model = nn.Module()
        self.model.embed_tokens = nn.Embedding(10, d)
        self.model.layers = nn.ModuleList(_DecoderLayer(d) for _ in range(n))
        self.lm_head = nn.Linear(d, 10)


class _GPT2Like(nn.Module):
    def __init__(self, d=16, n=4):
        super().__init__()
        self.transformer = nn.Module()
        self.transformer.wte = nn.Embedding(10, d)
        self.transformer.h = nn.ModuleList(_DecoderLayer(d) for _ in range(n))
        self.head = nn.Sequential(nn.Linear(d, d), nn.Linear(d, d))  # 2 Linears, fewer params


def test_find_blocks_on_gpt_hf_and_sequential_structures():
    m = make_model(0, n_blocks=3)
    assert find_blocks(m) == list(m.blocks)
    hf = _HFLike()
    assert find_blocks(hf) == list(hf.model.layers)
    g2 = _GPT2Like()
    assert find_blocks(g2) == list(g2.transformer.h)
    seq = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 4))
    assert find_blocks(seq) == list(seq)
    shared, other = _Expert(4), _Expert(4)
    assert find_blocks(nn.ModuleList([shared, shared, other])) == [shared, other]


def test_find_blocks_errors():
    class Flat(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Linear(4, 4), nn.ReLU()
            self.mixed = nn.ModuleList([nn.Linear(4, 4), nn.ReLU()])
            self.drops = nn.ModuleList([nn.Dropout(), nn.Dropout()])

    with pytest.raises(ValueError, match=r"no repeated layer stack.*blocks=\[") as e:
        find_blocks(Flat())
    assert "mixed" in str(e.value)
    with pytest.raises(TypeError):
        find_blocks("model")


# ---- planner -------------------------------------------------------------------------------------
GB = 10**9


def test_planner_pages_as_many_as_the_slowdown_allows():
    # 8 blocks of 1 GB; 50+50 GB/s -> 40 ms of copies per block; 1 s step; half hidden
    idx, info = choose_paged_blocks(
        [GB] * 8, unpaged_step_s=1.0, d2h_gbps=50, h2d_gbps=50, compute_overlap=0.5, max_slowdown=0.15
    )
    # added = 0.5 * 0.04 * k <= 0.15 -> k <= 7.5
    assert idx == list(range(7))
    assert info["k_within_slowdown"] == 7 and info["k_to_fit"] == 0 and info["fits"]
    assert info["copy_s"] == pytest.approx(0.28) and info["added_s"] == pytest.approx(0.14)
    assert info["expected_slowdown"] == pytest.approx(0.14)
    assert "7 of 8" in info["reason"]
    assert info["copy_s_per_block"][0] == pytest.approx(copy_seconds(GB, 50, 50))


def test_planner_overlap_is_bounded_by_the_step():
    # overlap 1.0 but copies (0.4 s/block) exceed a 1 s step after 2.5 blocks
    idx, info = choose_paged_blocks(
        [5 * GB] * 6, unpaged_step_s=1.0, d2h_gbps=25, h2d_gbps=25, compute_overlap=1.0, max_slowdown=0.15
    )
    # k=2: 0.8 s hidden -> 0; k=3: 1.2 - 1.0 = 0.2 > 0.15
    assert idx == [0, 1] and info["added_s"] == pytest.approx(0.0)
    idx, _ = choose_paged_blocks(
        [5 * GB] * 6, unpaged_step_s=1.0, d2h_gbps=25, h2d_gbps=25, compute_overlap=1.0, max_slowdown=0.25
    )
    assert idx == [0, 1, 2]


def test_planner_pages_more_when_needed_to_fit_and_reports_the_cost():
    sizes = [GB, 2 * GB, GB, GB]
    idx, info = choose_paged_blocks(
        sizes,
        unpaged_step_s=0.5,
        d2h_gbps=20,
        h2d_gbps=20,
        compute_overlap=0.0,
        max_slowdown=0.15,
        must_free_bytes=3 * GB,
    )
    # within slowdown: 0.1 s per GB -> only block 0 (0.1 s <= 0.075? no) -> 0 blocks
    assert info["k_within_slowdown"] == 0
    assert idx == [0, 1] and info["k_to_fit"] == 2 and info["fits"]
    assert info["paged_bytes"] == 3 * GB
    assert info["expected_slowdown"] == pytest.approx(0.3 / 0.5)
    assert "needed to fit" in info["reason"]
    idx, info = choose_paged_blocks(
        sizes,
        unpaged_step_s=0.5,
        d2h_gbps=20,
        h2d_gbps=20,
        compute_overlap=0.0,
        max_slowdown=0.15,
        must_free_bytes=6 * GB,
    )
    assert idx == [0, 1, 2, 3] and not info["fits"] and "frees" in info["reason"]


def test_planner_zero_budget_and_empty():
    idx, info = choose_paged_blocks(
        [GB] * 3, unpaged_step_s=1.0, d2h_gbps=50, h2d_gbps=50, compute_overlap=0.0, max_slowdown=0.0
    )
    assert idx == [] and info["expected_slowdown"] == 0.0
    idx, info = choose_paged_blocks(
        [], unpaged_step_s=1.0, d2h_gbps=50, h2d_gbps=50, compute_overlap=0.5, max_slowdown=0.15
    )
    assert idx == [] and info["n_blocks"] == 0


@pytest.mark.parametrize(
    "kw,match",
    [
        (dict(block_bytes=[-1]), "block_bytes"),
        (dict(block_bytes=[1.5]), "block_bytes"),
        (dict(unpaged_step_s=0), "unpaged_step_s"),
        (dict(d2h_gbps=float("nan")), "d2h_gbps"),
        (dict(h2d_gbps=-1), "h2d_gbps"),
        (dict(compute_overlap=1.5), "compute_overlap"),
        (dict(max_slowdown=-0.1), "max_slowdown"),
        (dict(must_free_bytes=-5), "must_free_bytes"),
        (dict(max_slowdown=True), "max_slowdown"),
    ],
)
def test_planner_validation(kw, match):
    args = dict(
        block_bytes=[GB], unpaged_step_s=1.0, d2h_gbps=50, h2d_gbps=50, compute_overlap=0.5, max_slowdown=0.15
    )
    args.update(kw)
    bb = args.pop("block_bytes")
    with pytest.raises(ValueError, match=match):
        choose_paged_blocks(bb, **args)


def test_estimate_overlap_and_fraction_to_blocks():
    assert estimate_overlap(1.0, 1.1, 0.4) == pytest.approx(0.75)
    assert estimate_overlap(1.0, 0.9, 0.4) == 1.0
    assert estimate_overlap(1.0, 2.0, 0.4) == 0.0
    assert estimate_overlap(1.0, 1.0, 0.0) == 1.0
    assert fraction_to_blocks(0.0, 32) == []
    assert fraction_to_blocks(1.0, 32) == list(range(32))
    assert fraction_to_blocks(0.5, 3) == [0, 1]
    assert fraction_to_blocks(0.25, 32) == list(range(8))
    assert fraction_to_blocks(0.1, 4) == []
    for bad in (-0.1, 1.01, float("nan"), True, "0.5"):
        with pytest.raises(ValueError, match="fraction"):
            fraction_to_blocks(bad, 4)
    with pytest.raises(ValueError, match="n_blocks"):
        fraction_to_blocks(0.5, -1)
