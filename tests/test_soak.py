"""Soak: 1,000 steps of the CPU engine (tiny GPT, clipping, accumulation, activation paging,
bf16 moments) hold host memory flat after warm-up, and bench/train/soak.py (the GPU soak run)
works end to end on the CPU with its tiny model."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import torch

import ramstream

from _models import make_model

sys.path.insert(0, os.path.join(os.path.dirname(__file__), os.pardir, "bench", "train"))
from soak import flat, rss_bytes  # noqa: E402

STEPS, WARMUP, K = 1000, 100, 2
RSS_SLACK = 16 << 20  # allocator noise; a leak of one 1 KiB tensor per step would pass 1 MiB


def _sample(model) -> dict:
    pool = model._ramstream.activations.off.stats()
    return {
        "pinned_in_use": ramstream.memory_stats()["bytes_in_use"],
        "pinned_held": ramstream.memory_stats()["bytes_pinned"],
        "pool_held": pool["host_bytes_held"],
        "pool_in_use": pool["host_bytes_in_use"],
        "rss": rss_bytes(),
        "live": pool["live_entries"],
    }


def test_thousand_cpu_steps_hold_memory_flat():  # about 5 s on an idle machine
    torch.manual_seed(0)
    model, opt = ramstream.wrap(
        make_model(0, n_blocks=2),
        lr=1e-3,
        device="cpu",
        max_grad_norm=1.0,
        accumulation_steps=K,
        moment_dtype="bf16",
        activation_offload=True,
        min_offload_bytes=0,
        bucket_bytes=1 << 14,
    )
    g = torch.Generator().manual_seed(1)
    data = [
        (torch.randint(0, 64, (2, 8), generator=g), torch.randint(0, 64, (2, 8), generator=g))
        for _ in range(16)
    ]
    samples = {}
    for step in range(1, STEPS + 1):
        for j in range(K):
            x, y = data[(step * K + j) % len(data)]
            model(x, y).backward()
        opt.step()
        opt.zero_grad()
        if step % 100 == 0:
            samples[step] = _sample(model)
    first = samples[WARMUP]
    later = [samples[s] for s in samples if s > WARMUP]
    for s in later:  # the engine's and the pool's own bytes do not move at all
        assert {k: s[k] for k in ("pinned_in_use", "pool_held", "pool_in_use", "live")} == {
            k: first[k] for k in ("pinned_in_use", "pool_held", "pool_in_use", "live")
        }
        assert s["rss"] <= first["rss"] + RSS_SLACK, (s["rss"] - first["rss"]) / 2**20
    assert first["pool_in_use"] == 0 and first["live"] == 0  # nothing held between steps
    assert opt.stats()["steps"] == STEPS
    assert all(torch.isfinite(p).all() for p in model.parameters())


def test_flat_verdict():
    a = {k: 100 << 20 for k in ("pinned_in_use", "pinned_held", "vram_allocated", "vram_reserved", "rss")}
    assert all(flat(a, [dict(a, rss=a["rss"] + (60 << 20))]).values())
    assert not flat(a, [dict(a, rss=a["rss"] + (80 << 20))])["rss"]


def test_soak_script_smoke(tmp_path):
    out = tmp_path / "soak.json"
    script = os.path.join(os.path.dirname(__file__), os.pardir, "bench", "train", "soak.py")
    p = subprocess.run(
        [
            sys.executable,
            script,
            "--model",
            "tiny",
            "--device",
            "cpu",
            "--steps",
            "12",
            "--seq",
            "32",
            "--batch",
            "2",
            "--out",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert p.returncode == 0, p.stderr[-3000:]
    res = json.loads(out.read_text())
    assert [s["step"] for s in res["samples"]] == [10, 12]
    assert res["steps"] == 12 and set(res["flat"]) == {
        "pinned_in_use",
        "pinned_held",
        "vram_allocated",
        "vram_reserved",
        "rss",
    }
    lines = [json.loads(x) for x in p.stdout.splitlines()]
    assert lines[-1]["all_flat"] == all(res["flat"].values())
