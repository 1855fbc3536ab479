"""A pipeline stage out of device memory (pipeline/oom.py): the caller gets a
PipelineOutOfMemoryError (still a torch.OutOfMemoryError and a MemoryError) saying where, how many
microbatches' saved activations each stage holds under the schedule (checked against the schedules
worked by hand), and what holds less; nothing changed and the next step is exact. On CPU stages the
allocator's error is raised by a module, as a GPU would raise it."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from ramstream import Pipeline
from ramstream.pipeline.oom import PipelineOutOfMemoryError

from _pipeline_helpers import batch, blocks, groups, next_step_is_exact, run_with_timeout

ALLOCATOR = "CUDA out of memory. Tried to allocate 194.00 MiB. GPU 0 has a total capacity of 79.18 GiB"


class OomAt(nn.Module):
    """Raises the allocator's error at its `at`-th forward (None: never)."""

    def __init__(self) -> None:
        super().__init__()
        self.at, self.calls = None, 0

    def forward(self, x):
        self.calls += 1
        if self.calls == self.at:
            raise torch.OutOfMemoryError(ALLOCATOR)
        return x


# 3 stages, 4 microbatches, by hand: GPipe runs every forward before any backward (4 held on each
# stage); the textbook 1F1B warms up with p-1-s forwards and then alternates (3, 2, 1)
HELD = {"gpipe": [4, 4, 4], "1f1b": [3, 2, 1]}


@pytest.mark.parametrize("overlap", [True, False])
@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_out_of_memory_says_where_and_the_arithmetic_and_changes_nothing(schedule, overlap):
    ref = blocks(6)
    ref[3].append(OomAt())  # the middle stage: blocks 2-3
    mine = copy.deepcopy(ref)
    oom = mine[3][2]
    pipe = Pipeline(stage_modules=groups(mine, 3), devices=["cpu"] * 3, overlap=overlap)
    x, y = batch(rows=12)
    pipe.step(x, targets=y, loss_fn=F.mse_loss, n_microbatches=4)
    before = {n: (p.detach().clone(), p.grad.clone()) for n, p in mine.named_parameters()}
    oom.calls, oom.at = 0, 3  # the third microbatch's forward through stage 1
    with pytest.raises(PipelineOutOfMemoryError) as info:
        run_with_timeout(
            lambda: pipe.step(x, targets=y, loss_fn=F.mse_loss, schedule=schedule, n_microbatches=4)
        )
    e = info.value
    assert isinstance(e, torch.OutOfMemoryError) and isinstance(e, MemoryError)
    assert isinstance(e.__cause__, torch.OutOfMemoryError) and str(e.__cause__) == ALLOCATOR
    msg = str(e)
    assert "stage 1 (cpu), the forward of microbatch 2 through chunk 1" in msg
    assert ALLOCATOR in msg
    assert f"holds up to {HELD[schedule]} microbatches' saved activations per stage" in msg
    assert ('schedule="1f1b" holds at most [3, 2, 1] per stage instead of [4, 4, 4]' in msg) == (
        schedule == "gpipe"
    )
    assert "offload_activations=True" in msg and "nothing changed" in msg
    for n, p in mine.named_parameters():
        assert torch.equal(p, before[n][0]) and torch.equal(p.grad, before[n][1]), n
    # the next step is exact
    oom.at = None
    next_step_is_exact(pipe, mine, ref, x, y, schedule=schedule)
    pipe.close()


def test_out_of_memory_in_infer_and_with_paging_drops_the_hints_that_do_not_apply():
    model = blocks(4)
    model[1].append(OomAt())
    pipe = Pipeline(stage_modules=groups(model, 2), devices=["cpu"] * 2, offload_activations=True)
    x, y = batch(rows=8)
    model[1][2].at = 2
    with pytest.raises(PipelineOutOfMemoryError) as info:
        run_with_timeout(
            lambda: pipe.step(x, targets=y, loss_fn=F.mse_loss, schedule="1f1b", n_microbatches=4)
        )
    msg = str(info.value)
    assert "offload_activations=True" not in msg  # already on
    assert 'schedule="1f1b"' not in msg  # already the textbook schedule
    model[1][2].calls, model[1][2].at = 0, 1
    with pytest.raises(PipelineOutOfMemoryError) as info:
        run_with_timeout(lambda: pipe.infer(x, n_microbatches=2))
    msg = str(info.value)
    assert "stage 0 (cpu), the forward of microbatch 0 through chunk 0" in msg
    assert "saved activations" not in msg and "a smaller batch" in msg
    model[1][2].at = None
    out = pipe.infer(x, n_microbatches=2)
    assert torch.equal(out, model(x))
    pipe.close()
