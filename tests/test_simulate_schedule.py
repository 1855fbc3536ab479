"""The pipeline simulator (ramstream.simulate.pipeline) and its CLI (`python -m ramstream.simulate
schedule | pipeline`): spans and makespans derived by hand, weight streaming per stage, the text
Gantt chart, JSON output and bad arguments."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys

import pytest

from ramstream.pipeline.schedule import Op
from ramstream.simulate import simulate_pipeline, simulate_schedule
from ramstream.simulate.__main__ import main
from ramstream.simulate.pipeline_gantt import ascii_gantt


def _spans(pred):
    return {(sp.stage, sp.kind, sp.mb): (sp.start, sp.end) for sp in pred.spans}


def test_1f1b_spans_by_hand():
    # stage 0: F0 F1 B0 B1, stage 1: F0 B0 F1 B1, unit costs
    r = simulate_schedule("1f1b", stages=2, microbatches=2)
    assert _spans(r) == {
        (0, "F", 0): (0, 1),
        (1, "F", 0): (1, 2),
        (0, "F", 1): (1, 2),
        (1, "B", 0): (2, 3),
        (1, "F", 1): (3, 4),  # after B0 on stage 1
        (0, "B", 0): (3, 4),  # waits for stage 1's B0; stage 0 idles in [2, 3]
        (1, "B", 1): (4, 5),
        (0, "B", 1): (5, 6),
    }
    assert r.makespan == 6 and r.busy == [4, 4] and r.bubble == pytest.approx(1 - 8 / 12)
    assert r.peak_in_flight == [2, 1] and r.window is None and r.copies == []


def test_comm_and_per_chunk_costs():
    # one microbatch over 2 stages: F0 [0,1], F1 [1+c, 2+c], B1 [2+c, 3+c], B0 [3+2c, 4+2c]
    r = simulate_schedule("gpipe", stages=2, microbatches=1, comm=0.25)
    assert r.makespan == 4.5
    assert _spans(r)[(0, "B", 0)] == (3.5, 4.5)
    # chunk 1 forward costs 2: F0 [0,1], F1 [1,3], B1 [3,4], B0 [4,5]
    r = simulate_schedule("gpipe", stages=2, microbatches=1, tf=[1, 2], tb=1)
    assert _spans(r) == {(0, "F", 0): (0, 1), (1, "F", 0): (1, 3), (1, "B", 0): (3, 4), (0, "B", 0): (4, 5)}
    # one stage, two chunks: no hop is paid between chunks on the same stage
    r = simulate_schedule("interleaved", stages=1, microbatches=1, chunks_per_stage=2, comm=5.0)
    assert r.makespan == 4


def test_custom_schedule_lists():
    rows = [
        [("F", 0, 0), ("F", 1, 0), ("B", 1, 0), ("B", 0, 0)],
        [("F", 0, 1), ("F", 1, 1), ("B", 1, 1), ("B", 0, 1)],
    ]
    r = simulate_pipeline(rows, stages=2, microbatches=2)  # backwards out of microbatch order: allowed here
    assert r.schedule == "custom" and r.makespan == 6
    with pytest.raises(ValueError, match="deadlocks"):
        simulate_pipeline([rows[0][::-1], rows[1]], stages=2, microbatches=2)


def test_streaming_by_hand():
    # one stage, one microbatch, a chunk of 2 pieces: the walk is pieces 0, 1 (forward), 1, 0
    kw = dict(stages=1, microbatches=1, layers=2, tf=1, tb=1, th2d=0.5, td2h=0)
    # window 1: load 0 [0, .5], F0 [.5, 1.5], load 1 after it [1.5, 2], F1 [2, 3], B1 [3, 4] (still
    # loaded), load 0 [4, 4.5], B0 [4.5, 5.5]
    r = simulate_pipeline("gpipe", window=1, **kw)
    assert r.makespan == 5.5
    assert [(c.unit, c.start, c.end) for c in r.copies] == [(0, 0, 0.5), (1, 1.5, 2), (0, 4, 4.5)]
    assert r.h2d_busy == [1.5] and r.busy == [4]
    # window 2: both loads up front, [0, .5] and [.5, 1]; compute [.5, 4.5]
    r = simulate_pipeline("gpipe", window=2, **kw)
    assert r.makespan == 4.5 and len(r.copies) == 2
    # gradient write-backs after each backward piece, on the D2H lane: B1 [2.5, 3.5] -> [3.5, 3.75],
    # B0 [3.5, 4.5] -> [4.5, 4.75]
    r = simulate_pipeline("gpipe", window=2, **dict(kw, td2h=0.25))
    assert [(c.lane, c.unit, c.start, c.end) for c in r.copies if c.lane == "d2h"] == [
        ("d2h", 1, 3.5, 3.75),
        ("d2h", 0, 4.5, 4.75),
    ]
    assert r.makespan == 4.75
    # pin 1: piece 0 resident (loads nothing); piece 1 loads at its hook after F0 [1, 1.5]
    r = simulate_pipeline("gpipe", window=1, pin=1, **kw)
    assert r.pinned == (0,) and [(c.unit, c.start) for c in r.copies] == [(1, 1)] and r.makespan == 4.5


def test_streaming_window_table():
    from ramstream.simulate.pipeline import window_table

    rows = window_table("1f1b", stages=2, microbatches=4, layers=3, tf=1, tb=2, th2d=0.5)
    assert [r.window for r in rows] == [None, 1, 2, 3]
    resident = rows[0].makespan
    assert resident == (4 + 2 - 1) * 3 * 3
    assert rows[1].makespan > rows[2].makespan >= rows[3].makespan >= resident
    assert rows[3].h2d_busy == [1.5, 1.5]  # every piece loaded once
    assert all(r.peak_in_flight == [2, 1] for r in rows)


@pytest.mark.parametrize(
    "kw, match",
    [
        (dict(tf=[1, 2, 3]), r"tf has 3 values for 2 chunks"),
        (dict(tb=-1), r"tb must be finite and >= 0, got -1.0"),
        (dict(tf="x"), r"tf must be a number or one per chunk"),
        (dict(comm=float("inf")), r"comm must be a finite time >= 0, got inf"),
        (dict(comm="1"), r"comm must be a finite time >= 0, got '1'"),
        (dict(layers=0), r"layers must be an int >= 1, got 0"),
        (dict(window=0), r"window must be an int >= 1 or None, got 0"),
        (dict(pin=1), r"pin needs window"),
        (
            dict(window=1, layers=2, pin=3),
            r"pin must be an int in \[0, 2\] \(layer pieces per stage\), got 3",
        ),
        (dict(window=1, layers=2, th2d=[1]), r"th2d has 1 values for 4 layer pieces"),
        (dict(chunks_per_stage=2), r"chunks_per_stage=2 needs schedule 'interleaved'"),
    ],
)
def test_simulate_rejects(kw, match):
    with pytest.raises(ValueError, match=match):
        simulate_pipeline("1f1b", **dict(dict(stages=2, microbatches=2), **kw))


def test_ascii_gantt():
    # stage 0: F0 F1 . B0 F2 B1 F3 B2 . B3; stage 1: . F0 B0 F1 B1 F2 B2 F3 B3 .
    r = simulate_schedule("1f1b", stages=2, microbatches=4)
    assert ascii_gantt(r, 10).splitlines() == ["stage 0  |01.a2b3c.d|", "stage 1  |.0a1b2c3d.|"]
    assert ascii_gantt(r, 20).splitlines()[1] == "stage 1  |..00aa11bb22cc33dd..|"
    r = simulate_pipeline("gpipe", stages=1, microbatches=1, layers=2, window=1, tf=1, tb=1, th2d=0.5)
    assert ascii_gantt(r, 11).splitlines() == ["stage 0  |.00.00aa.aa|", "  h2d 0  |=..=....=..|"]
    with pytest.raises(ValueError, match="width must be an int >= 1"):
        ascii_gantt(r, 0)


def test_cli_schedule(capsys):
    assert main(["schedule", "--stages", "2", "--microbatches", "4", "--width", "10"]) == 0
    out = capsys.readouterr().out
    assert "gpipe        makespan 10" in out and "1f1b         makespan 10" in out
    assert "stage 0  |01.a2b3c.d|" in out and "interleaved" not in out
    assert main(["schedule", "--p", "4", "--m", "8", "--v", "2", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [r["schedule"] for r in rows] == ["gpipe", "1f1b", "interleaved"]
    assert [r["makespan"] for r in rows] == [22, 22, 19]  # (8 + 3) * 2; (8 + 3/2) * 2
    assert rows[1]["peak_in_flight"] == [4, 3, 2, 1] and rows[2]["chunks_per_stage"] == 2
    assert len(rows[0]["spans"]) == 2 * 8 * 4 and rows[0]["spans"][0] == [0, "F", 0, 0, 0, 1]
    assert (
        main(["schedule", "--schedule", "staggered_1b1f", "--stages", "2", "--microbatches", "2", "--json"])
        == 0
    )
    assert json.loads(capsys.readouterr().out)[0]["schedule"] == "1f1b"


def test_cli_pipeline(capsys):
    assert main(["pipeline", "--p", "2", "--m", "4", "--chunks", "3", "--td2h", "0"]) == 0
    out = capsys.readouterr().out
    table = [ln.split() for ln in out.splitlines()[2:]]
    assert [row[0] for row in table] == ["resident", "1", "2", "3"]
    assert table[0][1] == "45" and table[3][1] == "45.5"  # (4 + 1) * 3 * 3; + the first load
    assert main(["pipeline", "--p", "2", "--m", "2", "--layers", "2", "--window", "1", "--json"]) == 0
    (row,) = json.loads(capsys.readouterr().out)
    assert row["window"] == 1 and row["schedule"] == "1f1b" and len(row["h2d_busy"]) == 2
    assert main(["pipeline", "--schedule", "interleaved", "--v", "2", "--layers", "2", "--window", "2"]) == 0
    assert "h2d 3" in capsys.readouterr().out


@pytest.mark.parametrize(
    "argv, match",
    [
        (["schedule", "--stages", "0"], "argument --stages/--p: must be an int >= 1, got 0"),
        (["schedule", "--microbatches", "x"], "argument --microbatches/--m: must be an int >= 1, got 'x'"),
        (["schedule", "--tf", "-1"], "argument --tf: must be a finite time >= 0, got '-1'"),
        (["schedule", "--comm", "nan"], "argument --comm: must be a finite time >= 0"),
        (["schedule", "--schedule", "zb"], "argument --schedule: invalid choice: 'zb'"),
        (["pipeline", "--window", "0"], "argument --window: must be an int >= 1, got 0"),
        (["pipeline", "--pin", "-1"], "argument --pin: must be an int >= 0, got -1"),
        (
            ["schedule", "--plot", "/no/such/folder/g.png"],
            "argument --plot: output file '/no/such/folder/g.png'",
        ),
    ],
)
def test_cli_usage_errors(argv, match, capsys):
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2
    assert match in capsys.readouterr().err


def test_cli_value_errors(capsys):
    assert main(["pipeline", "--schedule", "gpipe", "--virtual", "2"]) == 2
    assert "simulate pipeline: --virtual 2 needs --schedule interleaved" in capsys.readouterr().err
    assert main(["pipeline", "--layers", "2", "--window", "1", "--pin", "3"]) == 2
    assert "simulate pipeline: simulate_pipeline: pin must be an int in [0, 2]" in capsys.readouterr().err


def test_cli_plot(tmp_path, capsys):
    png = tmp_path / "g.png"
    rc = main(["schedule", "--stages", "2", "--microbatches", "2", "--plot", str(png)])
    if importlib.util.find_spec("matplotlib") is None:
        assert rc == 2 and "needs matplotlib: pip install 'ramstream[plot]'" in capsys.readouterr().err
        assert not png.exists()
    else:
        assert rc == 0 and png.stat().st_size > 0


def test_module_entry_point():
    done = subprocess.run(
        [sys.executable, "-m", "ramstream.simulate", "schedule", "--p", "2", "--m", "2", "--width", "6"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert "stage 1  |.0a1b.|" in done.stdout


def test_op_is_a_tuple():
    assert Op("F", 1, 2) == ("F", 1, 2) and Op("B", 0, 0).kind == "B"
