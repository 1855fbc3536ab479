"""Data parallel over gloo with the CUDA engine: two processes sharing cuda:0 equal one process.

gloo reduces and broadcasts CUDA tensors through pinned host copies ordered against the caller's
current stream, so the engine's CUDA path runs unchanged on it; NCCL would need one GPU per rank.
"""

from __future__ import annotations

import pytest

from _dist_helpers import check_equals_one_process, check_half_the_host_state, run_two_ranks

pytestmark = pytest.mark.cuda
DEV = "cuda:0"


@pytest.mark.parametrize("options, clip", [({}, None), ({"max_grad_norm": 0.05}, 0.05)])
def test_two_processes_on_one_gpu_equal_one_process_and_stay_identical(tmp_path, options, clip):
    check_equals_one_process(run_two_ranks(tmp_path, DEV, options), DEV, clip)


def test_each_process_holds_about_half_the_host_state(tmp_path):
    check_half_the_host_state(run_two_ranks(tmp_path, DEV, {}, steps=1), DEV)
