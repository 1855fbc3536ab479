"""Renames the distribution in pyproject.toml for a per-CUDA wheel: ramstream -> ramstream-cuNN.

Usage: python .github/scripts/set_dist_name.py cu12   (both wheels still import as `ramstream`)
"""

from __future__ import annotations

import pathlib
import re
import sys


def main() -> int:
    if len(sys.argv) != 2 or not re.fullmatch(r"cu1[2-9]", sys.argv[1]):
        print("usage: set_dist_name.py cu12|cu13", file=sys.stderr)
        return 2
    path = pathlib.Path(__file__).resolve().parents[2] / "pyproject.toml"
    text = path.read_text()
    new, n = re.subn(r'(?m)^name = "ramstream(-cu\d+)?"$', f'name = "ramstream-{sys.argv[1]}"', text)
    if n != 1:
        print("pyproject.toml: could not find the project name line", file=sys.stderr)
        return 1
    path.write_text(new)
    print(f"distribution name: ramstream-{sys.argv[1]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
