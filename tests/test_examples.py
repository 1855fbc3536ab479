"""examples/: each runs with --help, and with --tiny on the CPU as a subprocess, where its printed
numbers are checked (losses beside the stock Trainer or torch, host state bytes, the verdict)."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

import ramstream

EXAMPLES = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples")
NAMES = ["hf_finetune", "lora_large_model", "train_bigger_than_vram", "verify_ram_offload"]
TOL = 2e-4


def _run(name: str, *args: str, rc: int = 0) -> str:
    env = dict(os.environ, OMP_NUM_THREADS="2", CUDA_VISIBLE_DEVICES="")  # the CPU path, as in CI
    pkg = os.path.dirname(os.path.dirname(ramstream.__file__))
    env["PYTHONPATH"] = os.pathsep.join(p for p in (pkg, env.get("PYTHONPATH")) if p)
    r = subprocess.run(
        [sys.executable, os.path.join(EXAMPLES, name + ".py"), *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == rc, r.stdout[-3000:] + r.stderr[-3000:]
    return r.stdout


def _number(out: str, pattern: str) -> float:
    m = re.search(pattern, out)
    assert m, out[-3000:]
    return float(m.group(1).replace(",", ""))


@pytest.mark.parametrize("name", NAMES)
def test_every_example_answers_help(name):
    out = _run(name, "--help")
    assert out.startswith("usage:") and "--tiny" in out
    with open(os.path.join(EXAMPLES, name + ".py")) as f:
        assert f.readline().startswith('"""Example: ')  # one line says what it is for


def test_hf_finetune_prints_both_trainers_losses():
    pytest.importorskip("transformers")
    out = _run("hf_finetune", "--tiny")
    rows = re.findall(r"^\s+(\d+)\s+([\d.]+)\s+([\d.]+)$", out, re.M)
    assert [int(r[0]) for r in rows] == [1, 2, 3]
    assert max(abs(float(a) - float(b)) for _, a, b in rows) < TOL
    assert _number(out, r"max \|loss difference\| = (\S+)") < TOL
    assert "stock:" in out and "ramstream:" in out


@pytest.mark.parametrize("quantize", ["none", "nf4"])
def test_lora_large_model_offloads_only_adapters(quantize):
    pytest.importorskip("peft")
    out = _run("lora_large_model", "--tiny", "--compare-stock", "--quantize", quantize)
    assert _number(out, r"max \|loss difference\| = (\S+)") < TOL
    packed = int(_number(out, r"(\d+) packed Linear"))
    assert packed == (0 if quantize == "none" else 14)  # 2 layers x 7 frozen Linears
    host = _number(out, r"host optimizer state ([\d,]+) bytes")
    adapters = _number(out, r"for ([\d,]+) adapter elements")
    # fp32 masters and two fp32 moments for the adapters only, up to bucket alignment padding
    assert adapters * 12 <= host < (adapters + 128 * 16) * 12


def test_train_bigger_than_vram_tiny_matches_torch():
    out = _run("train_bigger_than_vram", "--tiny")
    assert _number(out, r"max \|loss difference\| against torch = (\S+)") < 1e-5
    assert "streamed blocks 6 of 6" in out and "paged activations of 6 blocks" in out


def test_verify_ram_offload_tiny_passes():
    out = _run("verify_ram_offload", "--tiny")
    checks = re.findall(r"^\s+(PASS|FAIL)\s", out, re.M)
    assert len(checks) == 5 and set(checks) == {"PASS"}
    assert "verdict: PASS (5 of 5 checks)" in out
