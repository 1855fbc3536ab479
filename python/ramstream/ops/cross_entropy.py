"""The fused softmax cross-entropy kernels of the chunked loss (ramstream.loss), on torch tensors.

``usable(device, dtype)`` says whether they can run (a CUDA device, a build with CUDA kernels);
the loss falls back to torch's ops otherwise. Both run on torch's current stream of the
tensors' device, asynchronously.
"""

from __future__ import annotations

import torch

from .._native import lib
from .cuda import _launch, _stream

__all__ = ["usable", "forward", "backward_"]

_FLOATS = (torch.float32, torch.bfloat16, torch.float16)
_state = {"ok": None}  # None: not checked yet; then True/False for the process
ENABLED = True  # tests switch the kernels off to compare against torch's ops


def usable(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether the kernels run for logits of `dtype` on `device` (float32/bfloat16/float16, CUDA)."""
    if not ENABLED or device.type != "cuda" or dtype not in _FLOATS:
        return False
    if _state["ok"] is None:
        c = lib()
        _state["ok"] = bool(
            c.built_with_cuda() and c.cuda_device_count() > 0 and hasattr(c, "cuda_ce_forward")
        )
    return _state["ok"]


def forward(logits: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(lse, target_logit), float32 [rows], of contiguous [rows, vocab] logits; targets int64 in
    [0, vocab)."""
    rows = logits.shape[0]
    lse = torch.empty(rows, dtype=torch.float32, device=logits.device)
    tl = torch.empty(rows, dtype=torch.float32, device=logits.device)
    dev = logits.device
    _launch(dev, lib().cuda_ce_forward, logits, targets, lse, tl, stream=_stream(dev), device=dev.index)
    return lse, tl


def backward_(
    logits: torch.Tensor, targets: torch.Tensor, lse: torch.Tensor, scale: torch.Tensor
) -> torch.Tensor:
    """logits (contiguous [rows, vocab]) become d(sum_r scale[r] * nll[r]) / d logits, in place."""
    dev = logits.device
    _launch(dev, lib().cuda_ce_backward, logits, targets, lse, scale, stream=_stream(dev), device=dev.index)
    return logits
