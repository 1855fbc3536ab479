"""The CPU quick start (docs/guide/wrap.md, linked from the README), extracted and run: it trains as
torch AdamW does. tests/test_docs_pages.py runs every other Python block of the README and the docs."""

from __future__ import annotations

import os
import re

import torch

PAGE = os.path.join(os.path.dirname(__file__), os.pardir, "docs", "guide", "wrap.md")
WRAP_LINE = 'model, optimizer = ramstream.wrap(model, optimizer, device="cpu")\n'


def _cpu_quick_start() -> str:
    with open(PAGE) as f:
        text = f.read()
    section = text.split("### On the CPU", 1)[1]
    m = re.search(r"```python\n(.*?)```", section, re.DOTALL)
    assert m, "docs/guide/wrap.md lost the CPU quick start's code block"
    return m.group(1)


def _run(code: str) -> dict:
    scope: dict = {}
    exec(compile(code, "docs/guide/wrap.md (CPU quick start)", "exec"), scope)  # noqa: S102 - our docs
    return scope


def test_cpu_quick_start_runs_and_trains_like_torch_adamw(capsys):
    code = _cpu_quick_start()
    assert WRAP_LINE in code and 'device="cpu"' in code
    ours = _run(code)
    printed = capsys.readouterr().out
    assert re.fullmatch(r"step 19: loss \d+\.\d{4}\n", printed), printed
    import ramstream

    assert ours["model"]._ramstream is not None  # it really was wrapped
    assert isinstance(ours["optimizer"], ramstream.OffloadAdamW)
    # the same code without wrap(): plain torch AdamW, same seed and data
    ref = _run(code.replace(WRAP_LINE, "").replace("optimizer.synchronize()", "pass"))
    capsys.readouterr()
    assert abs(ours["loss"].item() - ref["loss"].item()) <= 1e-5 * max(1.0, ref["loss"].item())
    for (name, a), b in zip(ours["model"].named_parameters(), ref["model"].parameters()):
        a64, b64 = a.detach().double(), b.detach().double()
        assert torch.allclose(a64, b64, rtol=1e-5, atol=1e-6), name
    # and it learned something: the loss fell from its first step
    first = _run(code.replace("range(20)", "range(1)"))["loss"].item()
    capsys.readouterr()
    assert ours["loss"].item() < first
