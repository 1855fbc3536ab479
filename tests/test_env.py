"""RAMSTREAM_* environment variables (ramstream/env.py, issue 25 item 6): a bad value warns once,
naming the variable, the value, what is accepted and the default used instead, and the C++ core
really uses that default; the Python parser accepts what the core accepts; `ramstream doctor`
reports every variable set, a bad one as a problem; the docs' table (docs/troubleshooting.md) is generated from the
declarations and every variable the sources read is declared."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

import ramstream
from ramstream import doctor, env
from ramstream.cli import main

REPO = Path(__file__).resolve().parents[1]

# variable, bad value, what the warning must say is accepted
BAD = [
    ("RAMSTREAM_NUM_THREADS", "abc", "an integer in [1, 4096]"),
    ("RAMSTREAM_NUM_THREADS", "0", "an integer in [1, 4096]"),
    ("RAMSTREAM_NUM_THREADS", "100000", "an integer in [1, 4096]"),
    ("RAMSTREAM_POOL_SPIN_US", "-5", "an integer in [0, 1000000]"),
    ("RAMSTREAM_FORCE_ISA", "avx9", "scalar, avx2 or avx512"),
    ("RAMSTREAM_PIN_BUDGET", "lots", "bytes with an optional K/M/G/T suffix"),
    ("RAMSTREAM_AVX512BF16", "yes", "0 or 1"),
    ("RAMSTREAM_PIN_METHOD", "fast", "alloc or register"),
]

_IMPORT = (
    "import json, warnings\n"
    "warnings.simplefilter('always')\n"
    "with warnings.catch_warnings(record=True) as w:\n"
    "    import ramstream\n"
    "    from ramstream._native import lib\n"
    "    C = lib()\n"
    "    ramstream.pinned_empty((8,))\n"
    "print(json.dumps({'warnings': [str(x.message) for x in w if issubclass(x.category, RuntimeWarning)],\n"
    "                  'threads': C.num_threads(), 'isa': C.active_isa(), 'best': C.best_isa()}))\n"
)


def _clean_env(**extra) -> dict:
    e = {k: v for k, v in os.environ.items() if not k.startswith("RAMSTREAM_") or k == "RAMSTREAM_CACHE_DIR"}
    return {**e, **extra}


def test_a_bad_value_warns_once_at_import_naming_variable_value_range_and_default():
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", _IMPORT],
            env=_clean_env(**{name: value}),
            cwd="/",
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for name, value, _ in BAD
    ]
    for (name, value, accepted), p in zip(BAD, procs):
        out, err = p.communicate(timeout=300)
        assert p.returncode == 0, err
        got = json.loads(out.strip().splitlines()[-1])
        mine = [w for w in got["warnings"] if name in w]
        assert len(mine) == 1, got["warnings"]  # once, though the pin budget is read again at first use
        w = mine[0]
        assert f"{name}={value!r} is not accepted" in w and accepted in w
        assert "ignored, using the default" in w
        # the core did what the warning says: its default
        if name == "RAMSTREAM_NUM_THREADS":
            assert f"all logical CPUs ({os.cpu_count()} here)" in w
            assert got["threads"] == os.cpu_count()
        if name == "RAMSTREAM_FORCE_ISA":
            assert got["isa"] == got["best"]


def test_no_variable_set_no_warning():
    r = subprocess.run(
        [sys.executable, "-c", _IMPORT],
        env=_clean_env(),
        cwd="/",
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout.strip().splitlines()[-1])["warnings"] == []


def test_the_thread_count_parser_accepts_exactly_what_the_core_accepts(monkeypatch):
    """The core re-reads RAMSTREAM_NUM_THREADS when its pool is resized to the default (0)."""
    C = ramstream._native.lib()
    default = os.cpu_count()
    try:
        for raw in ["3", " 3", "+3", "5", "3 ", "0x3", "3.0", "4097", "-1", "0", "", "abc"]:
            monkeypatch.setenv("RAMSTREAM_NUM_THREADS", raw)
            C.set_num_threads(0)
            r = env.read("RAMSTREAM_NUM_THREADS")
            assert C.num_threads() == (r.value if r.value is not None else default), raw
            assert bool(r.error) == (raw not in ("", "3", " 3", "+3", "5")), raw  # "" counts as unset
    finally:
        monkeypatch.delenv("RAMSTREAM_NUM_THREADS")
        C.set_num_threads(0)


def test_get_warns_once_per_value_and_returns_none(monkeypatch):
    monkeypatch.setenv("RAMSTREAM_POOL_SPIN_US", "1e3")
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        assert env.get("RAMSTREAM_POOL_SPIN_US") is None
        assert env.get("RAMSTREAM_POOL_SPIN_US") is None
    assert len(w) == 1 and w[0].category is RuntimeWarning
    assert "RAMSTREAM_POOL_SPIN_US='1e3'" in str(w[0].message) and "150 us" in str(w[0].message)
    monkeypatch.setenv("RAMSTREAM_POOL_SPIN_US", "40")
    assert env.get("RAMSTREAM_POOL_SPIN_US") == 40


def test_a_cache_dir_that_is_a_file_warns_and_the_default_is_used(monkeypatch, tmp_path):
    from ramstream.planner.profile import cache_dir

    f = tmp_path / "file"
    f.write_text("x")
    monkeypatch.setenv("RAMSTREAM_CACHE_DIR", str(f))
    with pytest.warns(RuntimeWarning, match=r"RAMSTREAM_CACHE_DIR=.*not a folder.*~/.cache/ramstream"):
        assert cache_dir() == os.path.join(os.path.expanduser("~"), ".cache", "ramstream")
    monkeypatch.setenv("RAMSTREAM_CACHE_DIR", str(tmp_path / "new"))
    assert cache_dir() == str(tmp_path / "new")


def test_require_cuda_takes_0_or_1_and_anything_else_is_an_error(monkeypatch):
    monkeypatch.setenv("RAMSTREAM_REQUIRE_CUDA", "1")
    assert env.get("RAMSTREAM_REQUIRE_CUDA") is True
    monkeypatch.setenv("RAMSTREAM_REQUIRE_CUDA", "yes")
    with pytest.raises(ValueError, match=r"RAMSTREAM_REQUIRE_CUDA='yes' is not accepted.*accepted: 0 or 1"):
        env.get("RAMSTREAM_REQUIRE_CUDA")
    # the test session refuses it instead of skipping the GPU tests as if it were unset
    r = subprocess.run(
        [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", __file__],
        env=_clean_env(RAMSTREAM_REQUIRE_CUDA="yes"),
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 4, r.stdout + r.stderr  # pytest's usage error
    assert "RAMSTREAM_REQUIRE_CUDA='yes'" in r.stdout + r.stderr


def _doctor_env(monkeypatch, capsys, **values) -> dict:
    for k in [k for k in os.environ if k.startswith("RAMSTREAM_")]:
        monkeypatch.delenv(k)
    for k, v in values.items():
        monkeypatch.setenv(k, v)
    monkeypatch.setattr(doctor, "CHECKS", (doctor.check_env,))
    rc = main(["doctor", "--json"])
    (c,) = json.loads(capsys.readouterr().out)
    return rc, c


def test_doctor_reports_a_bad_value_as_a_problem_naming_it(monkeypatch, capsys):
    rc, c = _doctor_env(monkeypatch, capsys, RAMSTREAM_NUM_THREADS="abc", RAMSTREAM_POOL_SPIN_US="-5")
    assert rc == 0 and c["status"] == "WARN"  # ignored with a fallback: a warning, nothing broken
    assert "RAMSTREAM_NUM_THREADS=abc (not accepted)" in c["detail"]
    assert "RAMSTREAM_NUM_THREADS='abc' is not accepted" in c["fix"] and "[1, 4096]" in c["fix"]
    assert "RAMSTREAM_POOL_SPIN_US='-5' is not accepted" in c["fix"] and "[0, 1000000]" in c["fix"]


def test_doctor_reports_each_variable_with_its_parsed_value(monkeypatch, capsys):
    rc, c = _doctor_env(
        monkeypatch, capsys, RAMSTREAM_NUM_THREADS=" 3", RAMSTREAM_PIN_BUDGET="8G", RAMSTREAM_CUDA="OFF"
    )
    assert rc == 0 and c["status"] == "OK" and c["fix"] == ""
    assert "RAMSTREAM_NUM_THREADS= 3 (= 3)" in c["detail"]
    assert "RAMSTREAM_PIN_BUDGET=8G (= 8.0 GiB)" in c["detail"]
    assert "RAMSTREAM_CUDA=OFF (build time)" in c["detail"]


def test_doctor_fails_on_a_value_that_is_an_error_where_it_is_read(monkeypatch, capsys):
    rc, c = _doctor_env(monkeypatch, capsys, RAMSTREAM_REQUIRE_CUDA="true")
    assert rc == 1 and c["status"] == "FAIL" and "accepted: 0 or 1" in c["fix"]


def test_the_docs_table_is_generated_from_the_declarations():
    page = REPO / "docs" / "troubleshooting.md"
    if not page.is_file():
        pytest.skip("no source tree (the wheel check)")
    text = page.read_text()
    m = re.search(r"<!-- env-table: generated by [^>]*-->\n(.*?)\n<!-- env-table: end -->", text, re.S)
    assert m, "docs/troubleshooting.md lost the generated environment table"
    assert m.group(1) == env.markdown_table(), "regenerate it with ramstream.env.markdown_table()"
    for name in env.VARIABLES:  # and nowhere else names a variable that is not declared
        assert f"`{name}`" in m.group(1)


def test_every_variable_the_sources_read_is_declared():
    if not (REPO / "cpp" / "src").is_dir():
        pytest.skip("no source tree (the wheel check)")
    reads = {
        "cpp/src": r'getenv\("(RAMSTREAM_\w+)"\)',
        "python/ramstream": r'(?:environ(?:\.get\(|\[)|getenv\(|env\.(?:get|read)\()"(RAMSTREAM_\w+)"',
        "tests/conftest.py": r'env\.get\("(RAMSTREAM_\w+)"\)',
        "pyproject.toml": r'env = "(RAMSTREAM_\w+)"|environment-pass = \["(RAMSTREAM_\w+)"',
        "cmake": r"\$ENV\{(RAMSTREAM_\w+)\}",
    }
    found = set()
    for where, pattern in reads.items():
        root = REPO / where
        files = (
            [root]
            if root.is_file()
            else [p for p in root.rglob("*") if p.suffix in (".cpp", ".h", ".py", ".cmake")]
        )
        for f in files:
            for m in re.finditer(pattern, f.read_text()):
                found.update(g for g in m.groups() if g)
    known = {"RAMSTREAM_NUM_THREADS", "RAMSTREAM_POOL_SPIN_US", "RAMSTREAM_CACHE_DIR", "RAMSTREAM_CUDA"}
    assert known <= found  # the scan finds what it should
    undeclared = found - set(env.VARIABLES)
    assert not undeclared, f"read but not declared in ramstream/env.py: {undeclared}"
    # nothing in the package reads a RAMSTREAM_* variable around env.py
    direct = [
        f"{p.relative_to(REPO)}:{t.count(chr(10), 0, m.start()) + 1}"
        for p in (REPO / "python/ramstream").rglob("*.py")
        if p.name != "env.py"
        for t in [p.read_text()]
        for m in re.finditer(r'(?:environ(?:\.get\(|\[)|getenv\()"RAMSTREAM_', t)
    ]
    assert not direct, direct
