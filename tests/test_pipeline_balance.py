"""PipelineModel(balance="time"): the split by measured (or given) seconds per child, optimal against
brute force with device weights and per-device memory budgets (one partition routine for
parameters and time), MemoryError with the arithmetic, the measurement itself, bad arguments."""

from __future__ import annotations

import copy
import itertools
import random

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from ramstream import PipelineModel
from ramstream.pipeline import split
from ramstream.pipeline.partition import partition
from ramstream.pipeline.timing import measure_piece_times

CPU2 = ["cpu", "cpu"]
DIM = 8


class Repeat(nn.Module):
    """A small Linear applied `k` times: few parameters, much compute."""

    def __init__(self, k: int) -> None:
        super().__init__()
        self.lin, self.k = nn.Linear(DIM, DIM), k

    def forward(self, x):
        for _ in range(self.k):
            x = torch.tanh(self.lin(x))
        return x


def lopsided(k=100):
    """An embedding-like child (40,000 parameters, one lookup) then four expensive small ones."""
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Embedding(5000, DIM), Repeat(k), Repeat(k), Repeat(k), Repeat(k), nn.Linear(DIM, 2)
    )


IDS = torch.arange(6).reshape(3, 2) * 7
TIMES = [1.0, 50.0, 50.0, 50.0, 50.0, 1.0]  # injected seconds per child


def brute(loads, n, dw, sizes=None, caps=None):
    """The smallest heaviest load / device weight over every contiguous split that fits."""
    best = None
    for cuts in itertools.combinations(range(1, len(loads)), n - 1):
        edges = list(zip([0, *cuts], [*cuts, len(loads)]))
        if caps is not None and any(sum(sizes[a:b]) > caps[s] for s, (a, b) in enumerate(edges)):
            continue
        cost = max(sum(loads[a:b]) / dw[s] for s, (a, b) in enumerate(edges))
        best = cost if best is None else min(best, cost)
    return best


def cost_of(counts, loads, dw):
    edges = [0, *itertools.accumulate(counts)]
    return max(sum(loads[a:b]) / dw[s] for s, (a, b) in enumerate(zip(edges, edges[1:])))


def test_time_and_params_split_differently_and_time_is_the_brute_force_optimum():
    with PipelineModel(lopsided(), IDS, devices=CPU2, warn_on_padding=False) as pm:
        assert pm.counts == [1, 5] and pm.piece_times is None  # the embedding's parameters
    for dw in ([1, 1], [2, 1], [1, 3]):
        with PipelineModel(
            lopsided(), IDS, devices=CPU2, balance="time", piece_times=TIMES, device_weights=dw
        ) as pm:
            assert pm.piece_times == TIMES
            assert cost_of(pm.counts, TIMES, dw) == brute(TIMES, 2, dw)
            if dw == [1, 1]:
                assert pm.counts == [3, 3] and pm.split_spec == {"3": "beginning"}
    with PipelineModel(lopsided(), IDS, devices=["cpu"] * 3, balance="time", piece_times=TIMES) as pm:
        assert cost_of(pm.counts, TIMES, [1, 1, 1]) == brute(TIMES, 3, [1, 1, 1]) == 100.0


def test_partition_is_one_routine_and_optimal_under_budgets():
    assert split.balance is partition
    rng = random.Random(0)
    for _ in range(300):
        k = rng.randint(1, 7)
        n = rng.randint(1, k)
        loads = [float(rng.choice([0, 1, 3, 50, rng.randint(0, 200)])) for _ in range(k)]
        sizes = [rng.randint(0, 100) for _ in range(k)]
        caps = [rng.choice([None, 50, 120, 300]) for _ in range(n)]
        dw = [rng.choice([1.0, 2.0, 0.5]) for _ in range(n)]
        real = [float("inf") if c is None else c for c in caps]
        want = brute(loads, n, dw, sizes, real)
        if want is None:
            with pytest.raises(MemoryError, match="device_memory"):
                partition(loads, n, dw, sizes=sizes, budgets=caps)
            continue
        counts = partition(loads, n, dw, sizes=sizes, budgets=caps)
        edges = [0, *itertools.accumulate(counts)]
        assert len(counts) == n and min(counts) >= 1
        assert all(sum(sizes[a:b]) <= real[s] for s, (a, b) in enumerate(zip(edges, edges[1:])))
        assert cost_of(counts, loads, dw) == want, (loads, sizes, caps, dw, counts)


