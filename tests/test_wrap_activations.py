"""wrap()'s activation paging options on the CPU engine (the mechanism: test_activations.py)."""

from __future__ import annotations

import pytest
import torch

import ramstream

from _models import batches, clone, make_model, train_torch


def _run(model, **options):
    model, opt = ramstream.wrap(
        model, torch.optim.AdamW(model.parameters(), lr=3e-3), offload=True, **options
    )
    losses = train_torch(model, opt, batches(6))
    opt.synchronize()
    return model, losses


@pytest.mark.parametrize("setting, paged", [(True, [0, 1, 2]), (0.34, [0]), (False, [])])
def test_paging_is_bit_exact_and_follows_the_option(setting, paged):
    base = make_model(0)
    plain, plain_losses = _run(clone(base))
    model, losses = _run(clone(base), activation_offload=setting, min_offload_bytes=0)
    assert losses == plain_losses
    for a, b in zip(plain.parameters(), model.parameters()):
        assert torch.equal(a.detach(), b.detach())
    r = ramstream.memory_report(model)
    assert r["activations"]["paged_blocks"] == paged
    if paged:
        assert r["plan"]["activations"]["stats"]["bytes_d2h"] > 0


def test_auto_on_the_cpu_engine_pages_nothing():
    model, _ = _run(make_model(0), activation_offload="auto")
    r = ramstream.memory_report(model)
    assert r["activations"]["paged_blocks"] == []
    assert any("no VRAM to save" in e for e in r["events"])


def test_explicit_blocks_and_unwrap_detaches():
    model = make_model(0)
    model, opt = ramstream.wrap(model, lr=1e-3, activation_offload=True, blocks=[model.blocks[2]])
    train_torch(model, opt, batches(2))
    assert ramstream.memory_report(model)["activations"]["paged_blocks"] == [0]
    ramstream.unwrap(model)
    x, y = batches(1)[0]
    model(x, y).backward()  # no saved-tensor hooks left behind


@pytest.mark.parametrize(
    "options, match",
    [
        (dict(activation_offload="yes"), "activation_offload"),
        (dict(activation_offload=1.5), "activation_offload"),
        (dict(prefetch_depth=0), "prefetch_depth"),
        (dict(min_offload_bytes=-1), "min_offload_bytes"),
        (dict(max_activation_slowdown=float("nan")), "max_activation_slowdown"),
        (dict(blocks=[]), "blocks"),
        (dict(blocks=["layer"]), "blocks"),
    ],
)
def test_bad_activation_options(options, match):
    with pytest.raises(ValueError, match=match):
        ramstream.wrap(make_model(0), **options)
