"""Stages sharing a device in the schedule simulator (ramstream.simulate.shared, issue 28's P4
row): processor sharing derived by hand, the model equal to simulate_pipeline's when no device is
shared, exclusive_times() inverting it, the CLI's --devices and bad arguments."""

from __future__ import annotations

import pytest

from ramstream.simulate import simulate_pipeline, simulate_schedule
from ramstream.simulate.__main__ import main
from ramstream.simulate.shared import exclusive_times, simulate_shared

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402


def _spans(pred):
    return {(sp.stage, sp.kind, sp.mb): (sp.start, sp.end) for sp in pred.spans}


def test_gpipe_on_one_device_by_hand():
    # stage 0: F0 F1 B0 B1, stage 1: F0 F1 B0 B1; tf 1, tb 2, both stages on one device.
    # t=0 s0 F0 alone -> 1; s0 F1 and s1 F0 share the device from 1: each needs 1 alone -> both 3;
    # s1 F1 alone 3 -> 4; s1 B0 alone 4 -> 6; s0 B0 and s1 B1 share from 6 -> 10; s0 B1 10 -> 12
    r = simulate_schedule("gpipe", stages=2, microbatches=2, tf=1, tb=2, devices=["cuda:0", "cuda:0"])
    assert _spans(r) == {
        (0, "F", 0): (0, 1),
        (0, "F", 1): (1, 3),
        (1, "F", 0): (1, 3),
        (1, "F", 1): (3, 4),
        (1, "B", 0): (4, 6),
        (0, "B", 0): (6, 10),
        (1, "B", 1): (6, 10),
        (0, "B", 1): (10, 12),
    }
    assert r.makespan == 12 and r.busy == [6, 6] and r.bubble == 0.0  # one device, never idle


def test_comm_delays_the_hop_and_the_device_idles():
    # 1f1b, 2 stages on one device, comm 1: s0 F0 0-1; s1 F0 waits for the hop until 2
    r = simulate_schedule("1f1b", stages=2, microbatches=1, tf=1, tb=1, comm=1, devices=[0, 0])
    assert _spans(r) == {(0, "F", 0): (0, 1), (1, "F", 0): (2, 3), (1, "B", 0): (3, 4), (0, "B", 0): (5, 6)}
    assert r.bubble == pytest.approx(1 - 4 / 6)


@pytest.mark.parametrize("name,v", [("gpipe", 1), ("1f1b", 1), ("interleaved", 2)])
def test_a_device_per_stage_is_the_list_schedulers_model(name, v):
    tf = [0.5 + 0.25 * c for c in range(4 * v)]
    tb = [1.0 + 0.5 * (c % 3) for c in range(4 * v)]
    kw = dict(stages=4, microbatches=6, chunks_per_stage=v, tf=tf, tb=tb, comm=0.125)
    a = simulate_pipeline(name, **kw)
    b = simulate_shared(name, devices=[0, 1, 2, 3], **kw)

    def flat(pred):
        return {
            (s.stage, s.kind, s.mb, s.chunk, k): t for s in pred.spans for k, t in enumerate((s.start, s.end))
        }

    assert flat(b) == pytest.approx(flat(a))
    assert b.makespan == pytest.approx(a.makespan) and b.busy == pytest.approx(a.busy)
    # simulate_schedule only switches model when a device is shared
    assert simulate_schedule(name, devices=["a", "b", "c", "d"], **kw).makespan == a.makespan


@settings(max_examples=40, deadline=None)
@given(
    name=st.sampled_from(["gpipe", "1f1b", "interleaved"]),
    stages=st.integers(1, 4),
    mb=st.integers(1, 5),
    groups=st.lists(st.integers(0, 1), min_size=4, max_size=4),
    costs=st.lists(st.integers(0, 8), min_size=16, max_size=16),
)
def test_exclusive_times_give_back_the_costs_and_one_device_is_never_idle(name, stages, mb, groups, costs):
    v = 2 if name == "interleaved" else 1
    n = stages * v
    tf, tb = [c / 4 for c in costs[:n]], [c / 4 for c in costs[8 : 8 + n]]
    devices = groups[:stages]
    r = simulate_shared(
        name, stages=stages, microbatches=mb, chunks_per_stage=v, tf=tf, tb=tb, devices=devices
    )
    got = exclusive_times([(sp.stage, sp.start, sp.end) for sp in r.spans], devices)
    want = [(tf if sp.kind == "F" else tb)[sp.chunk] for sp in r.spans]
    assert got == pytest.approx(want, abs=1e-9)
    total = mb * (sum(tf) + sum(tb))
    if len(set(devices)) == 1:  # some op can always run (check() proves no deadlock): no idle time
        assert r.makespan == pytest.approx(total)
    else:
        assert r.makespan >= total / len(set(devices)) - 1e-9


def test_exclusive_times_by_hand():
    spans = [(0, 0.0, 2.0), (1, 1.0, 3.0), (2, 1.5, 2.5)]
    # one device: [0,1) alone, [1,1.5) two, [1.5,2) three, [2,2.5) two, [2.5,3) alone
    a = exclusive_times(spans, ["g", "g", "g"])
    assert a == pytest.approx([1 + 0.25 + 0.5 / 3, 0.25 + 0.5 / 3 + 0.25 + 0.5, 0.5 / 3 + 0.25])
    assert sum(a) == pytest.approx(3.0)  # the device was busy from 0 to 3
    assert exclusive_times(spans, ["g", "h", "h"]) == pytest.approx([2.0, 0.5 + 0.5 + 0.5, 0.5])
    # an empty span costs nothing and shares nothing; back-to-back spans do not overlap
    assert exclusive_times([(0, 0.0, 1.0), (1, 1.0, 1.0), (1, 1.0, 2.0)], ["g", "g"]) == [1.0, 0.0, 1.0]
    with pytest.raises(ValueError, match="ends"):
        exclusive_times([(0, 2.0, 1.0)], ["g"])
    for stage in (1, -1):  # no label for it (a negative index must not wrap around)
        with pytest.raises(ValueError, match="no entry in devices"):
            exclusive_times([(stage, 0.0, 1.0)], ["g"])


@pytest.mark.parametrize(
    "devices,match",
    [([0, 0, 0], "one label per stage"), ("cuda:0", "one label per stage"), ([[0], [0]], "hashable")],
)
def test_bad_devices_name_the_argument(devices, match):
    with pytest.raises(ValueError, match=match):
        simulate_schedule("gpipe", stages=2, microbatches=2, devices=devices)


def test_simulate_shared_checks_its_devices():
    with pytest.raises(ValueError, match="one label per stage"):
        simulate_shared("gpipe", stages=2, microbatches=1, devices=None)
    with pytest.raises(ValueError, match="hashable"):
        simulate_shared("gpipe", stages=2, microbatches=1, devices=[[0], [1]])


def test_the_cli_takes_devices(capsys):
    assert (
        main(["schedule", "--stages", "2", "--microbatches", "2", "--tb", "2", "--devices", "0,0", "--json"])
        == 0
    )
    import json

    rows = json.loads(capsys.readouterr().out)
    assert [r["makespan"] for r in rows] == [12, 12]  # both schedules fill one device
    assert main(["schedule", "--stages", "4", "--devices", "0,0"]) == 2
    assert "one label per stage" in capsys.readouterr().err
