"""The OffloadModel schedule simulator against schedules computed by hand (every span written out
below, from the streamer's hooks: loads at the hooks, the copy stream after the compute issued
before them, the last `window` chunks kept for backward; `window` is OffloadModel's and RamTorch's:
device slots for streamed chunks, the running one included), the CLI, its table and errors, and
--measure from a real OffloadModel step on the CPU."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
import torch.nn as nn

import ramstream
from ramstream.simulate import simulate_offload, table, times_from_trace
from ramstream.simulate.__main__ import main as cli


def _lane(pred, lane):
    return [(sp.kind, sp.chunk, sp.start, sp.end) for sp in pred.spans if sp.lane == lane]


def test_window_1_never_overlaps_a_load_with_compute_by_hand():
    # 3 chunks, window 1 (no chunk ahead), keep_activations=True, tf=1 tb=2 th2d=1: each load
    # starts when the compute before it ends; only the last chunk stays loaded for backward
    p = simulate_offload(1, 2, 1, layers=3, window=1, keep_activations=True)
    assert _lane(p, "h2d") == [("load", 0, 0, 1), ("load", 1, 2, 3), ("load", 2, 4, 5), ("load", 1, 8, 9),
                               ("load", 0, 11, 12)]  # fmt: skip
    assert _lane(p, "compute") == [
        ("stall", 0, 0, 1),
        ("forward", 0, 1, 2),
        ("stall", 1, 2, 3),
        ("forward", 1, 3, 4),
        ("stall", 2, 4, 5),
        ("forward", 2, 5, 6),
        ("backward", 2, 6, 8),
        ("stall", 1, 8, 9),
        ("backward", 1, 9, 11),
        ("stall", 0, 11, 12),
        ("backward", 0, 12, 14),
    ]
    assert (p.makespan, p.busy, p.stall, p.peak_chunks) == (14, 9, 5, 1)
    work = [s for s in _lane(p, "compute") if s[0] != "stall"]
    for _, _, a0, a1 in _lane(p, "h2d"):
        assert all(a1 <= b0 or b1 <= a0 for _, _, b0, b1 in work)


def test_window_2_overlapped_by_hand():
    # 3 chunks, window 2 (one chunk ahead), keep_activations=True, tf=1 tb=2 th2d=1
    p = simulate_offload(1, 2, 1, layers=3, window=2, keep_activations=True)
    # pre-hook 0 loads 0 and 1; pre-hook 1 loads 2 once chunk 0's compute is done (t=2);
    # chunks 1 and 2 stay for backward; backward of 1 (hook at t=6) loads chunk 0
    assert _lane(p, "h2d") == [("load", 0, 0, 1), ("load", 1, 1, 2), ("load", 2, 2, 3), ("load", 0, 6, 7)]
    assert _lane(p, "compute") == [
        ("stall", 0, 0, 1),
        ("forward", 0, 1, 2),
        ("forward", 1, 2, 3),
        ("forward", 2, 3, 4),
        ("backward", 2, 4, 6),
        ("backward", 1, 6, 8),
        ("backward", 0, 8, 10),
    ]
    assert (p.makespan, p.busy, p.stall, p.peak_chunks) == (10, 9, 1, 2)
    assert p.utilisation == pytest.approx(0.9)


def test_window_2_fully_serial_on_the_cpu_by_hand():
    # device="cpu": copies inline; 3 chunks, window 2, tf=tb=1, th2d=0.5: nothing overlaps
    p = simulate_offload(1, 1, 0.5, layers=3, window=2, keep_activations=True, serial=True)
    assert _lane(p, "h2d") == [
        ("load", 0, 0, 0.5),
        ("load", 1, 0.5, 1),
        ("load", 2, 2, 2.5),
        ("load", 0, 5.5, 6),
    ]
    assert _lane(p, "compute") == [
        ("forward", 0, 1, 2),
        ("forward", 1, 2.5, 3.5),
        ("forward", 2, 3.5, 4.5),
        ("backward", 2, 4.5, 5.5),
        ("backward", 1, 6, 7),
        ("backward", 0, 7, 8),
    ]
    assert p.makespan == 8 == 4 * 0.5 + 6 * 1  # the sum of every copy and compute
    assert p.stall == 2


def test_large_window_is_compute_bound_by_hand():
    # window >= chunks: everything loads at the first pre-hook; only the first load is exposed
    p = simulate_offload(2, 4, 1, layers=3, window=3, keep_activations=True)
    assert _lane(p, "h2d") == [("load", 0, 0, 1), ("load", 1, 1, 2), ("load", 2, 2, 3)]
    assert [s[2:] for s in _lane(p, "compute")] == [
        (0, 1),
        (1, 3),
        (3, 5),
        (5, 7),
        (7, 11),
        (11, 15),
        (15, 19),
    ]
    assert p.makespan == 1 + 3 * (2 + 4) and p.peak_chunks == 3
    for w in (4, 10):  # more window changes nothing
        assert simulate_offload(2, 4, 1, layers=3, window=w, keep_activations=True).makespan == 19


def test_transfer_bound_by_hand():
    # 4 chunks, window 2, tf=tb=1, th2d=3: the copy stream is the bound
    p = simulate_offload(1, 1, 3, layers=4, window=2, keep_activations=True)
    assert _lane(p, "h2d") == [
        ("load", 0, 0, 3),
        ("load", 1, 3, 6),
        ("load", 2, 6, 9),
        ("load", 3, 9, 12),
        ("load", 1, 14, 17),
        ("load", 0, 17, 20),
    ]
    work = [s for s in _lane(p, "compute") if s[0] != "stall"]
    assert [s[2:] for s in work] == [
        (3, 4),
        (6, 7),
        (9, 10),
        (12, 13),
        (13, 14),
        (14, 15),
        (17, 18),
        (20, 21),
    ]
    assert (p.makespan, p.busy, p.stall, p.peak_chunks) == (21, 8, 13, 2)


def test_pinned_chunk_never_loads_and_recompute_by_hand():
    # 3 chunks, pin=1, window 2, keep_activations=False (recompute), tf=1 tb=2 th2d=1
    p = simulate_offload(1, 2, 1, layers=3, pin=1, window=2)
    assert _lane(p, "h2d") == [("load", 1, 1, 2), ("load", 2, 2, 3)]  # chunk 0 is resident
    assert _lane(p, "compute") == [
        ("forward", 0, 0, 1),
        ("stall", 1, 1, 2),
        ("forward", 1, 2, 3),
        ("forward", 2, 3, 4),
        ("recompute", 2, 4, 5),
        ("backward", 2, 5, 7),
        ("recompute", 1, 7, 8),
        ("backward", 1, 8, 10),
        ("recompute", 0, 10, 11),
        ("backward", 0, 11, 13),
    ]
    assert (p.makespan, p.busy, p.peak_chunks, p.pinned) == (13, 12, 3, (0,))  # window + pin
    # every chunk pinned: no loads at all, the step is the compute
    q = simulate_offload(1, 2, 1, layers=3, pin=3, window=2, keep_activations=True)
    assert _lane(q, "h2d") == [] and q.makespan == 9 and q.stall == 0
    # pin chooses evenly spaced chunks, as OffloadModel's pin does: chunk i * n // pin
    assert simulate_offload(1, 1, 1, layers=12, pin=6).pinned == (0, 2, 4, 6, 8, 10)
    assert simulate_offload(1, 1, 1, layers=5, pin=2).pinned == (0, 2)
    assert simulate_offload(1, 1, 1, layers=5, pin_layers=[3, 4]).pinned == (3, 4)


def test_d2h_write_back_after_each_backward():
    p = simulate_offload(1, 1, 0, layers=2, window=2, keep_activations=True, td2h=3)
    # backward 1 [2, 3], backward 0 [3, 4]; writes queue on the D2H stream
    assert _lane(p, "d2h") == [("write", 1, 3, 6), ("write", 0, 6, 9)]
    assert p.makespan == 9 and p.busy == 4


def test_per_chunk_times_and_bytes():
    p = simulate_offload([1, 2], [1, 1], [0.5, 0.5], window=2, keep_activations=True, chunk_bytes=[10, 30])
    assert p.peak_chunks == 2 and p.peak_bytes == 40
    q = simulate_offload([1, 2], [1, 1], [0.5, 0.5], window=1, keep_activations=True, chunk_bytes=[10, 30])
    assert q.peak_chunks == 1 and q.peak_bytes == 30  # one at a time: the larger chunk
    assert p.busy == 5


def test_table_rows_over_every_window():
    rows = table(1, 2, 1.5, layers=4)
    assert [r.window for r in rows] == [1, 2, 3, 4]
    for r in rows:
        assert r.peak_chunks == min(r.window, 4)  # the window, never more
        assert r.makespan >= r.busy
    # a wider window never makes the step longer here
    assert all(a.makespan >= b.makespan for a, b in zip(rows, rows[1:]))


@pytest.mark.parametrize(
    "kw, name",
    [
        (dict(window=0), "window"),
        (dict(pin=5), "pin"),
        (dict(pin_layers=[1, 1]), "pin_layers"),
        (dict(pin_layers=[4]), "pin_layers"),
        (dict(keep_activations="yes"), "keep_activations"),
        (dict(tf=[1, 2]), "tf"),
        (dict(th2d=-1), "th2d"),
        (dict(layers=0), "layers"),
    ],
)
def test_bad_arguments(kw, name):
    args = {"tf": 1, "tb": 1, "th2d": 1, "layers": 4, **kw}
    with pytest.raises(ValueError, match=name):
        simulate_offload(args.pop("tf"), args.pop("tb"), args.pop("th2d"), **args)


def test_cli_table_and_single_window(capsys):
    assert (
        cli(
            [
                "offload",
                "--layers",
                "3",
                "--tf",
                "1",
                "--tb",
                "2",
                "--th2d",
                "1",
                "--keep-activations",
                "true",
            ]
        )
        == 0
    )
    out = capsys.readouterr().out.splitlines()
    assert out[1].split()[:2] == ["window", "makespan"]
    rows = [line.split() for line in out[2:]]
    assert [r[0] for r in rows] == ["1", "2", "3"]
    assert float(rows[0][1]) == 14  # test_window_1_never_overlaps_a_load_with_compute_by_hand
    assert float(rows[1][1]) == 10  # test_window_2_overlapped_by_hand
    assert cli(["offload", "--layers", "3", "--tf", "1", "--tb", "2", "--th2d", "1", "--window", "2",
                "--keep-activations", "true", "--json"]) == 0  # fmt: skip
    (row,) = json.loads(capsys.readouterr().out)
    assert row["makespan_s"] == 10 and row["peak_chunks"] == 2 and row["utilisation"] == pytest.approx(0.9)
    assert cli(["offload", "--layers", "3"]) == 2
    assert "--tf" in capsys.readouterr().err


def test_cli_module_entry_point_and_plot_extra(tmp_path):
    cmd = [sys.executable, "-m", "ramstream.simulate", "offload", "--layers", "2", "--tf", "1", "--tb", "1",
           "--th2d", "1", "--window", "1", "--plot", str(tmp_path / "g.png")]  # fmt: skip
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        assert r.returncode == 2 and "ramstream[plot]" in r.stderr
        assert not (tmp_path / "g.png").exists()
    else:
        assert r.returncode == 0, r.stderr
        assert (tmp_path / "g.png").read_bytes()[:4] == b"\x89PNG"


def _chunks(n=4, d=32):
    torch.manual_seed(0)
    return [nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d)) for _ in range(n)]


@pytest.mark.parametrize("keep", [True, "checkpoint"])
def test_measure_from_a_real_step(tmp_path, keep, capsys):
    model = ramstream.OffloadModel(_chunks(), device="cpu", window=2, pin=1, keep_activations=keep)
    x, y = torch.randn(64, 32), torch.randn(64, 32)
    path = tmp_path / "step.json"
    model.step(x, targets=y, profile_path=str(path))
    t = times_from_trace(str(path), keep_activations=keep)
    assert t["layers"] == 4
    assert all(v > 0 for v in t["tf"]) and all(v >= 0 for v in t["tb"])
    assert all(v > 0 for v in t["th2d"][1:])  # chunk 0 is pinned: never loaded, given the mean
    assert cli(["offload", "--measure", str(path), "--pin", "1", "--serial",
                "--keep-activations", "true" if keep is True else "checkpoint"]) == 0  # fmt: skip
    assert len(capsys.readouterr().out.splitlines()) == 2 + 4
    m = ramstream.simulate.measure_step(model, x, targets=y)
    assert m["layers"] == 4 and m["step_s"] > 0
    pred = simulate_offload(m["tf"], m["tb"], m["th2d"], window=2, pin=1, keep_activations=keep, serial=True)
    # the serial prediction is the sum of the measured spans: it cannot exceed the wall time; with
    # recompute, the backward spans less the chunk's forward time stand for the backward alone,
    # which is off by how much slower the recompute ran than the forward (at most that forward)
    slack = 0.0 if keep is True else sum(m["tf"])
    assert 0 < pred.makespan <= m["step_s"] + slack
    model.close()


# ---- file arguments checked at argument parsing (issue 25 item 8) ------------------------------


def test_measure_with_a_missing_file_exits_2_naming_it_without_a_traceback(tmp_path):
    missing = tmp_path / "nope.json"
    r = subprocess.run(
        [sys.executable, "-m", "ramstream.simulate", "offload", "--measure", str(missing)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    assert f"argument --measure: trace '{missing}' does not exist" in r.stderr


@pytest.mark.parametrize(
    "content, says",
    [
        ("not json", "is not JSON: Expecting value at line 1 column 1"),
        ('{"a": 1}', "not a trace"),
        ("[1, 2]", "no 'forward <chunk>' spans"),
        ('[{"ph": "X", "name": "forward 0", "dur": "slow"}]', "dur='slow'"),
        (None, "is a folder"),
    ],
)
def test_measure_with_a_bad_file_is_a_usage_error_naming_it(tmp_path, capsys, content, says):
    path = tmp_path / "t.json"
    if content is None:
        path.mkdir()
    else:
        path.write_text(content)
    with pytest.raises(SystemExit) as e:
        cli(["offload", "--measure", str(path)])
    err = capsys.readouterr().err
    assert e.value.code == 2 and f"'{path}'" in err and says in err, err


def test_plot_into_a_missing_folder_is_refused_before_simulating(tmp_path, capsys):
    out = tmp_path / "missing" / "g.png"
    with pytest.raises(SystemExit) as e:
        cli(["offload", "--layers", "2", "--tf", "1", "--tb", "1", "--th2d", "1", "--plot", str(out)])
    err = capsys.readouterr().err
    assert e.value.code == 2 and f"its folder '{tmp_path / 'missing'}' does not exist" in err


def test_times_from_trace_names_the_file(tmp_path):
    path = tmp_path / "t.json"
    path.write_text('{"traceEvents": {}}')
    with pytest.raises(ValueError, match=f"times_from_trace: '{path}': not a trace"):
        times_from_trace(str(path))
    with pytest.raises(FileNotFoundError, match="'/no/such.json' does not exist"):
        times_from_trace("/no/such.json")
