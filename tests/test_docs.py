"""Every wrap() option and every public name is documented in the README."""

from __future__ import annotations

import ast
import inspect
import os
import re
from dataclasses import fields

import ramstream
from ramstream.options import WrapOptions

README = os.path.join(os.path.dirname(__file__), os.pardir, "README.md")
RESULTS = os.path.join(os.path.dirname(__file__), os.pardir, "bench", "RESULTS.md")


def _readme() -> str:
    with open(README) as f:
        return f.read()


def test_every_wrap_option_has_a_row_in_the_options_table():
    text = _readme()
    missing = [n for n in WrapOptions.names() if f"| `{n}` |" not in text]
    assert not missing, f"wrap() options without a README row: {missing}"


def test_every_offload_adamw_keyword_is_mentioned():
    text = _readme()
    sig = inspect.signature(ramstream.OffloadAdamW.__init__)
    public = [n for n in sig.parameters if n not in ("self", "params") and not n.startswith("_")]
    missing = [n for n in public if f"`{n}" not in text and f"{n}=" not in text]
    assert not missing, f"OffloadAdamW arguments the README never names: {missing}"


def test_every_public_name_is_mentioned():
    text = _readme()
    missing = [n for n in ramstream.__all__ if n != "__version__" and n not in text]
    assert not missing, f"public names the README never mentions: {missing}"


def _options_table(text: str) -> dict[str, str]:
    """option name -> the README table's default cell, for the wrap() options table."""
    rows = {}
    for line in text.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 4 and re.fullmatch(r"`\w+`", cells[0]):
            rows[cells[0].strip("`")] = cells[2]
    return rows


def _literal(cell: str):
    """The first `...` of a README cell as a Python value ("32 MiB" -> bytes)."""
    m = re.search(r"`([^`]*)`", cell)
    assert m, f"default cell without a `value`: {cell!r}"
    v = m.group(1)
    size = re.fullmatch(r"(\d+) (KiB|MiB|GiB)", v)
    if size:
        return int(size.group(1)) << {"KiB": 10, "MiB": 20, "GiB": 30}[size.group(2)]
    return ast.literal_eval(v)


def test_options_table_defaults_equal_wrap_options():
    rows = _options_table(_readme())
    defaults = {f.name: f.default for f in fields(WrapOptions) if not f.name.startswith("_")}
    defaults["optimizer"] = inspect.signature(ramstream.wrap).parameters["optimizer"].default
    assert set(rows) == set(defaults), "options table rows differ from wrap()'s options"
    wrong = {
        n: (rows[n], d)
        for n, d in defaults.items()
        if _literal(rows[n]) != d or type(_literal(rows[n])) is not type(d)
    }
    assert not wrong, f"README default != WrapOptions default: {wrong}"


def test_offload_adamw_signature_in_readme_equals_the_code():
    text = " ".join(_readme().split())
    m = re.search(r"`OffloadAdamW\(params, (.*?)\)` is the optimizer", text)
    assert m, "README lost the OffloadAdamW(...) signature line"
    shown = {}
    for part in re.split(r",\s*(?![^()]*\))", m.group(1)):
        if part.strip() == "*":
            continue
        name, value = part.split("=", 1)
        shown[name.strip()] = _literal(f"`{value.strip()}`")
    sig = inspect.signature(ramstream.OffloadAdamW.__init__)
    code = {
        n: p.default
        for n, p in sig.parameters.items()
        if n not in ("self", "params") and not n.startswith("_")
    }
    assert shown == code


def test_benchmark_figures_in_readme_come_from_results():
    """Every s/step figure the README quotes is in bench/RESULTS.md, with the same digits."""
    readme = _readme()
    with open(RESULTS) as f:
        results = f.read()
    quoted = re.findall(r"(?<![\w.])(\d+\.\d+)(?=[^|`\n]*s/step)", readme)
    assert quoted, "the README quotes no s/step figure any more: update this test"
    missing = [q for q in quoted if not re.search(rf"(?<![\w.]){re.escape(q)}(?![\d])", results)]
    assert not missing, f"README figures not in bench/RESULTS.md: {missing}"
