"""What the input probe's case files share (bench/probe_public_inputs.py runs them): the case
list, the small models and tensors the cases build."""

from __future__ import annotations

import os
import sys

import torch
import torch.nn as nn

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests"))
import ramstream  # noqa: E402
from ramstream import functional as F  # noqa: E402, F401  (the case files use it)

from _models import make_model  # noqa: E402

NAN, INF = float("nan"), float("inf")


def chunks():
    return [nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 8)) for _ in range(3)]


def om(**kw):
    return ramstream.OffloadModel(chunks(), device="cpu", **kw)


def oa(**kw):
    m = make_model(0)
    return ramstream.OffloadAdamW(m.parameters(), device="cpu", **kw), m


def wrapped():
    m = make_model(0)
    return ramstream.wrap(m, torch.optim.AdamW(m.parameters()), device="cpu")


H, W, T = torch.randn(4, 8), torch.randn(16, 8), torch.randint(0, 16, (4,))


CASES = []


def case(name, arg):
    def deco(fn):
        CASES.append((name, arg, fn))
        return fn

    return deco


def add(name, arg, fn):
    CASES.append((name, arg, fn))
