"""ramstream.PipelineModel on CPU stages: the split balanced by parameters (optimal against brute
force) and device_weights, forward with padding (PipelinePaddingWarning), the model's own
parameters and state dict, training equal to the unsplit model, bad arguments."""

from __future__ import annotations

import copy
import itertools
import random
import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from ramstream import PipelineModel, PipelinePaddingWarning
from ramstream.pipeline.split import balance

CPU2 = ["cpu", "cpu"]


def brute(weights, n, dw):
    best = None
    for cuts in itertools.combinations(range(1, len(weights)), n - 1):
        edges = [0, *cuts, len(weights)]
        cost = max(sum(weights[a:b]) / dw[s] for s, (a, b) in enumerate(zip(edges, edges[1:])))
        best = cost if best is None else min(best, cost)
    return best


def test_balance_is_optimal_against_brute_force():
    rng = random.Random(0)
    for _ in range(200):
        k = rng.randint(1, 8)
        n = rng.randint(1, k)
        w = [rng.choice([0, 1, 5, 10, 100, rng.randint(0, 1000)]) for _ in range(k)]
        dw = [rng.choice([1.0, 2.0, 0.5]) for _ in range(n)]
        counts = balance(w, n, dw)
        assert len(counts) == n and sum(counts) == k and min(counts) >= 1
        edges = [0, *itertools.accumulate(counts)]
        cost = max(sum(w[a:b]) / dw[s] for s, (a, b) in enumerate(zip(edges, edges[1:])))
        assert cost == pytest.approx(brute(w, n, dw)), (w, n, dw, counts)


def mlp():
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(6, 64),  # 448
        nn.ReLU(),
        nn.Linear(64, 8),  # 520
        nn.Linear(8, 8),  # 72
        nn.Linear(8, 8),  # 72
        nn.Linear(8, 8),  # 72
        nn.Linear(8, 3),  # 27
    )


def test_split_by_parameters_children_and_device_weights():
    with PipelineModel(mlp(), torch.zeros(2, 6), devices=CPU2) as pm:
        assert pm.counts == [2, 5]  # 448 | 520 + 243: the best cut (the ReLU stays with its Linear)
        assert pm.split_spec == {"2": "beginning"}
        assert pm.num_stages == 2 and pm.devices == [torch.device("cpu")] * 2
    with PipelineModel(mlp(), torch.zeros(2, 6), devices=CPU2, balance="children") as pm:
        assert pm.counts == [4, 3]
    with PipelineModel(mlp(), torch.zeros(2, 6), devices=CPU2, device_weights=[4, 1]) as pm:
        assert pm.counts == [3, 4]  # the first device takes 4x the load: 968 / 4 against 243
    with PipelineModel(mlp(), torch.zeros(2, 6), devices=["cpu"] * 3) as pm:
        assert pm.counts == [2, 1, 4]
    with PipelineModel(mlp(), torch.zeros(2, 6), devices=CPU2, split_spec={"3": "end"}) as pm:
        assert pm.counts == [4, 3] and pm.split_spec == {"4": "beginning"}
    with PipelineModel(mlp(), torch.zeros(2, 6), num_stages=1) as pm:  # no GPU here: the CPU
        assert pm.counts == [7] and pm.devices == [torch.device("cpu")]


def test_split_points_of_torch_pipelining_are_accepted():
    pipelining = pytest.importorskip("torch.distributed.pipelining")
    spec = {"3": pipelining.SplitPoint.BEGINNING}
    with PipelineModel(mlp(), None, devices=CPU2, split_spec=spec) as pm:
        assert pm.counts == [3, 4]


