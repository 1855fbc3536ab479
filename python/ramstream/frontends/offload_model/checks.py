"""OffloadModel's arguments and results: validation of chunks, device, window, pin/pin_layers,
keep_activations and step()'s loss_fn / grad_outputs / targets (errors naming the argument),
StepResult, detaching outputs."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from ...blocks import spaced  # the one evenly-spaced rule (the leaf blocks.py)

KEEP = (False, True, "checkpoint")
_NO_LOSS = object()


class NoLossError(ValueError, RuntimeError):
    """StepResult.loss of a step given grad_outputs: a ValueError (ramstream's) that is also the
    RuntimeError RamTorch's OffloadStepResult raises, so either `except` catches it."""


class ModelClosedError(ValueError, RuntimeError):
    """A call on a closed OffloadModel: ValueError (ramstream's), also RuntimeError (RamTorch's)."""


@dataclass
class StepResult:
    """What step() returns (RamTorch's OffloadStepResult): the output (detached), the loss
    (detached; raises NoLossError, a ValueError and RuntimeError, when step() was given
    grad_outputs, which computes no loss) and grad_bypassed (whether it was)."""

    output: Any
    _loss: Any = _NO_LOSS

    @property
    def grad_bypassed(self) -> bool:
        return self._loss is _NO_LOSS

    @property
    def loss(self):
        if self._loss is _NO_LOSS:
            raise NoLossError("StepResult.loss: step() was given grad_outputs, so no loss was computed")
        return self._loss


def check_device(device) -> torch.device:
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as e:
        raise ValueError(f"OffloadModel: device must be 'cpu' or 'cuda[:index]', got {device!r}") from e
    if dev.type == "cpu":
        return dev
    if dev.type != "cuda":
        raise ValueError(f"OffloadModel: device must be 'cpu' or 'cuda[:index]', got {device!r}")
    if not torch.cuda.is_available():
        raise ValueError(f"OffloadModel: device={device!r} does not exist (torch sees no GPU); use 'cpu'")
    index = torch.cuda.current_device() if dev.index is None else dev.index
    if index >= torch.cuda.device_count():
        raise ValueError(
            f"OffloadModel: device={device!r} does not exist ({torch.cuda.device_count()} GPUs: "
            f"cuda:0-cuda:{torch.cuda.device_count() - 1})"
        )
    return torch.device("cuda", index)


def pinned_set(pin, pin_layers, n: int) -> set[int]:
    if pin_layers is not None:
        if isinstance(pin_layers, (str, bytes)) or not hasattr(pin_layers, "__iter__"):
            raise ValueError(f"OffloadModel: pin_layers must be a list of chunk indices, got {pin_layers!r}")
        idx = list(pin_layers)
        bad = [i for i in idx if isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < n]
        if bad:
            raise ValueError(f"OffloadModel: pin_layers must be chunk indices in [0, {n}), got {bad!r}")
        if len(set(idx)) != len(idx):
            raise ValueError(f"OffloadModel: pin_layers has duplicate indices: {idx!r}")
        return set(idx)
    if isinstance(pin, bool) or not isinstance(pin, int) or not 0 <= pin <= n:
        raise ValueError(f"OffloadModel: pin must be an int in [0, {n}] (the number of chunks), got {pin!r}")
    return spaced(pin, n)


def detach(x):
    if torch.is_tensor(x):
        return x.detach()
    if isinstance(x, tuple):
        return tuple(detach(v) for v in x)
    return x


def check_chunks(chunks) -> list:
    if isinstance(chunks, torch.nn.Module) and not isinstance(
        chunks, (torch.nn.Sequential, torch.nn.ModuleList)
    ):
        raise ValueError("OffloadModel: chunks must be a list of nn.Modules, got a single module")
    try:
        chunks = list(chunks)
    except TypeError:
        raise ValueError(
            f"OffloadModel: chunks must be a list of nn.Modules, got {type(chunks).__name__}"
        ) from None
    if not chunks:
        raise ValueError("OffloadModel: chunks must be a non-empty list of nn.Modules")
    bad = [i for i, c in enumerate(chunks) if not isinstance(c, torch.nn.Module)]
    if bad:
        raise ValueError(f"OffloadModel: chunks must be nn.Modules; chunks {bad} are not")
    owner: dict[int, int] = {}
    for i, c in enumerate(chunks):
        for p in c.parameters():
            if owner.setdefault(id(p), i) != i:
                raise ValueError(
                    f"OffloadModel: chunks {owner[id(p)]} and {i} share a parameter; chunks must not share parameters"
                )
    return chunks


def check_options(window, keep_activations, activation_offload) -> None:
    if isinstance(window, bool) or not isinstance(window, int) or window < 1:
        raise ValueError(
            f"OffloadModel: window must be an int >= 1 (device slots for streamed chunks), got {window!r}"
        )
    if not any(keep_activations is k or (isinstance(k, str) and keep_activations == k) for k in KEEP):
        raise ValueError(
            f"OffloadModel: keep_activations must be False, True or 'checkpoint', got {keep_activations!r}"
        )
    if not isinstance(activation_offload, bool):
        raise ValueError(
            f"OffloadModel: activation_offload must be True or False, got {activation_offload!r}"
        )
    if activation_offload and keep_activations is not True:
        raise ValueError(
            "OffloadModel: activation_offload=True pages the saved tensors of the kept graph to host "
            f"memory: it needs keep_activations=True (with keep_activations={keep_activations!r} each "
            "chunk keeps only its input and recomputes the rest)"
        )


def check_step_args(loss_fn, grad_outputs) -> None:
    """TypeError unless loss_fn is None or callable and grad_outputs is None, a tensor, a tuple (of
    tensors or None) or a callable given the output."""
    if loss_fn is not None and not callable(loss_fn):
        raise TypeError(
            f"OffloadModel.step: loss_fn must be None (the default loss) or a callable "
            f"loss_fn(output, targets), got {type(loss_fn).__name__}"
        )
    if grad_outputs is None or callable(grad_outputs) or torch.is_tensor(grad_outputs):
        return
    if isinstance(grad_outputs, tuple) and all(g is None or torch.is_tensor(g) for g in grad_outputs):
        return
    raise TypeError(
        "OffloadModel.step: grad_outputs must be None, a tensor, a tuple of tensors (one per output) "
        f"or a callable given the output, got {type(grad_outputs).__name__}"
    )


def check_grad_outputs(pairs) -> None:
    """ValueError unless each (output, gradient) pair's gradient is a tensor of the output's shape."""
    for i, (o, g) in enumerate(pairs):
        if not torch.is_tensor(g):
            raise TypeError(f"OffloadModel.step: grad_outputs[{i}] must be a tensor, got {type(g).__name__}")
        if g.shape != o.shape:
            raise ValueError(
                f"OffloadModel.step: grad_outputs[{i}] has shape {tuple(g.shape)}, the output "
                f"{tuple(o.shape)}; accepted: a tensor of the output's shape"
            )


def check_default_targets(out, targets) -> None:
    """The default loss (mean squared error) needs one tensor output and targets of its shape
    (torch's mse_loss would broadcast other shapes with only a warning)."""
    if not torch.is_tensor(out):
        raise ValueError(
            f"OffloadModel.step: the default loss (mean squared error) needs one tensor output, the "
            f"model returned {type(out).__name__}; pass loss_fn="
        )
    if not torch.is_tensor(targets) or targets.shape != out.shape:
        got = tuple(targets.shape) if torch.is_tensor(targets) else type(targets).__name__
        raise ValueError(
            f"OffloadModel.step: targets must be a tensor of the output's shape {tuple(out.shape)} "
            f"for the default loss (mean squared error), got {got}; pass loss_fn= for another loss"
        )
