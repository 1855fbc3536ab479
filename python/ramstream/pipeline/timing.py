"""Measuring a model's pieces for PipelineModel(balance="time"): each piece's forward + backward on a
device with the example input (chained through the pieces), the median of a few warm repetitions;
the model's gradients, buffers and random state are as before the measurement."""

from __future__ import annotations

import statistics
import time

import torch

__all__ = ["measure_piece_times"]


def _inputs(args) -> tuple:
    """Fresh leaves of the piece's arguments: floating tensors require grad (their backward runs
    as it would inside a stage), others travel as they are."""
    out = []
    for a in args:
        if torch.is_tensor(a):
            a = a.detach()
            if a.is_floating_point() or a.is_complex():
                a = a.requires_grad_(True)
        out.append(a)
    return tuple(out)


def _forward_backward(module, args):
    out = module(*_inputs(args))
    outs = out if isinstance(out, tuple) else (out,)
    pairs = [(o, torch.ones_like(o)) for o in outs if torch.is_tensor(o) and o.requires_grad]
    if pairs:
        torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
    return tuple(o.detach() if torch.is_tensor(o) else o for o in outs)


def _move(args, device) -> tuple:
    return tuple(a.to(device) if torch.is_tensor(a) else a for a in args)


def measure_piece_times(
    pieces, example_input, device, *, repeats: int = 3, clock=time.perf_counter
) -> list[float]:
    """Seconds of forward + backward per piece (nn.Modules run in order, a tuple output being the
    next one's arguments) on `device` with `example_input` (a tensor or a tuple of the first
    piece's arguments): one warm-up run, then the median of `repeats` runs, each timed with
    `clock()` (torch.cuda.synchronize on a GPU around it). A piece not on `device` visits it for
    its measurement and goes back. Gradients (`.grad`), buffers (BatchNorm statistics) and the
    random state (CPU and `device`) are restored. Runs on the caller's thread and stream."""
    if isinstance(repeats, bool) or not isinstance(repeats, int) or repeats < 1:
        raise ValueError(f"measure_piece_times: repeats must be an int >= 1, got {repeats!r}")
    device = torch.device(device)
    cuda = device.type == "cuda"

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize(device)

    args = _move(example_input if isinstance(example_input, tuple) else (example_input,), device)
    times = []
    with torch.random.fork_rng(devices=[device] if cuda else []), torch.enable_grad():
        for m in pieces:
            home = next((t.device for t in [*m.parameters(), *m.buffers()]), device)
            grads = [(p, p.grad) for p in m.parameters()]
            bufs = [(b, b.detach().clone()) for b in m.buffers()]
            for p, _ in grads:
                p.grad = None
            try:
                if home != device:
                    m.to(device)
                out = _forward_backward(m, args)  # warm-up (and the next piece's input)
                runs = []
                for _ in range(repeats):
                    for p, _ in grads:
                        p.grad = None
                    sync()
                    t0 = clock()
                    _forward_backward(m, args)
                    sync()
                    runs.append(clock() - t0)
            finally:
                for p, _ in grads:
                    p.grad = None
                if home != device:
                    m.to(home)
                with torch.no_grad():
                    for p, g in grads:
                        p.grad = g
                    for b, v in bufs:
                        b.copy_(v)
            times.append(float(statistics.median(runs)))
            args = out
    return times
