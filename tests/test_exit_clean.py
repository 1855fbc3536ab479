"""A script that trains and exits with host updates still queued exits cleanly (rc 0): the engine
thread finishes its jobs before the interpreter finalizes. Before the fix, 3 of 3 such runs
aborted ("terminate called without an active exception") as the thread, inside a kernel call
that had released the GIL, was killed on retaking it."""

from __future__ import annotations

import os
import subprocess
import sys

SCRIPT = """
import torch, ramstream
torch.manual_seed(0)
m = torch.nn.Sequential(*[torch.nn.Linear(1024, 1024) for _ in range(8)]).bfloat16()
model, opt = ramstream.wrap(m, device="cpu")
x = torch.randn(64, 1024, dtype=torch.bfloat16)
for _ in range(3):
    model(x).float().square().mean().backward()
    opt.step()
    opt.zero_grad()
"""  # no synchronize(), no close(): the last step's updates are still running at exit


def test_exit_with_queued_updates_is_clean():
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    for _ in range(3):
        p = subprocess.run(
            [sys.executable, "-c", SCRIPT], capture_output=True, text=True, env=env, timeout=120
        )
        assert p.returncode == 0, p.stderr[-2000:]
        assert "terminate called" not in p.stderr
