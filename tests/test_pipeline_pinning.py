"""Pipeline.set_offload_pinned on CPU stages: re-pinning between steps (an int, a set, a per-stage
list with None, a dict) trains bit for bit as without it and as the unsplit model with torch's
AdamW, gradients and optimizer state kept; every bad spec raises before anything changes; the
summary's numbers against the stages' state; refused during a step or an open stream; the device
memory budget's arithmetic (force=True overrides it); a failure while applying undoes it all."""

from __future__ import annotations

import copy
import threading

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import ramstream.pipeline.streamed as streamed_mod
from ramstream import Pipeline

from _pipeline_helpers import assert_same, batch, blocks, reference_grads, run_with_timeout

SPECS = {
    "int": [2, 0, 3, 1],
    "set": [{0, 2}, {1}, set(), frozenset({0, 1, 2})],
    "list": [[[1], None, [0, 2]], [None, None, 3], [[0, 1, 2], None, None], (0, None, [1])],
    "dict": [{0: [0, 1, 2]}, {2: 1, 0: 0}, {2: {1, 2}, 1: None}, {0: 2, 2: 0}],
}


def three_stages(overlap=True, **kw):
    """The 8 blocks as streamed (3 chunks), resident (2 blocks), streamed (3 chunks) stages."""
    ref = blocks()
    mine = copy.deepcopy(ref)
    kids = list(mine)
    pipe = Pipeline(
        stage_modules=[kids[:3], nn.Sequential(*kids[3:5]), kids[5:]],
        devices=["cpu"] * 3,
        overlap=overlap,
        **kw,
    )
    return ref, mine, pipe


def at_home(stage) -> list[int]:
    """The chunks whose parameters are views of a slab's home buffer (streamed), read from the state."""
    homes = {s.home.untyped_storage().data_ptr() for b in stage.streamer.blocks for s in b.slabs}
    out = []
    for i, c in enumerate(stage.parts):
        where = {p.untyped_storage().data_ptr() in homes for p in c.parameters()}
        assert len(where) == 1, f"chunk {i} is half streamed"
        if where == {True}:
            out.append(i)
        # a streamed chunk's gradients go home through the write-back's hook (one per parameter)
        hooks = {len(getattr(p, "_post_accumulate_grad_hooks", None) or {}) for p in c.parameters()}
        assert hooks == ({1} if where == {True} else {0}), f"chunk {i}: {hooks} gradient hooks"
    return out


def ref_step(model, x, y, n):
    """The unsplit model's step as a pipeline step sums: this step's gradients apart (the mean over
    its n microbatches), then added to the `.grad` of the steps before."""
    old = [p.grad for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    reference_grads(model, x, y, n)
    with torch.no_grad():
        for p, g in zip(model.parameters(), old):
            if g is not None:
                p.grad = g.add_(p.grad)


def snapshot(model, pipe):
    return (
        [(p.detach().clone(), None if p.grad is None else p.grad.clone()) for p in model.parameters()],
        [list(m.pinned) for m in pipe.modules if hasattr(m, "pinned")],
        list(pipe.offload_plan),
    )


def assert_unchanged(model, pipe, snap):
    params, pins, plan = snapshot(model, pipe)
    for (p, g), (q, h) in zip(params, snap[0]):
        assert torch.equal(p, q)
        assert (g is None) == (h is None) and (g is None or torch.equal(g, h))
    assert pins == snap[1] and plan == snap[2]
    for m in pipe.modules:
        if hasattr(m, "pinned"):
            assert at_home(m) == [i for i in range(len(m.parts)) if i not in m.pinned]


@pytest.mark.parametrize("form", list(SPECS))
@pytest.mark.parametrize("overlap", [True, False], ids=["threads", "serial"])
def test_repinning_between_steps_is_bit_identical(form, overlap):
    ref, mine, pipe = three_stages(overlap)
    _, plain, still = three_stages(overlap)  # the same pipeline, never re-pinned
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (ref, pipe, still)]
    changed = 0

    def repin(spec, opt):
        nonlocal changed
        before = [list(m.pinned) for m in (pipe.modules[0], pipe.modules[2])]
        out = pipe.set_offload_pinned(spec, optimizers=opt)
        assert out and set(out) <= {0, 2}
        changed += before != [list(m.pinned) for m in (pipe.modules[0], pipe.modules[2])]
        for m in (pipe.modules[0], pipe.modules[2]):
            assert at_home(m) == [i for i in range(3) if i not in m.pinned]

    for it, spec in enumerate(SPECS[form]):
        for accum in range(2):  # two steps summed into .grad: re-pinned between them
            x, y = batch(seed=10 * it + accum)
            ref_step(ref, x, y, 4)
            for p in (pipe, still):
                p.step(x, targets=y, loss_fn=F.mse_loss, n_microbatches=4, schedule=("1f1b", "gpipe")[it % 2])
            if accum == 0:  # an unflushed .grad moves with its chunk
                repin(spec, [opts[1]])
                assert_same(mine, ref)
        for o in opts:
            o.step()
        assert_same(mine, ref)
        assert_same(plain, ref)
        for o in opts:
            o.zero_grad()
        repin(SPECS[form][(it + 2) % 4], opts[1])  # the optimizer's state stays with its parameters
    assert changed >= 6  # the pins did move
    x, _ = batch(seed=99)
    with torch.no_grad():
        want = ref(x)
    assert torch.equal(pipe.infer(x, n_microbatches=2), want)
    pipe.close()
    still.close()


