"""Test configuration: the `cuda` marker skips without a GPU (fails with RAMSTREAM_REQUIRE_CUDA=1);
the hardware profile's cache goes to a folder of the test session's own, so that a profile measured
under a test's conditions never reaches the user's cache (and the benchmarks run after the tests)."""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile

import pytest

if "RAMSTREAM_CACHE_DIR" not in os.environ:
    os.environ["RAMSTREAM_CACHE_DIR"] = tempfile.mkdtemp(prefix="ramstream-test-cache-")
    atexit.register(shutil.rmtree, os.environ["RAMSTREAM_CACHE_DIR"], ignore_errors=True)  # the session's own


def _gpu_ready() -> tuple[bool, str]:
    try:
        import torch

        from ramstream._native import cuda_available
    except Exception as e:  # pragma: no cover
        return False, f"import failed: {e}"
    if not torch.cuda.is_available():
        return False, "torch sees no GPU"
    if not cuda_available():
        from ramstream._native import lib

        return False, f"ramstream built without usable CUDA: {lib().cuda_unavailable_reason()}"
    return True, ""


# The slow tests (measured on the 2-core CI VM, 2026-12-05: 430 of the suite's 540 s): left out of
# the README's default run (pyproject's addopts: -m "not slow and not nightly") so that it takes
# minutes; CI runs them against the installed wheel (.ci/wheel_check: -m slow). A path names a whole
# file, "file::test" one test (every parametrization). Nothing is lost: `pytest -m "slow or not
# slow"` runs everything; `-m cuda` on the GPU machine selects every GPU test, slow ones included.
SLOW = {
    # subprocesses running every benchmark script, example and peer comparison (the `bench` kinds)
    "test_bench_scripts.py": 63,
    "test_bench_quant.py": 46,
    "test_bench_defaults.py": 15,
    "test_bench_trainer.py": 14,
    "test_bench_offload_model.py": 12,
    "test_bench_pipeline.py": 32,
    "test_bench_dp.py": 12,
    "test_examples.py": 46,
    # processes killed part-way, exits, data-parallel process groups, soaks, memory probes
    "test_hf_checkpoints.py": 41,
    "test_exit_clean.py": 21,
    "test_wrap_distributed_edge.py": 17,
    "test_wrap_distributed_stream.py": 14,
    "test_wrap_distributed.py": 13,
    "test_checkpoint_distributed.py": 6,
    "test_soak.py": 14,
    "test_wrap_oom.py": 13,
    "test_load_model_rss.py": 6,
    "test_checkpoint.py::test_a_save_killed_part_way_leaves_the_previous_checkpoint": 11,
    "test_cli_doctor.py::test_bad_or_slow_settings_warn_in_a_fresh_process": 13,
    "test_offload_model_activations.py::test_paged_activations_give_bit_identical_gradients": 10,
    "test_adamw_input.py::test_force_isa_environment": 8,
    "test_env.py::test_a_bad_value_warns_once_at_import_naming_variable_value_range_and_default": 8,
    "test_env.py::test_require_cuda_takes_0_or_1_and_anything_else_is_an_error": 4,
    "test_planner_plan.py::test_cli_plan_exit_2_when_it_does_not_fit": 7,
    "test_planner_plan.py::test_plan_error_shows_the_arithmetic_per_component": 7,
    "test_memory_budget.py::test_budget_from_env": 6,
    "test_loss.py::test_peak_memory_below_a_quarter_of_dense_cpu": 4,
    "test_hf_trainer.py::test_trainer_checkpoint_resumes_exactly_and_loads_across_trainers": 3,
    "test_cli.py::test_demo_trains_both_alike_and_the_loss_falls": 3,
}


def _is_slow(item) -> bool:
    name = os.path.basename(str(item.path))
    test = item.originalname if hasattr(item, "originalname") else item.name
    return name in SLOW or f"{name}::{test}" in SLOW


@pytest.hookimpl(tryfirst=True)  # before -m deselects by marker
def pytest_collection_modifyitems(config, items):
    from ramstream import env

    for item in items:
        if _is_slow(item):
            item.add_marker(pytest.mark.slow)

    try:
        require = env.get("RAMSTREAM_REQUIRE_CUDA")  # "0" or "1"; another value is an error
    except ValueError as e:
        raise pytest.UsageError(str(e)) from None
    ok, why = _gpu_ready()
    if ok:
        return
    cuda_items = [item for item in items if item.get_closest_marker("cuda") is not None]
    if cuda_items and require:
        raise pytest.UsageError(f"RAMSTREAM_REQUIRE_CUDA=1 but no usable GPU: {why}")
    for item in cuda_items:
        item.add_marker(pytest.mark.skip(reason=f"needs a GPU: {why}"))
