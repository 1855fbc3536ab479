"""Data parallel with streamed weights on the CUDA engine: two processes sharing cuda:0 over gloo
(each streamed bucket's home is broadcast as a host tensor) and, with two GPUs, NCCL (homes are
staged through a device buffer on the comm stream). Streamed runs equal the same runs with every
weight resident, bit for bit (the scenarios are in _dist_stream_helpers.py)."""

from __future__ import annotations

import pytest
import torch

from _dist_edge_helpers import run_ranks
from _dist_stream_helpers import check_streamed_equals_resident, get

pytestmark = pytest.mark.cuda
KINDS = ("fp32", "bf16", "clip_accum", "slow")


def _run(tmp_path, where: str, backend: str) -> list[dict]:
    names = [f"{k}@{where}" for k in KINDS]
    return run_ranks(tmp_path, 2, names, timeout_s=600, module="_dist_stream_helpers", backend=backend)


@pytest.fixture(scope="module")
def shared_gpu(tmp_path_factory):
    res = _run(tmp_path_factory.mktemp("dpstream-gloo"), "cuda0", "gloo")
    return lambda kind: get(res, f"{kind}@cuda0")


@pytest.fixture(scope="module")
def two_gpus(tmp_path_factory):
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs (NCCL, one per rank)")
    res = _run(tmp_path_factory.mktemp("dpstream-nccl"), "nccl", "nccl")
    return lambda kind: get(res, f"{kind}@nccl")


@pytest.mark.parametrize("kind", KINDS)
def test_two_processes_on_one_gpu(shared_gpu, kind):
    check_streamed_equals_resident(shared_gpu(kind), ("all", "one") if kind == "fp32" else ("all",))


@pytest.mark.parametrize("kind", KINDS)
def test_two_gpus_with_nccl(two_gpus, kind):
    check_streamed_equals_resident(two_gpus(kind), ("all", "one") if kind == "fp32" else ("all",))