def test_forward_pads_the_last_microbatch_and_equals_the_model():
    model = mlp()
    x = torch.randn(7, 6)
    with torch.no_grad():
        want = torch.cat([model(p) for p in torch.cat([x, x[:1]]).split(4)])[:7]
    pm = PipelineModel(model, torch.zeros(4, 6), devices=CPU2)
    with pytest.warns(PipelinePaddingWarning, match="padded with 1 row"):
        out = pm(x)
    assert torch.equal(out, want) and not out.requires_grad
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert pm(x[:4]).shape == (4, 3)  # a multiple: no padding
    pm.close()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with PipelineModel(model, torch.zeros(4, 6), devices=CPU2, warn_on_padding=False) as pm:
            assert torch.equal(pm(x), want)
        with PipelineModel(model, None, devices=CPU2) as pm:  # no example: num_stages microbatches
            with torch.no_grad():
                assert torch.equal(pm(x), torch.cat([model(p) for p in x.tensor_split(2)]))


def test_the_models_parameters_state_and_training():
    model = mlp()
    ref = copy.deepcopy(model)
    pm = PipelineModel(model, torch.zeros(2, 6), devices=CPU2)
    assert list(pm.parameters()) == list(model.parameters())
    assert [n for n, _ in pm.named_parameters()] == [n for n, _ in model.named_parameters()]
    assert list(pm.state_dict()) == list(model.state_dict())
    pm.load_state_dict(ref.state_dict())
    assert pm.eval() is pm and not model.training and not model[0].training
    pm.train()
    assert model[0].training
    with pytest.raises(TypeError, match="not supported"):
        pm.to(torch.float64)
    x, y = torch.randn(8, 6), torch.randn(8, 3)
    r = pm.step(x, targets=y, loss_fn=F.mse_loss, n_microbatches=4, schedule="staggered_1b1f")
    for xm, ym in zip(x.tensor_split(4), y.tensor_split(4)):
        (F.mse_loss(ref(xm), ym) / 4).backward()
    for p, q in zip(model.parameters(), ref.parameters()):
        assert torch.equal(p.grad, q.grad)
    r.flush_grads(0.5)
    pm.flush_grads(0.5)  # a second flush changes nothing
    for p, q in zip(model.parameters(), ref.parameters()):
        assert torch.equal(p.grad, q.grad * 0.5)
    assert pm.infer(x, n_microbatches=2).shape == (8, 3)
    pm.close()


def test_bad_arguments():
    with pytest.raises(TypeError, match="nn.Sequential"):
        PipelineModel(nn.Linear(2, 2), None, devices=CPU2)
    with pytest.raises(ValueError, match="balance"):
        PipelineModel(mlp(), None, devices=CPU2, balance="flops")
    with pytest.raises(ValueError, match="num_stages=3"):
        PipelineModel(mlp(), None, devices=CPU2, num_stages=3)
    with pytest.raises(ValueError, match="num_stages"):
        PipelineModel(mlp(), None, num_stages=0)
    with pytest.raises(ValueError, match="device_weights has 3"):
        PipelineModel(mlp(), None, devices=CPU2, device_weights=[1, 1, 1])
    with pytest.raises(ValueError, match="device_weights must be positive"):
        PipelineModel(mlp(), None, devices=CPU2, device_weights=[1, 0])
    with pytest.raises(ValueError, match="cannot split 2 children into 3"):
        PipelineModel(nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2)), None, devices=["cpu"] * 3)
    with pytest.raises(TypeError, match="example_input"):
        PipelineModel(mlp(), 4, devices=CPU2)
    with pytest.raises(ValueError, match="split_spec makes 3 stages"):
        PipelineModel(mlp(), None, devices=CPU2, split_spec={"2": "beginning", "4": "beginning"})
    with PipelineModel(mlp(), None, devices=CPU2) as pm, pytest.raises(TypeError, match="data"):
        pm((torch.zeros(2, 6),))


def test_a_module_list_of_blocks_is_run_in_order():
    model = mlp()
    blocks = nn.ModuleList(list(model))
    x = torch.randn(4, 6)
    with PipelineModel(blocks, torch.zeros(2, 6), devices=CPU2) as pm, torch.no_grad():
        assert pm.counts == [2, 5]
        assert torch.equal(pm(x), torch.cat([model(p) for p in x.split(2)]))
