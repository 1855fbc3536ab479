"""wrap()'s quantize option applied: the numbers quantize="auto" weighs, counted on the live model
and machine (weight bytes, the frozen block weights, free VRAM, available RAM), the format
planner/quantize.py decide picks from them, and the packing (quant/model.py quantize_model), with
the numbers behind it (memory_report(model)["params"]["quantization"])."""

from __future__ import annotations

import torch

from ..planner import quantize as plan_quantize
from ..planner.wrap_rules import weight_share
from ..quant.model import quantize_model, targets

__all__ = ["apply_quantize"]

GIB = 2**30


def _host_room(model) -> tuple[int, str]:
    """planner/quantize.py host_room on this machine's available RAM and the model's trained
    parameters."""
    from ..planner.profile import available_ram

    trained = [p for p in dict.fromkeys(model.parameters()) if p.requires_grad]
    state = sum(plan_quantize.smallest_host_state(p.numel(), p.element_size()) for p in trained)
    return plan_quantize.host_room(available_ram()["available"], state)


def apply_quantize(model, opts, device: torch.device, log) -> tuple[dict | None, set]:
    """Runs wrap()'s quantize option on the model before streaming is planned: returns (the
    report for memory_report, ids of the weight parameters it replaced)."""
    from ..quant.packed import is_quantized

    option = opts.quantize
    packed_already = any(is_quantized(m) for m in model.modules())
    if option == "none":
        if packed_already:  # as TrainStream: "none" contradicts weights quantized beforehand
            raise ValueError(
                "wrap(): quantize='none' but the model already holds quantized weights "
                "(quantize_model, load_model); pass quantize='auto' or their format, or call "
                "ramstream.dequantize_model(model) first"
            )
        return None, set()
    try:
        todo, _ = targets(model, opts.blocks)
    except ValueError:
        if option == "auto":
            return {"format": None, "reason": "no block stack found"}, set()
        raise
    if option != "auto" and not todo and not packed_already:  # as TrainStream: nothing to pack
        raise ValueError(
            f"wrap(): quantize={option!r} but the block stack holds no frozen Linear weights: only "
            "frozen weights (a LoRA base) are quantized, trained ones never; freeze the base (or add "
            "adapters) first, or pass quantize='auto' or 'none'"
        )
    reason = f"quantize={option!r}"
    fmt = option
    if option == "auto":
        room, host_room, explain = None, None, ""
        can_stream = opts.param_offload is not False
        if device.type == "cuda":
            from ..blocks import find_blocks
            from ..hardware import gpu_memory
            from .inspect import block_elements

            mem = gpu_memory(device)
            on_dev = sum(
                t.nbytes for t in list(model.parameters()) + list(model.buffers()) if t.device == device
            )
            # the share param_offload="auto" keeps for weights: what is planned resident here stays so
            blocks = list(opts.blocks) if opts.blocks is not None else find_blocks(model)
            share = weight_share(*block_elements(blocks))
            room, explain = plan_quantize.device_room(mem["free"], on_dev, opts.vram_headroom, share)
            if can_stream:
                host_room, host_text = _host_room(model)
                explain += "; " + host_text
        total = sum(
            t.nbytes for t in {id(t): t for t in list(model.parameters()) + list(model.buffers())}.values()
        )
        fmt, reason = plan_quantize.decide(
            total=total,
            packable_bytes=sum(m.weight.nbytes for _, m in todo),
            packable_numel=sum(m.weight.numel() for _, m in todo),
            room=room,
            prefer=opts.prefer,
            can_stream=can_stream,
            block_size=opts.quant_block_size,
            host_room=host_room,
            check=opts.check_memory,
            explain=explain,
        )
        if fmt == "none":
            log(f"quantize=auto -> none ({reason})")
            return {
                "format": None,
                "reason": reason,
                "tensors": 0,
                "bytes_before": 0,
                "bytes_after": 0,
            }, set()
    removed = {id(m._parameters["weight"]) for _, m in todo}
    rep = quantize_model(model, fmt, blocks=opts.blocks, block_size=opts.quant_block_size)
    log(
        f"quantize: {rep['tensors']} frozen block weights as {fmt} ({reason}): "
        f"{rep['bytes_before'] / GIB:.3f} -> {rep['bytes_after'] / GIB:.3f} GiB"
    )
    return {
        "format": fmt,
        "reason": reason,
        **rep,
        "bytes_saved": rep["bytes_before"] - rep["bytes_after"],
        "packed_streamed_bytes": 0,  # wrap() sets what streamed blocks carry to pinned memory
    }, removed
