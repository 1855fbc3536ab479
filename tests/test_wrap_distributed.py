"""Data parallel over gloo with the CPU engine: two ranks equal one process on the full batch."""

from __future__ import annotations

import pytest

from _dist_helpers import check_equals_one_process, check_half_the_host_state, run_two_ranks
from _models import make_model


@pytest.mark.parametrize("options, clip", [({}, None), ({"max_grad_norm": 0.05}, 0.05)])
def test_two_ranks_equal_one_process_and_stay_identical(tmp_path, options, clip):
    check_equals_one_process(run_two_ranks(tmp_path, "cpu", options), "cpu", clip)


def test_each_rank_holds_about_half_the_host_state(tmp_path):
    check_half_the_host_state(run_two_ranks(tmp_path, "cpu", {}, steps=1), "cpu")


def test_distributed_true_without_process_group_is_an_error():
    import ramstream

    with pytest.raises(ValueError, match="init_process_group"):
        ramstream.wrap(make_model(0), distributed=True)
