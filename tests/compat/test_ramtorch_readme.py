"""RamTorch's README lines for OffloadModel that tests/compat/test_ramtorch_offload_model.py does
not run: autocast wrapped around step() (RamTorch: bit-identical to the resident model in every
backward mode) and step(profile_path=...) writing a trace Perfetto opens; against torch."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F
from test_ramtorch_offload_model import assert_same_weights, make_chunks, make_data, reference

from ramstream import OffloadModel


@pytest.mark.parametrize("keep", [False, True, "checkpoint"])
def test_autocast_around_step_is_bit_identical_to_the_resident_model(keep):
    chunks = make_chunks()
    ref, ref_opt = reference(chunks)
    model = OffloadModel(chunks, device="cpu", window=2, pin=1, keep_activations=keep)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    for x, y in make_data(3):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            res = model.step(x, targets=y, loss_fn=F.cross_entropy)
        model.flush_grads()
        opt.step()
        opt.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = F.cross_entropy(ref(x), y)
        loss.backward()
        ref_opt.step()
        ref_opt.zero_grad()
        assert res.output.dtype == torch.bfloat16  # the chunks ran under autocast
        assert torch.equal(res.loss, loss.detach())
    assert_same_weights(ref, model)
    model.close()


def test_step_profile_path_writes_a_trace_and_changes_no_number(tmp_path):
    chunks = make_chunks(n=3)
    ref, ref_opt = reference(chunks)
    model = OffloadModel(chunks, device="cpu", window=2)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    path = tmp_path / "offload.trace.json"
    x, y = make_data(1)[0]
    res = model.step(x, targets=y, loss_fn=F.cross_entropy, profile_path=str(path))
    model.flush_grads()
    opt.step()
    loss = F.cross_entropy(ref(x), y)
    loss.backward()
    ref_opt.step()
    assert torch.equal(res.loss, loss.detach())
    assert_same_weights(ref, model)
    trace = json.loads(path.read_text())
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    assert any(e.get("ph") == "X" and e.get("dur", 0) >= 0 for e in events)  # compute spans
    model.close()
