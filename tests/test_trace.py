"""ramstream.trace and OffloadModel.step(profile_path=...): the file is JSON in the Trace Event
Format Perfetto reads (the fields of every "X" and "M" event checked), its spans order and nest
as the streamer's schedule says (loads before the chunk's forward, backward in reverse order,
write-backs inside the backward), a wrap() run is traced the same way (host optimizer work
included), and no hook stays behind when no trace is active."""

from __future__ import annotations

import json
import os

import pytest
import torch
import torch.nn as nn

import ramstream

from _models import batches, make_model

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)]


def _chunks(n=4, d=32):
    torch.manual_seed(0)
    return [nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d)) for _ in range(n)]


def _load(path):
    with open(path) as f:
        doc = json.load(f)
    assert set(doc) >= {"traceEvents"}
    events = doc["traceEvents"]
    for ev in events:
        assert ev["ph"] in ("X", "M")
        assert isinstance(ev["name"], str) and isinstance(ev["pid"], int) and isinstance(ev["tid"], int)
        if ev["ph"] == "X":  # complete events: ts and dur in microseconds, dur >= 0
            assert isinstance(ev["ts"], (int, float)) and isinstance(ev["dur"], (int, float))
            assert ev["dur"] >= 0 and isinstance(ev["cat"], str)
        else:
            assert ev["name"] in ("process_name", "thread_name") and isinstance(ev["args"]["name"], str)
    return [ev for ev in events if ev["ph"] == "X"], [ev for ev in events if ev["ph"] == "M"]


# The writer rounds "ts" and "dur" to 3 decimals of a microsecond (1 ns; trace.Tracer.events), so
# spans are compared in integer nanoseconds: a start is within 0.5 ns of its clock reading and an
# end (ts + dur) within 1 ns, so two times in order can read up to 2 ns out of order.
ROUNDING_NS = 2


def _start(s) -> int:
    return round(s["ts"] * 1000)


def _end(s) -> int:
    return _start(s) + round(s["dur"] * 1000)


def _by_name(spans, name):
    return [s for s in spans if s["name"] == name]


def _no_partial_overlap(spans):
    """Spans on one track either nest or are disjoint (what the format requires of X events)."""
    by_tid: dict = {}
    for s in spans:
        by_tid.setdefault(s["tid"], []).append((_start(s), _end(s)))
    for ivs in by_tid.values():
        ivs.sort()
        for (a0, a1), (b0, b1) in zip(ivs, ivs[1:]):
            assert b0 >= a1 - ROUNDING_NS or b1 <= a1 + ROUNDING_NS, (a0, a1, b0, b1)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("keep", [True, False])
def test_offload_step_trace_follows_the_schedule(tmp_path, device, keep):
    model = ramstream.OffloadModel(_chunks(), device=device, window=2, pin_layers=[2], keep_activations=keep)
    x, y = torch.randn(16, 32, device=device), torch.randn(16, 32, device=device)
    model.step(x, targets=y)  # warm
    path = tmp_path / "step.json"
    model.step(x, targets=y, profile_path=str(path))
    assert os.listdir(tmp_path) == ["step.json"]  # written to a temporary name and renamed
    spans, meta = _load(path)
    assert {m["args"]["name"] for m in meta if m["name"] == "thread_name"} >= {
        "compute",
        "H2D (weight loads)",
    }
    _no_partial_overlap(spans)
    (step,) = _by_name(spans, "step")
    fwd = [_by_name(spans, f"forward {k}")[0] for k in range(4)]
    bwd = [_by_name(spans, f"backward {k}")[0] for k in range(4)]
    for a, b in zip(fwd, fwd[1:]):
        assert _end(a) <= _start(b) + ROUNDING_NS
    for a, b in zip(bwd[::-1], bwd[::-1][1:]):  # backward runs chunk 3, 2, 1, 0
        assert _end(a) <= _start(b) + ROUNDING_NS
    assert _end(fwd[3]) <= _start(bwd[3]) + ROUNDING_NS
    for s in fwd + bwd:  # the step span is host time, the others may be GPU time: 1 ms apart at most
        assert _start(step) - 10**6 <= _start(s) and _end(s) <= _end(step) + 10**6
    loads = [s for s in spans if s["cat"] == "h2d"]
    assert 2 not in {s["args"]["chunk"] for s in loads}  # the pinned chunk never loads
    for k in (0, 1, 3):  # each chunk's first load ends before its forward starts
        first = min((s for s in loads if s["args"]["chunk"] == k), key=lambda s: s["ts"])
        assert _end(first) <= _start(fwd[k]) + ROUNDING_NS
    # chunk 0's reload for backward (window 2: the forward kept streamed chunks 1 and 3 only)
    assert [len([s for s in loads if s["args"]["chunk"] == k]) for k in (0, 1, 3)] == [2, 1, 1]
    writes = [s for s in spans if s["cat"] == "d2h"]
    assert {s["args"]["chunk"] for s in writes} == {0, 1, 3}  # the pinned chunk's grads stay
    for s in writes:
        assert _start(s) >= _start(bwd[s["args"]["chunk"]]) - ROUNDING_NS
    for s in _by_name(spans, "stall"):  # only in the compute track's gaps
        assert s["tid"] == fwd[0]["tid"]
    model.close()


