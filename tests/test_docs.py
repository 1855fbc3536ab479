"""Every wrap() option and every public name is documented: the options table in docs/guide/wrap.md,
OffloadAdamW in docs/guide/offload_adamw.md, the public names in the docs pages; and every s/step
figure the README and the docs pages quote is in bench/RESULTS.md."""

from __future__ import annotations

import ast
import inspect
import os
import re
from dataclasses import fields

import ramstream
from ramstream.options import WrapOptions

REPO = os.path.join(os.path.dirname(__file__), os.pardir)
README = os.path.join(REPO, "README.md")
DOCS = os.path.join(REPO, "docs")
WRAP_PAGE = os.path.join(DOCS, "guide", "wrap.md")
ADAMW_PAGE = os.path.join(DOCS, "guide", "offload_adamw.md")
API_PAGE = os.path.join(DOCS, "api.md")  # generated from the names: it does not count as mentioning them
RESULTS = os.path.join(REPO, "bench", "RESULTS.md")


def _read(path: str) -> str:
    with open(path) as f:
        return f.read()


def _readme() -> str:
    return _read(README)


def _pages(api: bool = False) -> dict[str, str]:
    """Every docs page (path -> text), the API reference only with api=True."""
    out = {}
    for root, _, files in os.walk(DOCS):
        for name in sorted(files):
            path = os.path.join(root, name)
            if name.endswith(".md") and (api or os.path.abspath(path) != os.path.abspath(API_PAGE)):
                out[path] = _read(path)
    assert out, "no docs pages found"
    return out


def test_every_wrap_option_has_a_row_in_the_options_table():
    text = _read(WRAP_PAGE)
    missing = [n for n in WrapOptions.names() if f"| `{n}` |" not in text]
    assert not missing, f"wrap() options without a row in docs/guide/wrap.md: {missing}"


def test_every_offload_adamw_keyword_is_mentioned():
    text = _read(ADAMW_PAGE)
    sig = inspect.signature(ramstream.OffloadAdamW.__init__)
    public = [n for n in sig.parameters if n not in ("self", "params") and not n.startswith("_")]
    missing = [n for n in public if f"`{n}" not in text and f"{n}=" not in text]
    assert not missing, f"OffloadAdamW arguments docs/guide/offload_adamw.md never names: {missing}"


def test_every_public_name_is_mentioned():
    text = "\n".join(_pages().values())  # the guides, not the generated API reference
    missing = [n for n in ramstream.__all__ if n != "__version__" and n not in text]
    assert not missing, f"public names the docs pages never mention: {missing}"


def _options_table(text: str) -> dict[str, str]:
    """option name -> the table's default cell, for the wrap() options table."""
    rows = {}
    for line in text.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 4 and re.fullmatch(r"`\w+`", cells[0]):
            rows[cells[0].strip("`")] = cells[2]
    return rows


def _literal(cell: str):
    """The first `...` of a table cell as a Python value ("32 MiB" -> bytes)."""
    m = re.search(r"`([^`]*)`", cell)
    assert m, f"default cell without a `value`: {cell!r}"
    v = m.group(1)
    size = re.fullmatch(r"(\d+) (KiB|MiB|GiB)", v)
    if size:
        return int(size.group(1)) << {"KiB": 10, "MiB": 20, "GiB": 30}[size.group(2)]
    return ast.literal_eval(v)


def test_options_table_defaults_equal_wrap_options():
    rows = _options_table(_read(WRAP_PAGE))
    defaults = {f.name: f.default for f in fields(WrapOptions) if not f.name.startswith("_")}
    defaults["optimizer"] = inspect.signature(ramstream.wrap).parameters["optimizer"].default
    assert set(rows) == set(defaults), "options table rows differ from wrap()'s options"
    wrong = {
        n: (rows[n], d)
        for n, d in defaults.items()
        if _literal(rows[n]) != d or type(_literal(rows[n])) is not type(d)
    }
    assert not wrong, f"docs/guide/wrap.md default != WrapOptions default: {wrong}"


def test_offload_adamw_signature_in_the_docs_equals_the_code():
    text = " ".join(_read(ADAMW_PAGE).split())
    m = re.search(r"`OffloadAdamW\(params, (.*?)\)` is the optimizer", text)
    assert m, "docs/guide/offload_adamw.md lost the OffloadAdamW(...) signature line"
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


def _quoted(text: str) -> list[str]:
    return re.findall(r"(?<![\w.])(\d+\.\d+)(?=[^|`\n]*s/step)", text)


def test_benchmark_figures_in_readme_and_docs_come_from_results():
    """Every s/step figure the README and the docs pages quote is in bench/RESULTS.md, with the
    same digits."""
    results = _read(RESULTS)
    assert _quoted(_readme()), "the README quotes no s/step figure any more: update this test"
    missing = {}
    for path, text in {README: _readme(), **_pages()}.items():
        bad = [q for q in _quoted(text) if not re.search(rf"(?<![\w.]){re.escape(q)}(?![\d])", results)]
        if bad:
            missing[os.path.relpath(path, REPO)] = bad
    assert not missing, f"figures not in bench/RESULTS.md: {missing}"
