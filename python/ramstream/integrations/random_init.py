"""Random weights for load_model(random_weights=True), drawn in parallel.

torch draws normal numbers on the CPU with one generator, on one core: a 70B-shaped model's
embeddings and four layers (5.3 G numbers) took over two minutes on the H200 machine's CPU. Here
each large tensor is cut into one span per core, each span drawn by its own generator seeded from
torch's default generator (so torch.manual_seed makes the weights repeatable); torch releases the
GIL inside normal_(), so the spans run at once.
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor

import torch
import torch.nn as nn

PARALLEL_MIN = 1 << 22  # elements: smaller tensors are drawn by torch's generator directly


def _threads() -> int:
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # pragma: no cover - not Linux
        return max(1, os.cpu_count() or 1)


def parallel_normal_(t: torch.Tensor, std: float, threads: int | None = None) -> torch.Tensor:
    """t.normal_(0, std) in place, drawn in `threads` spans at once (default: the usable cores);
    repeatable under torch.manual_seed for the same thread count."""
    k = threads or _threads()
    if t.numel() < PARALLEL_MIN or k == 1 or not t.is_contiguous():
        return t.normal_(0.0, std)
    with torch.no_grad():
        flat = t.view(-1)
    n = flat.numel()
    seeds = torch.randint(0, 2**62, (k,)).tolist()
    cuts = [n * i // k for i in range(k + 1)]

    def draw(i: int) -> None:
        g = torch.Generator().manual_seed(seeds[i])
        with torch.no_grad():  # grad mode is per thread: a parameter's span is written as data
            flat[cuts[i] : cuts[i + 1]].normal_(0.0, std, generator=g)

    with ThreadPoolExecutor(k) as pool:
        list(pool.map(draw, range(k)))
    return t


def init_module_(module: nn.Module, std: float | None, model_init) -> None:
    """Linear and Embedding weights from N(0, std) (the distribution Hugging Face's
    initialisation uses for them, not the same numbers), biases zero, an Embedding's padding row
    zero; any other module, or std None: the model's own initialisation (`model_init`)."""
    with torch.no_grad():
        if std is not None and type(module) in (nn.Linear, nn.Embedding):
            parallel_normal_(module.weight, std)
            if getattr(module, "bias", None) is not None:
                module.bias.zero_()
            pad = getattr(module, "padding_idx", None)
            if pad is not None:
                module.weight[pad].zero_()
        elif model_init is not None:
            model_init(module)