def test_trace_context_around_offload_steps_and_no_hooks_outside(tmp_path):
    chunks = _chunks(3)
    model = ramstream.OffloadModel(chunks, device="cpu", window=2, keep_activations="checkpoint")
    hooks = [(len(c._forward_pre_hooks), len(c._forward_hooks)) for c in chunks]
    x, y = torch.randn(8, 32), torch.randn(8, 32)
    with ramstream.trace(tmp_path / "t.json") as tr:
        assert ramstream.trace is not None and tr is not None
        for _ in range(2):
            model.step(x, targets=y)
        with pytest.raises(ValueError, match="profile_path"):
            model.step(x, targets=y, profile_path=str(tmp_path / "inner.json"))
        with pytest.raises(RuntimeError, match="already"):
            with ramstream.trace(tmp_path / "other.json"):
                pass
    assert [(len(c._forward_pre_hooks), len(c._forward_hooks)) for c in chunks] == hooks
    spans, _ = _load(tmp_path / "t.json")
    assert len(_by_name(spans, "step")) == 2 and len(_by_name(spans, "forward 0")) == 2
    assert len(_by_name(spans, "backward 2")) == 2
    model.close()


def test_a_failed_traced_step_still_writes_and_unhooks(tmp_path):
    chunks = _chunks(2)
    model = ramstream.OffloadModel(chunks, device="cpu", window=2)

    def bad_loss(out, t):
        raise KeyError("loss")

    with pytest.raises(KeyError):
        model.step(
            torch.randn(4, 32), targets=torch.randn(4, 32), loss_fn=bad_loss, profile_path=tmp_path / "f.json"
        )
    spans, _ = _load(tmp_path / "f.json")
    assert _by_name(spans, "forward 1") and not _by_name(spans, "backward 1")
    assert ramstream.trace.__module__ == "ramstream.trace"
    from ramstream.trace import current

    assert current() is None
    res = model.step(torch.randn(4, 32), targets=torch.randn(4, 32))  # usable, untraced
    assert res.loss.ndim == 0
    model.close()


@pytest.mark.parametrize("param_offload", [False, True])
def test_wrap_training_is_traced(tmp_path, param_offload):
    model = make_model(n_blocks=3)
    model, opt = ramstream.wrap(
        model, torch.optim.AdamW(model.parameters(), lr=1e-2), device="cpu", param_offload=param_offload
    )
    data = batches(3)
    path = tmp_path / "wrap.json"
    with ramstream.trace(path):
        for idx, tgt in data:
            model(idx, tgt).backward()
            opt.step()
            opt.zero_grad()
    spans, _ = _load(path)
    _no_partial_overlap([s for s in spans if s["cat"] != "host optimizer"])
    assert len(_by_name(spans, "forward 0")) == 3 and len(_by_name(spans, "backward 2")) == 3
    host = [s for s in spans if s["cat"] == "host optimizer"]
    assert any(s["name"].startswith("adamw bucket") for s in host)
    assert [s for s in spans if s["cat"] == "d2h"]  # gradients to the landing buffers
    if param_offload:
        assert {s["args"]["chunk"] for s in spans if s["cat"] == "h2d" and "chunk" in s.get("args", {})} == {
            0,
            1,
            2,
        }
    ramstream.unwrap(model)


def test_trace_into_a_missing_folder_fails_at_entry_before_anything_runs(tmp_path):
    chunks = _chunks(2)
    model = ramstream.OffloadModel(chunks, device="cpu", window=2)
    before = [p.detach().clone() for p in model.parameters()]
    calls = []
    chunks[0].register_forward_pre_hook(lambda m, a: calls.append(1))
    missing = tmp_path / "missing" / "t.json"
    with pytest.raises(FileNotFoundError, match=f"its folder '{tmp_path / 'missing'}' does not exist"):
        with ramstream.trace(missing):
            model.step(torch.randn(4, 32), targets=torch.randn(4, 32))
    with pytest.raises(FileNotFoundError, match="does not exist"):
        model.step(torch.randn(4, 32), targets=torch.randn(4, 32), profile_path=missing)
    with pytest.raises(IsADirectoryError, match="is a folder"):
        ramstream.trace(tmp_path)
    assert calls == [] and not os.path.exists(missing.parent)
    assert all(torch.equal(a, b.detach()) for a, b in zip(before, model.parameters()))
    from ramstream.trace import current

    assert current() is None
    model.close()