def test_the_forms_pick_the_stages_and_chunks():
    _, _, pipe = three_stages()
    st0, st2 = pipe.modules[0], pipe.modules[2]
    assert set(pipe.set_offload_pinned(2)) == {0, 2} and st0.pinned == st2.pinned == [0, 1]  # spaced(2, 3)
    assert set(pipe.set_offload_pinned({2})) == {0, 2} and st0.pinned == st2.pinned == [2]
    assert set(pipe.set_offload_pinned([None, None, [0, 1]])) == {2} and (st0.pinned, st2.pinned) == (
        [2],
        [0, 1],
    )
    assert set(pipe.set_offload_pinned({0: 3})) == {0} and (st0.pinned, st2.pinned) == ([0, 1, 2], [0, 1])
    assert pipe.set_offload_pinned([None, None, None]) == {}
    pipe.close()


BAD = [
    (True, TypeError, "pinned must be .*; got bool"),
    ({0: False}, TypeError, r"pinned\[0\] must be a count or chunk indices, got a bool"),
    ("01", TypeError, "pinned must be"),
    (1.5, TypeError, "pinned must be"),
    (None, TypeError, "pinned must be"),
    (-1, ValueError, r"a count must be in \[0, 3\]"),
    (4, ValueError, r"a count must be in \[0, 3\]"),
    ({3}, ValueError, r"chunk indices must be in \[0, 3\)"),
    ({0, -1}, ValueError, r"got \[-1\]"),
    ({0, 1.0}, TypeError, "chunk indices must be ints"),
    ([1, None], ValueError, "2 entries for 3 stages"),
    ([1, 1, 1], ValueError, r"stage\(s\) \[1\], which are resident"),
    ({1: 1}, ValueError, r"stage\(s\) \[1\], which are resident"),
    ({7: 1}, ValueError, "stages 0-2"),
    ({-1: 1}, ValueError, "stages 0-2"),
    ({"0": 1}, TypeError, "keys must be stage indices"),
    ({0: "01"}, TypeError, r"pinned\[0\] must be a count or chunk indices"),
    ([1, None, 9], ValueError, r"pinned\[2\]: a count must be in \[0, 3\]"),  # stage 0's spec is fine
    ({0: [0], 2: [5]}, ValueError, r"pinned\[2\]: chunk indices"),
    ([[0, True], None, None], TypeError, "chunk indices must be ints"),
]


@pytest.mark.parametrize("spec,exc,match", BAD, ids=[repr(b[0]) for b in BAD])
def test_bad_specs_raise_before_anything_changes(spec, exc, match):
    _, mine, pipe = three_stages(offload_pin=1)
    x, y = batch()
    pipe.step(x, targets=y, loss_fn=F.mse_loss, n_microbatches=2)
    snap = snapshot(mine, pipe)
    with pytest.raises(exc, match=match) as info:
        pipe.set_offload_pinned(spec)
    msg = str(info.value)
    assert (
        msg.startswith("Pipeline.set_offload_pinned: ")
        and "pinned" in msg[len("Pipeline.set_offload_pinned") :]
    )
    assert_unchanged(mine, pipe, snap)
    pipe.close()


@pytest.mark.parametrize(
    "kwargs,match",
    [
        ({"optimizers": "adam"}, "optimizers must be"),
        ({"optimizers": [1]}, "optimizers must be"),
        ({"force": 1}, "force"),
    ],
)
def test_bad_optimizers_or_force_raise_before_anything_changes(kwargs, match):
    _, mine, pipe = three_stages()
    snap = snapshot(mine, pipe)
    with pytest.raises(TypeError, match=match):
        pipe.set_offload_pinned(2, **kwargs)
    assert_unchanged(mine, pipe, snap)
    pipe.close()


