"""Pipeline schedules (ramstream.pipeline.schedule): op lists derived by hand for small cases,
check() on broken schedules, and fuzzed properties: every built schedule is complete, on the right
stages, deadlock-free, and runs each chunk's backwards in microbatch order."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ramstream.pipeline.schedule import NAMES, Op, build, canonical, check, dependencies, execution_order
from ramstream.simulate.pipeline import simulate_schedule


def _ops(text: str) -> list[Op]:
    """'F0.1 B2.3' -> [Op('F', 0, 1), Op('B', 2, 3)] (kind, microbatch . chunk)."""
    out = []
    for tok in text.split():
        mb, chunk = tok[1:].split(".")
        out.append(Op(tok[0], int(mb), int(chunk)))
    return out


# 2 stages x 4 microbatches, derived by hand (chunk = stage).
GPIPE_2x4 = [
    _ops("F0.0 F1.0 F2.0 F3.0 B0.0 B1.0 B2.0 B3.0"),
    _ops("F0.1 F1.1 F2.1 F3.1 B0.1 B1.1 B2.1 B3.1"),
]
# stage 0: 2-1-0 = 1 warm-up forward, then F/B pairs, then the last backward;
# stage 1 (the last): no warm-up.
ONE_F_ONE_B_2x4 = [
    _ops("F0.0 F1.0 B0.0 F2.0 B1.0 F3.0 B2.0 B3.0"),
    _ops("F0.1 B0.1 F1.1 B1.1 F2.1 B2.1 F3.1 B3.1"),
]
# interleaved, 2 stages x 2 chunks (stage 0 holds chunks 0 and 2, stage 1 chunks 1 and 3), 4
# microbatches in groups of 2. Forwards per group: chunk j's two, then chunk j+1's; backwards
# with the chunks reversed. Warm-up (2-1-s)*2 + (2-1)*2: 4 on stage 0, 2 on stage 1.
INTERLEAVED_2x4x2 = [
    _ops("F0.0 F1.0 F0.2 F1.2 F2.0 B0.2 F3.0 B1.2 F2.2 B0.0 F3.2 B1.0 B2.2 B3.2 B2.0 B3.0"),
    _ops("F0.1 F1.1 F0.3 B0.3 F1.3 B1.3 F2.1 B0.1 F3.1 B1.1 F2.3 B2.3 F3.3 B3.3 B2.1 B3.1"),
]


def test_hand_derived_schedules():
    assert build("gpipe", 2, 4) == GPIPE_2x4
    assert build("1f1b", 2, 4) == ONE_F_ONE_B_2x4
    assert build("interleaved", 2, 4, 2) == INTERLEAVED_2x4x2
    assert build("staggered_1b1f", 2, 4) == ONE_F_ONE_B_2x4
    assert build("1b1f", 2, 4) == ONE_F_ONE_B_2x4
    assert build("interleaved", 2, 4, 1) == ONE_F_ONE_B_2x4  # one chunk a stage: textbook 1F1B
    # 4 stages: stage s runs 3 - s warm-up forwards (RamTorch's "1f1b" runs 3 on every stage)
    assert [row[: 4 - s] for s, row in enumerate(build("1f1b", 4, 8))] == [
        [Op("F", mb, s) for mb in range(4 - s - 1)] + [Op("F", 3 - s, s)] for s in range(4)
    ]
    assert build("1f1b", 4, 8)[3][:2] == [Op("F", 0, 3), Op("B", 0, 3)]
    for name, rows in (("gpipe", GPIPE_2x4), ("1f1b", ONE_F_ONE_B_2x4)):
        check(rows, 2, 4)
        assert simulate_schedule(name, stages=2, microbatches=4).makespan == 10  # (4 + 2 - 1) * (1 + 1)


def test_fewer_microbatches_than_stages():
    assert build("1f1b", 4, 2)[0] == _ops("F0.0 F1.0 B0.0 B1.0")
    assert build("1f1b", 4, 2)[3] == _ops("F0.3 B0.3 F1.3 B1.3")
    assert build("gpipe", 1, 1) == [_ops("F0.0 B0.0")]
    rows = build("interleaved", 4, 3, 2)  # padded to 4 microbatches, the 4th's ops dropped
    check(rows, 4, 3, 2)
    assert all(op.mb < 3 for row in rows for op in row)


def test_dependencies():
    assert dependencies(Op("F", 3, 0), 4) == []
    assert dependencies(Op("F", 3, 2), 4) == [Op("F", 3, 1)]
    assert dependencies(Op("B", 3, 3), 4) == [Op("F", 3, 3)]
    assert dependencies(Op("B", 3, 1), 4) == [Op("B", 3, 2), Op("F", 3, 1)]
    order = [op for _, op in execution_order(ONE_F_ONE_B_2x4, 2)]
    assert order.index(Op("B", 0, 1)) < order.index(Op("B", 0, 0))
    assert sorted(order) == sorted(GPIPE_2x4[0] + GPIPE_2x4[1])


@pytest.mark.parametrize(
    "args, match",
    [
        (("pipedream", 2, 4), r"schedule must be one of 'gpipe', '1f1b', 'interleaved'.*got 'pipedream'"),
        (("1f1b", 0, 4), r"stages must be an int >= 1, got 0"),
        (("1f1b", 2, 0), r"microbatches must be an int >= 1, got 0"),
        (("1f1b", 2, True), r"microbatches must be an int >= 1, got True"),
        (("interleaved", 2, 4, 0), r"chunks_per_stage must be an int >= 1, got 0"),
        (("interleaved", 2.0, 4, 2), r"stages must be an int >= 1, got 2.0"),
        (("gpipe", 2, 4, 2), r"chunks_per_stage=2 needs schedule 'interleaved'"),
        (("staggered_1b1f", 2, 4, 3), r"chunks_per_stage=3 needs schedule 'interleaved'"),
    ],
)
def test_build_rejects(args, match):
    with pytest.raises(ValueError, match=match):
        build(*args)


def test_canonical():
    assert [canonical(n) for n in NAMES] == ["gpipe", "1f1b", "interleaved", "1f1b", "1f1b"]
    with pytest.raises(ValueError, match="schedule must be one of"):
        canonical(None)


def _swap(rows, s, i, j):
    rows = [list(r) for r in rows]
    rows[s][i], rows[s][j] = rows[s][j], rows[s][i]
    return rows


def test_check_rejects_broken_schedules():
    good = [list(r) for r in ONE_F_ONE_B_2x4]
    check(good, 2, 4)
    check([[tuple(op) for op in row] for row in good], 2, 4)  # plain tuples are accepted
    with pytest.raises(ValueError, match=r"ops_per_stage must be a list of 2 op lists .* got 1"):
        check(good[:1], 2, 4)
    with pytest.raises(ValueError, match=r"1 ops missing, e.g. B\(mb=3, chunk=0\)"):
        check([good[0][:-1], good[1]], 2, 4)
    with pytest.raises(ValueError, match=r"F\(mb=0, chunk=0\) appears twice"):
        check([good[0] + [Op("F", 0, 0)], good[1]], 2, 4)
    with pytest.raises(ValueError, match=r"F\(mb=0, chunk=1\) is on stage 0; chunk 1 lives on stage 1"):
        check([good[0] + [Op("F", 0, 1)], good[1][1:]], 2, 4)
    with pytest.raises(ValueError, match=r"kind must be 'F' or 'B', mb in \[0, 4\), chunk in \[0, 2\)"):
        check([good[0] + [Op("W", 0, 0)], good[1]], 2, 4)
    with pytest.raises(ValueError, match=r"mb in \[0, 4\)"):
        check([good[0] + [Op("F", 4, 0)], good[1]], 2, 4)
    with pytest.raises(ValueError, match=r"stage 0 op 0 is not \(kind, mb, chunk\)"):
        check([[("F", 0)] + good[0][1:], good[1]], 2, 4)
    # B(0) and B(1) of chunk 0 swapped: complete and deadlock-free, but not in microbatch order
    swapped = _swap(good, 0, 2, 4)
    with pytest.raises(ValueError, match=r"chunk 0's backwards are not in microbatch order"):
        check(swapped, 2, 4)
    check(swapped, 2, 4, ordered_backward=False)
    # a backward before its own forward on the same stage
    with pytest.raises(ValueError, match=r"deadlocks: stage 0 at B\(mb=0, chunk=0\)"):
        check(_swap(good, 0, 0, 2), 2, 4, ordered_backward=False)
    # a cycle across stages, backwards in order: stage 0 waits at B(0) for stage 1's B(0), which
    # comes after stage 1's F(1), which needs stage 0's F(1), queued after B(0)
    cyclic = [_ops("F0.0 B0.0 F1.0 B1.0"), _ops("F0.1 F1.1 B0.1 B1.1")]
    with pytest.raises(
        ValueError, match=r"deadlocks: stage 0 at B\(mb=0, chunk=0\); stage 1 at F\(mb=1, chunk=1\)"
    ):
        check(cyclic, 2, 2)
    for bad, match in ((0, "stages"), ("2", "stages")):
        with pytest.raises(ValueError, match=match):
            check(good, bad, 4)


def _backward_order_ok(rows, microbatches, chunks):
    seen = {c: [] for c in range(chunks)}
    for row in rows:
        for op in row:
            if op.kind == "B":
                seen[op.chunk].append(op.mb)
    return all(seen[c] == list(range(microbatches)) for c in range(chunks))


@settings(max_examples=150, deadline=None)
@given(
    name=st.sampled_from(NAMES),
    stages=st.integers(1, 6),
    microbatches=st.integers(1, 14),
    chunks=st.integers(1, 4),
)
def test_fuzz_built_schedules_pass_check(name, stages, microbatches, chunks):
    v = chunks if name == "interleaved" else 1
    rows = build(name, stages, microbatches, v)
    check(rows, stages, microbatches, v)
    assert _backward_order_ok(rows, microbatches, stages * v)
    assert len(rows) == stages and all(len(r) == 2 * microbatches * v for r in rows)


@settings(max_examples=60, deadline=None)
@given(
    stages=st.integers(1, 6),
    microbatches=st.integers(1, 12),
    tf=st.sampled_from([1, 2]),
    tb=st.sampled_from([1, 2, 3]),
)
def test_fuzz_gpipe_and_1f1b_makespan(stages, microbatches, tf, tb):
    p, m = stages, microbatches
    g = simulate_schedule("gpipe", stages=p, microbatches=m, tf=tf, tb=tb)
    o = simulate_schedule("1f1b", stages=p, microbatches=m, tf=tf, tb=tb)
    assert g.makespan == o.makespan == (m + p - 1) * (tf + tb)
    assert g.peak_in_flight == [m] * p
    assert o.peak_in_flight == [min(p - s, m) for s in range(p)]
    assert o.bubble == pytest.approx((p - 1) / (m + p - 1))


@settings(max_examples=60, deadline=None)
@given(stages=st.integers(1, 5), groups=st.integers(1, 4), v=st.integers(1, 4))
def test_fuzz_interleaved_makespan(stages, groups, v):
    """With microbatches a multiple of stages and each chunk a 1/v share of a stage's work, the
    interleaved makespan is (m + (p-1)/v) * (tf + tb): the bubble shrinks v times."""
    p, m = stages, groups * stages
    r = simulate_schedule("interleaved", stages=p, microbatches=m, chunks_per_stage=v, tf=1 / v, tb=2 / v)
    assert r.makespan == pytest.approx((m + (p - 1) / v) * 3)


def test_interleaved_bubble_smaller_than_1f1b():
    for p, m in ((2, 4), (4, 8), (4, 6), (3, 7)):
        one = simulate_schedule("1f1b", stages=p, microbatches=m)
        two = simulate_schedule("interleaved", stages=p, microbatches=m, chunks_per_stage=2, tf=0.5, tb=0.5)
        assert two.bubble < one.bubble, (p, m)
    two = simulate_schedule("interleaved", stages=2, microbatches=4, chunks_per_stage=2, tf=0.5, tb=0.5)
    assert two.makespan == 9 and two.bubble == pytest.approx(1 / 9)  # (4 + 1/2) * 2; 1F1B: 10, 1/5
