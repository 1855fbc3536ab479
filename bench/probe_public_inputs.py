"""Probe of ramstream's public functions with bad inputs (issue 25): each case's outcome classed as
clear (the expected type, the argument named), unclear (raw or unnamed error), silent (no error) or
hang (past a timeout). The cases are in bench/_probe_inputs_*.py. Run from the repository root:
python bench/probe_public_inputs.py [filter]."""

from __future__ import annotations

import os
import re
import signal
import sys
import warnings

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _probe_inputs_misc  # noqa: E402, F401
import _probe_inputs_optim  # noqa: E402, F401  (registers its cases)
import _probe_inputs_wrap  # noqa: E402, F401
from _probe_inputs_common import CASES  # noqa: E402


class Timeout(Exception):
    pass


def _alarm(*_):
    raise Timeout()


def run(filter_=""):
    signal.signal(signal.SIGALRM, _alarm)
    counts = {}
    for name, arg, fn in CASES:
        if filter_ and filter_ not in name:
            continue
        signal.alarm(30)
        with warnings.catch_warnings(record=True) as w:
            warnings.simplefilter("always")
            try:
                fn()
                outcome, msg = "silent", "; ".join(str(x.message)[:100] for x in w)
            except Timeout:
                outcome, msg = "hang", ""
            except (ValueError, TypeError, MemoryError, OSError) as e:
                text = str(e)
                named = re.search(arg, text) is not None
                outcome = "clear" if named else "unclear"
                msg = f"{type(e).__name__}: {text[:300]}"
            except Exception as e:  # noqa: BLE001
                outcome, msg = "unclear", f"{type(e).__name__}: {str(e)[:300]}"
            finally:
                signal.alarm(0)
        counts[outcome] = counts.get(outcome, 0) + 1
        print(f"[{outcome:7s}] {name}: {msg}")
    print(counts)


if __name__ == "__main__":
    run(sys.argv[1] if len(sys.argv) > 1 else "")
