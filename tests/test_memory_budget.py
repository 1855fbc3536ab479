"""Tests of the pinned host arena's page-lock budget: set_pin_budget's forms and errors,
allocation with a zero budget, RAMSTREAM_PIN_BUDGET read at start-up."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import warnings

import pytest
import torch

import ramstream

# restore_budget is a fixture: pytest finds it here once imported
from _memory_helpers import (
    MiB,
    random_like,
    restore_budget,  # noqa: F401
    stats,
)

# ---- budget ----------------------------------------------------------------------------------


def test_set_pin_budget_forms(restore_budget):
    ram = stats()["physical_memory"]
    assert ramstream.set_pin_budget(123456789) == 123456789
    assert ramstream.pin_budget() == 123456789 == stats()["budget"]
    assert stats()["budget_source"] == "set_budget"
    assert ramstream.set_pin_budget(0.25) == int(ram * 0.25) == ramstream.pin_budget()
    for text, want in [
        ("1M", MiB),
        ("512k", 512 * 1024),
        ("1.5G", 3 << 29),
        ("64MiB", 64 * MiB),
        (" 2 gb ", 2 << 30),
        ("1T", 1 << 40),
        ("4096", 4096),
        ("100%", ram),
        ("50%", ram * 50 // 100),
        ("0", 0),
    ]:
        assert ramstream.set_pin_budget(text) == want, text
        assert ramstream.pin_budget() == want, text


@pytest.mark.parametrize(
    "bad,exc",
    [
        (-1, ValueError),
        (1.5, ValueError),
        (float("nan"), ValueError),
        ("abc", ValueError),
        ("", ValueError),
        ("-1G", ValueError),
        ("1X", ValueError),
        ("101%", ValueError),
        ("1e9", ValueError),
        (True, TypeError),
        (None, TypeError),
        ([1], TypeError),
    ],
)
def test_set_pin_budget_bad(bad, exc, restore_budget):
    with pytest.raises(exc, match="set_pin_budget|cannot parse"):
        ramstream.set_pin_budget(bad)
    assert ramstream.pin_budget() == restore_budget


def test_allocation_works_with_zero_budget(restore_budget):
    ramstream.set_pin_budget(0)
    gen = torch.Generator().manual_seed(3)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        t = ramstream.pinned_empty((300, 7), torch.bfloat16)
    ref = random_like((300, 7), torch.bfloat16, gen)
    t.copy_(ref)
    assert torch.equal(t + 1, ref + 1)
    s = stats()
    assert s["bytes_pinned"] + s["bytes_registered"] <= max(s["budget"], s["bytes_pinned"])


def _run_with_env(value: str | None) -> subprocess.Popen:
    code = (
        "import json, warnings\n"
        "warnings.simplefilter('always')\n"
        "with warnings.catch_warnings(record=True) as w:\n"
        "    import ramstream\n"
        "    s = ramstream.memory_stats()\n"
        "print(json.dumps({'budget': s['budget'], 'source': s['budget_source'],\n"
        "                  'error': s['budget_error'], 'ram': s['physical_memory'],\n"
        "                  'warnings': [str(x.message) for x in w\n"
        "                               if issubclass(x.category, RuntimeWarning)]}))\n"
    )
    env = dict(os.environ)
    env.pop("RAMSTREAM_PIN_BUDGET", None)
    if value is not None:
        env["RAMSTREAM_PIN_BUDGET"] = value
    return subprocess.Popen(
        [sys.executable, "-c", code],
        env=env,
        cwd="/",
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def test_budget_from_env():
    cases = {"1M": None, "50%": None, "lots": None, None: None, "3.5g": None}
    procs = {k: _run_with_env(k) for k in cases}
    out = {}
    for k, p in procs.items():
        so, se = p.communicate(timeout=120)
        assert p.returncode == 0, se
        out[k] = json.loads(so.strip().splitlines()[-1])
    ram = out[None]["ram"]
    default = int(ram * 0.5)
    assert out[None]["budget"] == default and out[None]["error"] == "" and not out[None]["warnings"]
    assert out["1M"]["budget"] == MiB and out["1M"]["source"] == "RAMSTREAM_PIN_BUDGET=1M"
    assert out["3.5g"]["budget"] == 7 << 29
    assert out["50%"]["budget"] == ram * 50 // 100 and out["50%"]["error"] == ""
    bad = out["lots"]
    assert bad["budget"] == default  # reported, not fatal
    assert "RAMSTREAM_PIN_BUDGET" in bad["error"] and "'lots'" in bad["error"]
    assert len(bad["warnings"]) == 1 and "lots" in bad["warnings"][0]
