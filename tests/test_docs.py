"""Every wrap() option and every public name is documented in the README."""
from __future__ import annotations

import inspect
import os

import ramstream
from ramstream.options import WrapOptions

README = os.path.join(os.path.dirname(__file__), os.pardir, "README.md")


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