def test_a_pipeline_without_streamed_stages_is_refused():
    kids = list(blocks(4))
    pipe = Pipeline(stage_modules=[kids[:2], kids[2:]], devices=["cpu"] * 2, offload=False)
    with pytest.raises(ValueError, match="no streamed stages"):
        pipe.set_offload_pinned(1)
    pipe.close()
    pipe.close()
    with pytest.raises(RuntimeError, match="closed"):
        pipe.set_offload_pinned(1)


def test_the_summary_matches_the_stages():
    _, mine, pipe = three_stages(offload_pin=1)
    x, y = batch()
    pipe.step(x, targets=y, loss_fn=F.mse_loss, n_microbatches=2)
    st0, st2 = pipe.modules[0], pipe.modules[2]
    assert st0.pinned == st2.pinned == [0]
    nbytes = [sum(p.nbytes for p in c.parameters()) for c in st0.parts]
    out = pipe.set_offload_pinned({0: [1, 2], 2: [0]})
    s, u = out[0], out[2]
    assert (s["pinned"], s["unpinned"], s["pinned_before"], s["pinned_after"]) == ([1, 2], [0], [0], [1, 2])
    assert s["bytes_moved"] == sum(nbytes) == 3 * 624 and s["grads_discarded"] is False
    assert (u["pinned"], u["unpinned"], u["bytes_moved"], u["pinned_after"]) == ([], [], 0, [0])
    for k, st in ((0, st0), (2, st2)):
        res = [c for i, c in enumerate(st.parts) if i not in at_home(st)]
        assert out[k]["pinned_after"] == [i for i in range(3) if i not in at_home(st)]
        assert out[k]["resident_bytes"] == sum(p.nbytes for c in res for p in c.parameters())
        assert out[k]["resident_grad_bytes"] == sum(p.grad.nbytes for c in res for p in c.parameters())
        assert out[k]["streamed_bytes"] == sum(s.home.nbytes for b in st.streamer.blocks for s in b.slabs)
        assert out[k]["device"] == "cpu" and out[k]["plan"] is pipe.offload_plan[k // 2]
        plan = pipe.offload_plan[k // 2]
        assert plan.pinned == tuple(out[k]["pinned_after"]) and plan.pin == len(plan.pinned)
        slots = min(2, 3 - len(plan.pinned))  # window 2, the chunk's parameters + gradients each
        assert plan.device_bytes == out[k]["device_bytes"] == len(plan.pinned) * 2496 + slots * 1248
        assert plan.chosen == () and plan.budget is None is out[k]["budget"]
    assert (
        s["resident_bytes"] == 2 * 624 and s["resident_grad_bytes"] == 2 * 624 and s["streamed_bytes"] >= 624
    )
    pipe.close()


class Gate(nn.Module):
    """Identity that, when armed, says it is running and waits to be released."""

    def __init__(self) -> None:
        super().__init__()
        self.armed, self.inside, self.go = False, threading.Event(), threading.Event()

    def forward(self, x):
        if self.armed:
            self.armed = False
            self.inside.set()
            assert self.go.wait(30)
        return x


def test_refused_while_a_step_runs_or_a_stream_is_open():
    ref = blocks(6)
    kids = list(copy.deepcopy(ref))
    gate = Gate()
    pipe = Pipeline(stage_modules=[kids[:3], nn.Sequential(*kids[3:], gate)], devices=["cpu"] * 2)
    x, y = batch()
    gate.armed = True
    box = {}
    t = threading.Thread(target=lambda: box.setdefault("r", pipe.step(x, targets=y, loss_fn=F.mse_loss)))
    t.start()
    assert gate.inside.wait(30)
    try:
        with pytest.raises(RuntimeError, match="step\\(\\) or infer\\(\\) is running"):
            pipe.set_offload_pinned(2)
    finally:
        gate.go.set()
        t.join(30)
    assert "r" in box and pipe.modules[0].pinned == []
    stream = pipe.infer_open()
    with pytest.raises(RuntimeError, match="infer_open\\(\\) stream is open"):
        pipe.set_offload_pinned(2)
    stream.close()
    assert pipe.set_offload_pinned(2)[0]["pinned_after"] == [0, 1]
    pipe.close()


def test_refused_from_inside_a_stage_on_the_callers_thread():
    kids = list(blocks(4))
    seen = []

    class Call(nn.Module):
        def forward(self, x):
            try:
                pipe.set_offload_pinned(1)
            except RuntimeError as e:
                seen.append(str(e))
            return x

    pipe = Pipeline(
        stage_modules=[kids[:2], nn.Sequential(*kids[2:], Call())], devices=["cpu"] * 2, overlap=False
    )
    x, y = batch()
    run_with_timeout(lambda: pipe.step(x, targets=y, loss_fn=F.mse_loss, n_microbatches=2))
    assert len(seen) == 2 and "re-pin between steps" in seen[0] and pipe.modules[0].pinned == []
    pipe.close()


def test_the_device_memory_budget_refuses_with_the_arithmetic_unless_forced():
    # a chunk (Linear 12x12 + Tanh): 624 B of parameters, 624 of gradients, 1248 of AdamW state
    _, mine, pipe = _budgeted()
    assert pipe.offload_plan[0].budget == 3744 and pipe.offload_plan[0].device_bytes == 1248
    assert pipe.set_offload_pinned(1)[0]["device_bytes"] == 2496 + 1248 == 3744  # exactly fits
    snap = snapshot(mine, pipe)
    with pytest.raises(MemoryError) as info:
        pipe.set_offload_pinned([[0, 2], None])
    msg = str(info.value)
    assert "stage 0 with chunks [0, 2] pinned needs 4992 B resident" in msg
    assert (
        "window 1 x 1248 B" in msg
        and "= 6240 B" in msg
        and "> its budget 3744 B" in msg
        and "force=True" in msg
    )
    assert_unchanged(mine, pipe, snap)
    out = pipe.set_offload_pinned([[0, 2], None], force=True)
    assert out[0]["pinned_after"] == [0, 2] and out[0]["device_bytes"] == 6240 and out[0]["budget"] == 3744
    assert pipe.offload_plan[0].device_bytes == 6240 and at_home(pipe.modules[0]) == [1, 3]
    assert pipe.set_offload_pinned(0)[0]["device_bytes"] == 1248
    pipe.close()


def _budgeted():
    ref = blocks(6)
    mine = copy.deepcopy(ref)
    kids = list(mine)
    pipe = Pipeline(
        stage_modules=[kids[:4], nn.Sequential(*kids[4:])],
        devices=["cpu"] * 2,
        offload_window=1,
        offload_pin=0,
        device_memory=[3744, None],
    )
    return ref, mine, pipe


def test_a_failure_while_applying_undoes_every_stage(monkeypatch):
    ref, mine, pipe = three_stages(offload_pin=1)
    x, y = batch()
    pipe.step(x, targets=y, loss_fn=F.mse_loss, n_microbatches=2)
    snap = snapshot(mine, pipe)
    real, calls = streamed_mod.frozen_slabs, []

    def flaky(*a, **kw):  # stage 0's new slabs build; stage 2's run out of memory
        calls.append(1)
        if len(calls) == 2:
            raise MemoryError("no pinned memory left (test)")
        return real(*a, **kw)

    monkeypatch.setattr(streamed_mod, "frozen_slabs", flaky)
    with pytest.raises(MemoryError, match="test"):
        pipe.set_offload_pinned(set())  # stage 0 unpins chunk 0, then stage 2 fails
    assert len(calls) == 2
    monkeypatch.setattr(streamed_mod, "frozen_slabs", real)
    assert_unchanged(mine, pipe, snap)
    reference_grads(ref, x, y, 2)
    opt_ref, opt = torch.optim.AdamW(ref.parameters(), lr=1e-2), torch.optim.AdamW(mine.parameters(), lr=1e-2)
    opt_ref.step()
    opt.step()
    for it in range(2):  # and it trains on as the unsplit model
        opt_ref.zero_grad()
        opt.zero_grad()
        x, y = batch(seed=it + 5)
        reference_grads(ref, x, y, 2)
        pipe.step(x, targets=y, loss_fn=F.mse_loss, n_microbatches=2)
        opt_ref.step()
        opt.step()
        assert_same(mine, ref)
    pipe.close()


def test_interleaved_pieces_are_keyed_by_module_index():
    ref = blocks(8)
    mine = copy.deepcopy(ref)
    kids = list(mine)
    pieces = [kids[0:2], kids[2:4], kids[4:6], kids[6:8]]  # 2 stages x 2 chunks each, all streamed
    pipe = Pipeline(stage_modules=pieces, chunks_per_stage=2, devices=["cpu"] * 2)
    opt_ref, opt = torch.optim.AdamW(ref.parameters(), lr=1e-2), torch.optim.AdamW(pipe.parameters(), lr=1e-2)
    for it, spec in enumerate([{3: 2, 0: [1]}, [None, 1, [0], None], 0]):
        x, y = batch(seed=it)
        reference_grads(ref, x, y, 4)
        pipe.step(x, targets=y, loss_fn=F.mse_loss, n_microbatches=4, schedule="interleaved")
        out = pipe.set_offload_pinned(spec, optimizers=opt)
        assert [pipe.offload_plan[k].pinned for k in out] == [tuple(v["pinned_after"]) for v in out.values()]
        opt_ref.step()
        opt.step()
        opt_ref.zero_grad()
        opt.zero_grad()
        assert_same(mine, ref)
    assert [m.pinned for m in pipe.modules] == [[], [], [], []]
    pipe.close()
