"""quantize_model() / dequantize_model(): pack the frozen Linear weights of a model's block stack
as int8 or NF4, in place, and expand them back into permanent weights."""

from __future__ import annotations

import torch
import torch.nn as nn

from ..options import parse_block_size  # defined there (a leaf); hf_load imports it from here
from .packed import EXPAND, FORMATS, dequantize_module_, is_quantized, quantizable, quantize_module_

__all__ = ["quantize_model", "dequantize_model", "parse_format", "parse_block_size", "targets"]


def parse_format(value, where: str = "quantize_model(): quantize") -> str:
    if isinstance(value, str) and value in FORMATS:
        return value
    raise ValueError(f"{where}={value!r} is not accepted; accepted: 'int8', 'nf4'")


def _is_adapter(parent: nn.Module | None) -> bool:
    """peft keeps its adapters (lora_A, lora_B, ...) in nn.ModuleDicts keyed by adapter name."""
    return isinstance(parent, nn.ModuleDict)


def targets(model: nn.Module, blocks=None) -> tuple[list[tuple[str, nn.Module]], list[str]]:
    """([(name, module)] to pack, [names of trained weights left as they are]) in the block stack
    (``blocks``, default find_blocks(model)). With explicit blocks, a trained weight among them
    that is not an adapter raises ValueError naming it (freeze it first)."""
    from ..blocks import check_blocks, find_blocks  # noqa: PLC0415

    explicit = blocks is not None
    if explicit:
        if isinstance(blocks, nn.Module) or not isinstance(blocks, (list, tuple)) or not blocks:
            raise ValueError(
                f"quantize_model(): blocks={blocks!r} is not accepted; accepted: None (the block stack) "
                "or a non-empty list of nn.Module"
            )
        if not all(isinstance(b, nn.Module) for b in blocks):
            raise ValueError("quantize_model(): blocks must hold nn.Module objects only")
        check_blocks("quantize_model()", model, blocks)
    else:
        blocks = find_blocks(model)
    names = {id(m): n for n, m in model.named_modules(remove_duplicate=False)}
    out, trained, seen = [], [], set()
    for block in blocks:
        stack = [(None, block)]
        while stack:
            parent, m = stack.pop(0)
            if id(m) in seen:
                continue
            seen.add(id(m))
            stack[:0] = [(m, c) for c in m.children()]
            if quantizable(m) is None:
                continue
            name = names.get(id(m), type(m).__name__)
            if m.weight.requires_grad:
                if explicit and not _is_adapter(parent):
                    raise ValueError(
                        f"quantize_model(): {name}.weight requires grad: only frozen weights are "
                        "quantized (set requires_grad=False on it, or leave it out of blocks=)"
                    )
                trained.append(f"{name}.weight")
                continue
            out.append((name, m))
    return out, trained


def quantize_model(
    model: nn.Module, quantize: str = "nf4", *, blocks=None, block_size: int = 64, pin_budget=None
) -> dict:
    """Packs, in place, every frozen Linear (and transformers Conv1D) weight of the block stack as
    ``quantize`` ("int8" or "nf4") codes with a float32 absmax per ``block_size`` elements, kept as
    buffers on the weight's device; embeddings, the output layer and trained weights stay as they
    are. Forward and backward expand each weight right before use; ``model.state_dict()`` serves
    the dequantized values; ``dequantize_model`` makes them permanent.

    pin_budget: None, or bytes of packed codes of a model on the CPU to keep in page-locked memory
    (when torch sees a GPU; they then upload faster).
    Returns {"tensors": weights packed, "bytes_before", "bytes_after"} (those weights' bytes).
    Raises ValueError for an unknown format, a bad block size or a trained weight asked for.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"quantize_model(): model must be a torch.nn.Module, got {type(model).__name__}")
    fmt = parse_format(quantize)
    block_size = parse_block_size(block_size)
    if pin_budget is not None and (
        isinstance(pin_budget, bool) or not isinstance(pin_budget, int) or pin_budget < 0
    ):
        raise ValueError(
            f"quantize_model(): pin_budget={pin_budget!r} is not accepted; accepted: None or an integer >= 0 (bytes)"
        )
    todo, _trained = targets(model, blocks)
    other = sorted(
        {(m.quant_format, m.quant_block_size) for m in model.modules() if is_quantized(m)}
        - {(fmt, block_size)}
    )
    if other:  # packing the rest differently would leave a model of two formats, reported as one
        raise ValueError(
            f"quantize_model(): the model is already quantized as {', '.join(f'{f} (block_size {b})' for f, b in other)}; "
            f"quantize={fmt!r}, block_size={block_size} would mix formats: call ramstream.dequantize_model(model) first"
        )
    for name, m in todo:
        if m.weight.dtype not in (torch.float32, torch.bfloat16, torch.float16):
            raise TypeError(
                f"quantize_model(): {name}.weight is {m.weight.dtype}; accepted: float32, bfloat16, float16"
            )
    before = after = 0
    pin_left = pin_budget if pin_budget is not None and torch.cuda.is_available() else None
    for _name, m in todo:
        w = m._parameters["weight"]
        before += w.nbytes
        nbytes_est = w.numel() // (2 if fmt == "nf4" else 1)
        pin = pin_left is not None and w.device.type == "cpu" and 0 < nbytes_est <= pin_left
        packed = quantize_module_(m, fmt, block_size, pin=pin)
        if pin:
            pin_left -= packed
        after += packed
    return {"tensors": len(todo), "bytes_before": before, "bytes_after": after}


def dequantize_model(model: nn.Module) -> int:
    """Replaces every quantized weight of ``model`` by a frozen parameter holding its dequantized
    values (the original dtype, on the codes' device); returns how many. Frees the shared expand
    buffers."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"dequantize_model(): model must be a torch.nn.Module, got {type(model).__name__}")
    mods = [m for m in model.modules() if is_quantized(m)]
    for m in mods:
        dequantize_module_(m)
    EXPAND.clear()
    return len(mods)


def quantized_bytes(model: nn.Module) -> tuple[int, int]:
    """(full-precision bytes, packed bytes) of the model's quantized weights."""
    full = packed = 0
    for m in model.modules():
        if is_quantized(m):
            n = 1
            for d in m.quant_shape:
                n *= d
            full += n * torch.empty((), dtype=m.quant_dtype).element_size()
            packed += m.weight_codes.nbytes + m.weight_absmax.nbytes
    return full, packed
