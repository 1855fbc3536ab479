"""PyTorch's CUDA caching allocator under a tight plan: expandable segments on.

A plan packs VRAM to within its headroom of the cap. With the allocator's default segments, the
free pieces of split blocks cannot be returned or joined: on the GPU machine (H100, 2026-12-05) the
6.85B GPT at 16 x 2048 tokens, paging and streaming as planned, failed a 1 GiB allocation at step 3
of a 16 GiB cap with 13.86 GiB allocated and 1.37 GiB reserved but unusable; a 1.5 GiB test failed
a 250 MiB one with 1.03 allocated and 0.32 stranded. Expandable segments (one growing virtual
range per stream, pages mapped and unmapped as needed) leave no such fragments, so the byte count
the planner made is what the allocator can give.

use_expandable_segments() turns them on once per process, at wrap() on a CUDA device, unless the
user configured the allocator (PYTORCH_CUDA_ALLOC_CONF or PYTORCH_ALLOC_CONF set: left as it is)
or RAMSTREAM_EXPANDABLE_SEGMENTS=0. Segments made before stay as they were (the cached free ones
are released); every later one is expandable. It is logged, and a torch that cannot do it says so
in the log and nothing changes.
"""

from __future__ import annotations

import os
import threading
import warnings

import torch

from .. import env

USER_VARS = ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF")
_lock = threading.Lock()
_done: list = []  # the outcome, once per process: (on: bool, why: str)


def _decide() -> tuple[bool, str]:
    user = [v for v in USER_VARS if os.environ.get(v)]
    if user:
        return False, f"{user[0]}={os.environ[user[0]]!r} is set: the allocator is left as configured"
    if env.get("RAMSTREAM_EXPANDABLE_SEGMENTS", stacklevel=4) is False:
        return False, "RAMSTREAM_EXPANDABLE_SEGMENTS=0: the allocator is left as it is"
    setter = getattr(torch.cuda.memory, "_set_allocator_settings", None)
    if setter is None:
        return False, f"torch {torch.__version__} has no allocator settings call: left as it is"
    try:
        with warnings.catch_warnings():
            # torch >= 2.10 deprecates this call (for torch._C._accelerator_setAllocatorSettings, not yet
            # checked on a GPU here): the call verified on the GPU stays, without the user-facing warning
            warnings.simplefilter("ignore", FutureWarning)
            setter("expandable_segments:True")
    except (RuntimeError, ValueError) as e:
        return False, f"expandable segments refused ({e}): the allocator is left as it is"
    torch.cuda.empty_cache()  # the cached free segments go; later ones are expandable
    return True, (
        "CUDA allocator: expandable segments on (no stranded fragments under the plan's cap; "
        "PYTORCH_CUDA_ALLOC_CONF or RAMSTREAM_EXPANDABLE_SEGMENTS=0 keep your own setting)"
    )


def use_expandable_segments(device: torch.device, log) -> bool:
    """Expandable segments for the process (module docstring), decided once; True when on.
    Logs the outcome the first time. Nothing for a device that is not CUDA."""
    if device.type != "cuda":
        return False
    with _lock:
        first = not _done
        if first:
            _done.append(_decide())
        on, why = _done[0]
    if first:
        log(why)
    return on
