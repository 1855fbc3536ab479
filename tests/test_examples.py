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
    for package in {"hf_finetune": ["transformers"], "lora_large_model": ["transformers", "peft"]}.get(
        name, []
    ):
        pytest.importorskip(package)
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


# ---- the GPU paths (run with -m cuda on the GPU machine) ------------------------------------------
def _run_gpu(name: str, *args: str) -> str:
    env = dict(os.environ)
    pkg = os.path.dirname(os.path.dirname(ramstream.__file__))
    env["PYTHONPATH"] = os.pathsep.join(p for p in (pkg, env.get("PYTHONPATH")) if p)
    r = subprocess.run(
        [sys.executable, os.path.join(EXAMPLES, name + ".py"), *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    return r.stdout


@pytest.mark.cuda
def test_train_bigger_than_vram_fits_the_1_8b_gpt_in_4_gib_cuda():
    out = _run_gpu("train_bigger_than_vram", "--steps", "3")
    peak = _number(out, r"peak VRAM ([\d.]+) GiB \(cap 4\)")
    assert 0 < peak <= 4.0
    losses = [float(x) for x in re.findall(r"step \d+: loss ([\d.]+)", out)]
    assert len(losses) == 3 and all(0 < x < 20 for x in losses)


@pytest.mark.cuda
def test_verify_ram_offload_passes_on_the_gpu_cuda():
    out = _run_gpu(
        "verify_ram_offload", "--size", "350m", "--steps", "2", "--param-offload", "--cap-gib", "8"
    )
    assert "verdict: PASS" in out and "FAIL" not in out


@pytest.mark.cuda
def test_lora_large_model_7b_shape_nf4_cuda():
    pytest.importorskip("peft")
    out = _run_gpu(
        "lora_large_model",
        "--size",
        "7b",
        "--layers",
        "4",
        "--quantize",
        "nf4",
        "--steps",
        "3",
        "--seq",
        "256",
    )
    assert int(_number(out, r"(\d+) packed Linear")) == 4 * 7
    assert len(re.findall(r"step \d+: loss", out)) == 3


@pytest.mark.cuda
def test_hf_finetune_on_the_gpu_cuda():
    out = _run_gpu(
        "hf_finetune", "--hidden", "256", "--layers", "2", "--vocab", "1024", "--seq", "128", "--steps", "5"
    )
    # bf16 autocast on both sides, fp32 updates on both: the curves stay together
    assert _number(out, r"max \|loss difference\| = (\S+)") < 5e-3
