"""The docs site's pages and the README: every ```python block runs on the CPU (unless marked
`<!-- skip: why -->` on the line before it: a GPU, a download, a fragment), every page the site
lists exists, and the API reference lists every public name."""

from __future__ import annotations

import ast
import os
import re
from pathlib import Path

import pytest

import ramstream

REPO = Path(__file__).resolve().parents[1]
DOCS = REPO / "docs"
BLOCK = re.compile(r"^```python\n(.*?)^```", re.S | re.M)
# blocks that need an optional package are skipped when it is missing, as the tests that use it are
OPTIONAL = ("transformers", "peft", "accelerate")


def pages() -> list[Path]:
    if not DOCS.is_dir():
        return []
    return sorted(DOCS.rglob("*.md")) + [REPO / "README.md"]


def blocks() -> list[tuple[str, int, str | None, str]]:
    """(page, line, skip reason or None, code) of every ```python block."""
    out = []
    for page in pages():
        text = page.read_text()
        for m in BLOCK.finditer(text):
            before = text[: m.start()]
            skip = re.search(r"<!-- skip: (.+?) -->\n$", before)
            line = before.count("\n") + 1
            out.append((str(page.relative_to(REPO)), line, skip.group(1) if skip else None, m.group(1)))
    return out


BLOCKS = blocks()


def test_there_are_blocks_and_most_run():
    if not BLOCKS:
        pytest.skip("no docs/ here")
    assert sum(1 for b in BLOCKS if b[2] is None) >= 4, "the pages lost their runnable blocks"


@pytest.mark.parametrize("page,line,skip,code", BLOCKS, ids=[f"{p}:{n}" for p, n, _, _ in BLOCKS])
def test_python_block_runs_on_the_cpu(page, line, skip, code, tmp_path, monkeypatch):
    if skip:
        assert skip.strip(), f"{page}:{line}: a skip marker must say why"
        pytest.skip(f"{page}:{line}: {skip}")
    monkeypatch.chdir(tmp_path)  # a block that writes files writes them here
    scope: dict = {"__name__": "__docs__"}
    try:
        exec(compile(code, f"{page}:{line}", "exec"), scope)  # noqa: S102 - our own docs
    except ModuleNotFoundError as e:
        if e.name and e.name.split(".")[0] in OPTIONAL:
            pytest.skip(f"{page}:{line} needs {e.name}")
        raise
    finally:
        for v in scope.values():  # close what the block left open (an OffloadModel, say)
            close = getattr(v, "close", None)
            if isinstance(v, ramstream.OffloadModel) and callable(close):
                close()


def _nav_pages(text: str) -> list[str]:
    return re.findall(r":\s+([\w/.-]+\.md)\s*$", text, re.M)


def test_every_page_in_the_nav_exists_and_every_page_is_in_the_nav():
    mk = REPO / "mkdocs.yml"
    if not mk.is_file():
        pytest.skip("no mkdocs.yml here")
    nav = _nav_pages(mk.read_text())
    assert nav, "mkdocs.yml lost its nav"
    missing = [p for p in nav if not (DOCS / p).is_file()]
    assert not missing, f"mkdocs.yml lists pages that do not exist: {missing}"
    unlisted = [str(p.relative_to(DOCS)) for p in DOCS.rglob("*.md") if str(p.relative_to(DOCS)) not in nav]
    assert not unlisted, f"pages the site does not list: {unlisted}"


def _all_of(path: Path) -> list[str]:
    """A module's __all__, read from its source (importing it may need transformers)."""
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "__all__" for t in node.targets):
            return list(ast.literal_eval(node.value))
    raise AssertionError(f"{path} has no __all__")


def test_the_api_reference_lists_every_public_name():
    api = DOCS / "api.md"
    if not api.is_file():
        pytest.skip("no docs/ here")
    text = api.read_text()
    shown = set(re.findall(r"^::: ([\w.]+)\s*$", text, re.M))
    want = {f"ramstream.{n}" for n in ramstream.__all__ if n != "__version__"}
    hf = Path(ramstream.__file__).parent / "integrations" / "huggingface.py"
    want |= {f"ramstream.integrations.huggingface.{n}" for n in _all_of(hf)}
    assert not want - shown, f"public names missing from docs/api.md: {sorted(want - shown)}"
    assert not shown - want, f"docs/api.md documents names that are not public: {sorted(shown - want)}"


def test_readme_links_into_the_docs_resolve():
    readme = REPO / "README.md"
    if not DOCS.is_dir():
        pytest.skip("no docs/ here")
    links = re.findall(r"\]\(((?:docs|bench)/[^)#]+)(?:#[^)]*)?\)", readme.read_text())
    assert links, "the README links to no docs page"
    broken = [link for link in links if not (REPO / link).exists()]
    assert not broken, f"README links that do not resolve: {broken}"


def test_plot_script_reads_the_benchmark_json(tmp_path):
    """bench/plot_results.py's reading of bench_defaults.py's JSON lines (the plot needs matplotlib)."""
    import importlib.util

    path = REPO / "bench" / "plot_results.py"
    if not path.is_file():
        pytest.skip("no bench/ here")
    spec = importlib.util.spec_from_file_location("plot_results", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    f = tmp_path / "d.jsonl"
    f.write_text(
        '{"row": "R1", "cap_gib": 8.0, "variant": "defaults", "status": "ok", "s_per_step": 2.0}\n'
        '{"row": "R1", "cap_gib": 24.0, "variant": "defaults", "status": "ok", "s_per_step": 1.0}\n'
        '{"row": "R1", "cap_gib": 8.0, "variant": "defaults", "status": "ok", "s_per_step": 3.0}\n'
        '{"row": "R5", "cap_gib": 24.0, "variant": "sized", "status": "oom"}\n'
        '{"row": "R6", "cap_gib": 0, "variant": "defaults", "status": "ok", "s_per_step": 4.0}\n'
    )
    ok, failed = mod.series(mod.read_runs([str(f)]))
    assert ok == {("R1", "defaults"): [(8.0, 3.0), (24.0, 1.0)]}  # the later run of a cell wins
    assert failed == [("R5 sized", 24.0, "oom")]
    rec = {"model": "qwen7b", "dtype": "bf16", "batch": 4, "seq": 512, "params": 100, "trained_params": 1}
    assert mod.describe(rec) == "qwen7b LoRA bf16 4x512"
    assert mod.describe({**rec, "trained_params": 100}) == "qwen7b full FT bf16 4x512"
    refused = {
        "status": "oom",
        "step": 0,
        "error": "torch.OutOfMemoryError: ramstream: ... does not fit the plan",
    }
    assert mod.status_text(refused) == "refused at step 0 (plan check)"
    assert mod.status_text({"status": "oom", "error": "CUDA out of memory"}) == "oom"
    if importlib.util.find_spec("matplotlib") is None:
        pytest.skip("matplotlib is not installed")
    out = tmp_path / "p.png"
    assert mod.main([str(f), "--out", str(out)]) == 0 and out.stat().st_size > 0
    assert os.path.getsize(out) > 1000
