"""ramstream's host AdamW against torch's fused CPU AdamW on one size, fastest of --rounds calls
each (no pytest-benchmark: a quick look at one setting, e.g. RAMSTREAM_POOL_SPIN_US or
RAMSTREAM_FORCE_ISA, from the environment). Prints both times and torch / ramstream.

    RAMSTREAM_POOL_SPIN_US=50 python bench/adamw_vs_torch.py --params 1048576
"""

from __future__ import annotations

import argparse

import torch

import ramstream.functional as F
from ramstream._native import lib
from ramstream.planner.measure import best_seconds


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--params", type=int, default=1 << 20)
    ap.add_argument("--rounds", type=int, default=300)
    a = ap.parse_args()
    n = a.params
    p, g, m, v = torch.randn(n), torch.randn(n), torch.zeros(n), torch.zeros(n)
    pt = torch.nn.Parameter(torch.randn(n))
    pt.grad = torch.randn(n)
    opt = torch.optim.AdamW([pt], lr=1e-3, fused=True)
    ours = best_seconds(lambda: F.adamw_(p, g, m, v, step=5, lr=1e-3), a.rounds)
    theirs = best_seconds(opt.step, a.rounds)
    print(
        f"{n:,} params, ramstream {lib().num_threads()} threads ({lib().active_isa()}), torch "
        f"{torch.get_num_threads()}: ramstream {ours * 1e3:.3f} ms, torch fused {theirs * 1e3:.3f} ms, "
        f"torch/ramstream {theirs / ours:.2f}"
    )


if __name__ == "__main__":
    main()
