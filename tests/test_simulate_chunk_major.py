"""simulate_pipeline(chunk_major=True): the runtime's chunk-major runs of streamed stages in the
simulator — a step computed by hand, the H2D loads against the runtime's own streamer counts (CPU
stages, window 1, where the simulator's eviction and the streamer's agree), 1F1B's warm-up runs,
and the arguments it refuses."""

from __future__ import annotations

import json

import pytest
import torch.nn.functional as F

from ramstream import Pipeline
from ramstream.simulate import simulate_pipeline

from _pipeline_helpers import batch, blocks


def h2d(pred, stages):
    return [sum(1 for c in pred.copies if c.lane == "h2d" and c.stage == s) for s in range(stages)]


def test_one_stage_by_hand():
    """1 stage, 2 pieces, 2 microbatches, tf = tb = 1, a load 0.5. Window 1: load u0 [0, .5];
    F u0 x2 [.5, 2.5]; load u1 after the compute issued [2.5, 3]; F u1 x2 [3, 5]; B u1 x2 [5, 7];
    load u0 [7, 7.5]; B u0 x2 [7.5, 9.5]. Window 2: both loaded by 1.0, compute 8 from 0.5: 8.5.
    Microbatch-major with window 1 loads a piece per op instead (4 more)."""
    kw = dict(stages=1, microbatches=2, layers=2, th2d=0.5)
    one = simulate_pipeline("gpipe", window=1, chunk_major=True, **kw)
    assert one.makespan == pytest.approx(9.5) and h2d(one, 1) == [3]
    assert [(s.kind, s.mb, s.start, s.end) for s in one.spans] == [
        ("F", 0, 0.5, 5.0), ("F", 1, 1.5, 5.0), ("B", 0, 5.0, 9.5), ("B", 1, 6.0, 9.5),
    ]  # fmt: skip
    two = simulate_pipeline("gpipe", window=2, chunk_major=True, **kw)
    assert two.makespan == pytest.approx(8.5) and h2d(two, 1) == [2]
    assert h2d(simulate_pipeline("gpipe", window=1, **kw), 1) == [7]


def test_a_run_over_every_microbatch_sends_gradients_home_once():
    kw = dict(stages=2, microbatches=4, layers=3, window=1, th2d=0.1, td2h=0.2)
    d2h = [
        sum(1 for c in simulate_pipeline("gpipe", chunk_major=cm, **kw).copies if c.lane == "d2h")
        for cm in (True, False)
    ]
    assert d2h == [2 * 3, 2 * 3 * 4]


@pytest.mark.parametrize("stages,microbatches", [(2, 4), (4, 6)])
def test_loads_equal_the_runtime_streamer_gpipe_window_1(stages, microbatches):
    x, y = batch(rows=12)
    per = 8 // stages
    for major in (True, False):
        kids = list(blocks(8))
        pipe = Pipeline(
            stage_modules=[kids[i * per : (i + 1) * per] for i in range(stages)], devices=["cpu"] * stages,
            offload_window=1, offload_pin=0, offload_chunk_major=major,
        )  # fmt: skip
        pipe.step(x, targets=y, loss_fn=F.mse_loss, n_microbatches=microbatches, schedule="gpipe")
        runtime = [m.streamer.stats["loads"] for m in pipe.modules]
        pipe.close()
        pred = simulate_pipeline(
            "gpipe",
            stages=stages,
            microbatches=microbatches,
            layers=per,
            window=1,
            th2d=0.1,
            chunk_major=major,
        )
        assert h2d(pred, stages) == runtime


def test_1f1b_warm_up_runs_across_devices():
    """Stage 0's 3 warm-up forwards are one run (they end together); its loads fall, but with
    cheap loads (0.1 of a forward) the run delays the stages after it, each on its own device in
    the simulator: the step is longer. This is why offload_chunk_major="auto" runs chunk-major
    only the stages that share a device."""
    kw = dict(stages=4, microbatches=6, layers=2, window=1, th2d=0.1)
    pred, base = simulate_pipeline("1f1b", chunk_major=True, **kw), simulate_pipeline("1f1b", **kw)
    first = [s for s in pred.spans if s.stage == 0 and s.kind == "F"][:3]
    assert len({s.end for s in first}) == 1
    assert h2d(pred, 4)[0] < h2d(base, 4)[0] and pred.makespan > base.makespan
    loads_dominate = dict(kw, th2d=5.0)  # loads 5x a forward: the saved loads win
    assert (
        simulate_pipeline("gpipe", chunk_major=True, **loads_dominate).makespan
        < simulate_pipeline("gpipe", **loads_dominate).makespan
    )


def test_refused():
    with pytest.raises(ValueError, match="chunk_major needs window"):
        simulate_pipeline("gpipe", stages=2, microbatches=2, chunk_major=True)
    with pytest.raises(ValueError, match="chunk_major needs window"):
        simulate_pipeline(
            "interleaved", stages=2, microbatches=2, chunks_per_stage=2, window=1, chunk_major=True
        )
    with pytest.raises(ValueError, match="chunk_major must be a bool"):
        simulate_pipeline("gpipe", stages=2, microbatches=2, window=1, chunk_major="yes")


def test_cli_chunk_major(capsys):
    from ramstream.simulate.__main__ import main

    argv = [
        "pipeline",
        "--schedule",
        "gpipe",
        "--p",
        "2",
        "--m",
        "8",
        "--layers",
        "4",
        "--th2d",
        "2",
        "--window",
        "1",
    ]
    assert main(argv + ["--json"]) == 0 and main(argv + ["--json", "--chunk-major"]) == 0
    plain, major = (json.loads(line)[0] for line in capsys.readouterr().out.splitlines())
    want = simulate_pipeline(
        "gpipe", stages=2, microbatches=8, layers=4, th2d=2.0, td2h=0.5, tb=2.0, window=1, chunk_major=True
    )
    assert major["makespan"] == want.makespan < plain["makespan"]
    assert main(argv + ["--chunk-major"]) == 0 and "chunk-major" in capsys.readouterr().out.splitlines()[0]
    assert main(["pipeline", "--schedule", "interleaved", "--v", "2", "--window", "1", "--chunk-major"]) == 2
