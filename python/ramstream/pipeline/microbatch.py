"""The Pipeline's input forms for step() and infer(): one batch (a tensor, or a flat tuple of the
first stage's arguments) cut along dim 0, or pre-split microbatches (a tuple/list of tuples, one
per microbatch); targets and grad_outputs cut to match."""

from __future__ import annotations

import torch

from .checks import check_int, split_batch, split_tensors
from .run import sum_loss

__all__ = ["DEFAULT_MICROBATCHES", "cut_inputs", "is_presplit"]

DEFAULT_MICROBATCHES = 4
_FORMS = (
    "a tensor, a flat tuple of tensors (one batch: the first stage's positional arguments, cut along "
    "dim 0), or a tuple/list of microbatches, each a tuple of tensors: ((x0,), (x1,)) or ((a0, b0), (a1, b1))"
)


def _holds_tensor(v) -> bool:
    return isinstance(v, (tuple, list)) and any(torch.is_tensor(x) for x in v)


def is_presplit(where: str, data) -> bool:
    """True for pre-split microbatches: a non-empty tuple/list whose every entry is a tuple/list (one
    microbatch's positional arguments). A flat tuple (some entry not a tuple/list) is one batch;
    one that mixes tensors with tuples/lists of tensors is ambiguous: ValueError."""
    if not isinstance(data, (tuple, list)) or not data:
        return False
    if all(isinstance(e, (tuple, list)) for e in data):
        return True
    if any(_holds_tensor(e) for e in data):
        raise ValueError(
            f"{where}: data mixes microbatches (tuples/lists of tensors) with other entries; give {_FORMS}"
        )
    return False


def _rows_of(where: str, name: str, v) -> int:
    if not torch.is_tensor(v):
        raise TypeError(f"{where}: {name} must be a tensor, got {type(v).__name__}; data must be {_FORMS}")
    if v.dim() == 0 or v.shape[0] == 0:
        raise ValueError(f"{where}: {name} needs at least one row in dim 0, got shape {tuple(v.shape)}")
    return v.shape[0]


def _presplit(where: str, data) -> tuple[list, list]:
    inputs, sizes = [], []
    for i, mb in enumerate(data):
        if not mb:
            raise ValueError(f"{where}: data[{i}] is an empty microbatch; data must be {_FORMS}")
        if len(mb) != len(data[0]):
            raise ValueError(
                f"{where}: data[{i}] has {len(mb)} tensors, data[0] has {len(data[0])}: every microbatch "
                "gives the first stage the same number of positional arguments"
            )
        rows = [_rows_of(where, f"data[{i}][{j}]", v) for j, v in enumerate(mb)]
        if len(set(rows)) != 1:
            raise ValueError(f"{where}: data[{i}]'s tensors have different rows in dim 0: {rows}")
        inputs.append(tuple(mb))
        sizes.append(rows[0])
    return inputs, sizes


def _piece(where: str, name: str, v, rows: int):
    """One microbatch's target or gradient: a tensor or a tuple (None entries kept), rows checked."""
    if isinstance(v, (tuple, list)):
        return tuple(
            _piece(where, f"{name}[{j}]", x, rows) if x is not None else None for j, x in enumerate(v)
        )
    if not torch.is_tensor(v):
        raise TypeError(f"{where}: {name} must be a tensor or a tuple of tensors, got {type(v).__name__}")
    if v.dim() == 0 or v.shape[0] != rows:
        raise ValueError(
            f"{where}: {name} has shape {tuple(v.shape)}, its microbatch has {rows} rows in dim 0"
        )
    return v


def _cut_sizes(where: str, name: str, x, sizes: list):
    """`x` for pre-split microbatches of `sizes` rows: a tuple/list with one entry per microbatch, or a
    tensor of all their rows cut at those sizes."""
    if torch.is_tensor(x):
        if x.dim() == 0 or x.shape[0] != sum(sizes):
            raise ValueError(
                f"{where}: {name} as one tensor needs the microbatches' {sum(sizes)} rows in dim 0 "
                f"({'+'.join(map(str, sizes))}), got shape {tuple(x.shape)}"
            )
        return list(torch.split(x, sizes, dim=0))
    if isinstance(x, (tuple, list)):
        if len(x) != len(sizes):
            raise ValueError(
                f"{where}: {name} has {len(x)} entries for {len(sizes)} pre-split microbatches "
                "(one per microbatch, or one tensor of all their rows)"
            )
        return [_piece(where, f"{name}[{i}]", v, r) for i, (v, r) in enumerate(zip(x, sizes))]
    raise TypeError(
        f"{where}: {name} must be a tensor or a tuple/list with one entry per microbatch, got {type(x).__name__}"
    )


def cut_inputs(where: str, data, n_microbatches):
    """(inputs, cut, presplit): per microbatch the first chunk's positional arguments; cut(name, x)
    cuts targets or grad_outputs to match; presplit tells which form data had. n_microbatches: None
    (4 for one batch, the count of pre-split microbatches) or an int >= 1 (for pre-split data, their
    count)."""
    if n_microbatches is not None:
        check_int(where, "n_microbatches", n_microbatches, 1)
    if is_presplit(where, data):
        if n_microbatches is not None and n_microbatches != len(data):
            raise ValueError(
                f"{where}: n_microbatches={n_microbatches} but data holds {len(data)} pre-split "
                f"microbatches; leave n_microbatches out or pass {len(data)}"
            )
        inputs, sizes = _presplit(where, data)
        return inputs, lambda name, x: _cut_sizes(where, name, x, sizes), True
    n = DEFAULT_MICROBATCHES if n_microbatches is None else n_microbatches
    inputs, rows = split_batch(data, n)
    return inputs, lambda name, x: split_tensors(name, x, n, rows), False


def loss_or_grads(loss_fn, grad_outputs, targets, cut, presplit: bool, n: int):
    """Pipeline.step's (loss_fn, grads per microbatch or None): grad_outputs cut like the data (a
    callable repeated), else loss_fn, or without one output.sum() (run.sum_loss); TypeError and
    ValueError for what does not go together."""
    if grad_outputs is not None and loss_fn is not None:
        raise ValueError("Pipeline.step: give loss_fn or grad_outputs, not both")
    if loss_fn is not None and not callable(loss_fn):
        raise TypeError(f"Pipeline.step: loss_fn must be callable, got {type(loss_fn).__name__}")
    if grad_outputs is not None:
        if callable(grad_outputs):
            return None, [grad_outputs] * n
        if torch.is_tensor(grad_outputs) or isinstance(grad_outputs, (tuple, list) if presplit else tuple):
            return None, cut("grad_outputs", grad_outputs)
        raise TypeError(
            "Pipeline.step: grad_outputs must be a tensor, a tuple of tensors (None where an "
            f"output gets no gradient) or a callable, got {type(grad_outputs).__name__}"
        )
    if loss_fn is None:
        if targets is not None:
            raise ValueError(
                "Pipeline.step: targets given without loss_fn; pass loss_fn=(output, target) -> loss"
            )
        loss_fn = sum_loss
    return loss_fn, None