def test_memory_budget_moves_the_cut_and_a_split_that_cannot_fit_shows_the_arithmetic():
    emb = 5000 * DIM * 4 * 4  # parameters + gradients + 8 bytes of AdamW state per element
    with PipelineModel(lopsided(), IDS, devices=CPU2, balance="time", piece_times=TIMES) as pm:
        assert pm.counts == [3, 3]
    # the first device holds the embedding and one Repeat (72 elements: 1,152 bytes), not two
    with PipelineModel(
        lopsided(), IDS, devices=CPU2, balance="time", piece_times=TIMES, device_memory=[emb + 2000, None]
    ) as pm:
        assert pm.counts == [2, 4]
    with PipelineModel(
        lopsided(), IDS, devices=CPU2, balance="time", piece_times=TIMES, device_memory=[emb + 100, None]
    ) as pm:
        assert pm.counts == [1, 5]
    with pytest.raises(MemoryError) as e:
        PipelineModel(lopsided(), IDS, devices=CPU2, balance="params", device_memory=[emb - 1, emb - 1])
    msg = str(e.value)
    assert "parameters 0.000 GiB + gradients" in msg and "optimizer" in msg and "(too big)" in msg
    assert "stage 0 (pieces 0-0)" in msg and "largest piece (0)" in msg


@pytest.fixture
def one_thread():
    """One intra-op thread: on a loaded machine (CI, shared runners) torch's parallel kernels
    (the embedding's backward, BatchNorm) wait for descheduled pool threads for whole time slices."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def test_measured_times_find_the_expensive_children_and_restore_the_model(one_thread):
    model = lopsided(300)
    model.append(nn.BatchNorm1d(2))
    model(IDS).sum().backward()
    ref = copy.deepcopy(model)
    grads = [p.grad.clone() for p in model.parameters()]
    times = measure_piece_times(list(model), IDS, "cpu", repeats=5)
    assert len(times) == 7 and all(t > 0 for t in times)
    assert min(times[1:5]) > max(times[0], times[5])  # 300 matmuls (about 18 ms) vs one lookup
    for p, g in zip(model.parameters(), grads):
        assert torch.equal(p.grad, g)
    assert torch.equal(model[6].running_mean, ref[6].running_mean)
    assert int(model[6].num_batches_tracked) == 1
    with PipelineModel(lopsided(300), IDS, devices=CPU2, balance="time") as pm:
        assert pm.counts[0] >= 2 and len(pm.piece_times) == 6  # not the parameters' [1, 5]
    clock = iter(range(100)).__next__  # an injected clock: every run lasts 1 "second"
    assert measure_piece_times(list(lopsided(2)), IDS, "cpu", repeats=2, clock=clock) == [1.0] * 6


def test_a_time_balanced_model_trains_as_the_unsplit_one():
    model = lopsided(3)
    ref = copy.deepcopy(model)
    y = torch.randn(6, 2)
    ids = torch.arange(12).reshape(6, 2)
    with PipelineModel(model, ids[:3], devices=CPU2, balance="time") as pm:
        pm.step(ids, targets=y, loss_fn=lambda o, t: F.mse_loss(o.sum(1), t), n_microbatches=2)
    for xm, ym in zip(ids.tensor_split(2), y.tensor_split(2)):
        (F.mse_loss(ref(xm).sum(1), ym) / 2).backward()
    for p, q in zip(model.parameters(), ref.parameters()):
        assert torch.equal(p.grad, q.grad)


def test_bad_balance_arguments_name_the_argument_and_accepted_values():
    with pytest.raises(ValueError, match=r"balance must be one of 'params', 'children', 'time'"):
        PipelineModel(lopsided(), IDS, devices=CPU2, balance="flops")
    with pytest.raises(ValueError, match="pass example_input or piece_times"):
        PipelineModel(lopsided(), None, devices=CPU2, balance="time")
    with pytest.raises(ValueError, match="piece_times goes with balance='time'"):
        PipelineModel(lopsided(), IDS, devices=CPU2, piece_times=TIMES)
    with pytest.raises(ValueError, match="piece_times has 2 entries for 6"):
        PipelineModel(lopsided(), IDS, devices=CPU2, balance="time", piece_times=[1, 2])
    with pytest.raises(TypeError, match="piece_times"):
        PipelineModel(lopsided(), IDS, devices=CPU2, balance="time", piece_times=["x"] * 6)
    with pytest.raises(ValueError, match="device_memory has 1 entries"):
        PipelineModel(lopsided(), IDS, devices=CPU2, device_memory=[10])
    with pytest.raises(ValueError, match="device_memory entries"):
        PipelineModel(lopsided(), IDS, devices=CPU2, device_memory=[-1, None])
    with pytest.raises(TypeError, match="device_memory"):
        PipelineModel(lopsided(), IDS, devices=CPU2, device_memory=100)
    with pytest.raises(ValueError, match="device_memory goes with split_spec=None"):
        PipelineModel(lopsided(), IDS, devices=CPU2, split_spec={"2": "beginning"}, device_memory=[1, 1])
    with pytest.raises(ValueError, match="repeats"):
        measure_piece_times([nn.Linear(2, 2)], torch.zeros(1, 2), "cpu", repeats=0)
