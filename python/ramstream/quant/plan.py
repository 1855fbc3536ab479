"""wrap()'s quantize / prefer decision: which format the frozen block weights are packed in, with
the numbers behind it (memory_report(model)["params"]["quantize"])."""

from __future__ import annotations

import torch

from .model import parse_block_size, quantize_model, targets

__all__ = ["parse_quantize_option", "parse_prefer", "decide", "apply_quantize"]

GIB = 2**30


def parse_quantize_option(value) -> str:
    """'auto', 'none' (also None, False), 'int8', 'nf4'."""
    if value is None or value is False:
        return "none"
    if isinstance(value, str) and value in ("auto", "none", "int8", "nf4"):
        return value
    raise ValueError(
        f"wrap(): option quantize={value!r} is not accepted; accepted: 'auto', 'none', None, False, 'int8', 'nf4'"
    )


def parse_prefer(value) -> str:
    if isinstance(value, str) and value in ("exact", "speed"):
        return value
    raise ValueError(f"wrap(): option prefer={value!r} is not accepted; accepted: 'exact', 'speed'")


def parse_quant_block_size(value) -> int:
    return parse_block_size(value, "wrap(): option quant_block_size")


def decide(
    *,
    total: int,
    packable_bytes: int,
    packable_numel: int,
    room: int | None,
    prefer: str,
    can_stream: bool,
    block_size: int,
) -> tuple[str, str]:
    """(format, reason) for quantize='auto'. ``total``: bytes of the weights and buffers on the
    device unquantized; ``packable_*``: the frozen block weights; ``room``: bytes the weights may
    take on the device (None: the CPU engine, which never quantizes); ``can_stream``: whether
    param_offload may stream blocks instead. int8 comes before NF4; prefer='speed' picks NF4 when
    it keeps every block resident while the unquantized weights would stream."""
    if room is None:
        return "none", "the CPU engine never quantizes on its own"
    if packable_numel == 0:
        return "none", "no frozen block weights"
    size = {
        "int8": total - packable_bytes + packable_numel * (1 + 4 / block_size),
        "nf4": total - packable_bytes + packable_numel * (0.5 + 4 / block_size),
    }
    if total <= room:
        return "none", f"the weights fit: {total / GIB:.2f} GiB <= {room / GIB:.2f} GiB"
    if prefer == "speed" and size["nf4"] <= room:
        return "nf4", (
            f"prefer='speed': NF4 keeps every block on the device ({size['nf4'] / GIB:.2f} GiB <= "
            f"{room / GIB:.2f} GiB) where the unquantized weights ({total / GIB:.2f} GiB) would stream"
        )
    if can_stream:
        return "none", f"{total / GIB:.2f} GiB > {room / GIB:.2f} GiB: blocks stream instead (exact)"
    for fmt in ("int8", "nf4"):
        if size[fmt] <= room:
            return fmt, (
                f"{total / GIB:.2f} GiB > {room / GIB:.2f} GiB and nothing streams: {fmt} needs "
                f"{size[fmt] / GIB:.2f} GiB"
            )
    return "none", f"even NF4 ({size['nf4'] / GIB:.2f} GiB) exceeds {room / GIB:.2f} GiB"


def apply_quantize(model, opts, device: torch.device, log) -> tuple[dict | None, set]:
    """Runs wrap()'s quantize option on the model before streaming is planned: returns (the
    report for memory_report, ids of the weight parameters it replaced)."""
    option = opts.quantize
    if option == "none":
        return None, set()
    try:
        todo, _ = targets(model, opts.blocks)
    except ValueError:
        if option == "auto":
            return {"format": None, "reason": "no block stack found"}, set()
        raise
    reason = f"quantize={option!r}"
    fmt = option
    if option == "auto":
        room = None
        if device.type == "cuda":
            from ..hardware import gpu_memory  # noqa: PLC0415

            mem = gpu_memory(device)
            on_dev = sum(
                t.nbytes for t in list(model.parameters()) + list(model.buffers()) if t.device == device
            )
            room = int((mem["free"] + on_dev) * (1 - opts.vram_headroom) * 0.7)
        total = sum(
            t.nbytes for t in {id(t): t for t in list(model.parameters()) + list(model.buffers())}.values()
        )
        fmt, reason = decide(
            total=total,
            packable_bytes=sum(m.weight.nbytes for _, m in todo),
            packable_numel=sum(m.weight.numel() for _, m in todo),
            room=room,
            prefer=opts.prefer,
            can_stream=opts.param_offload is not False,
            block_size=opts.quant_block_size,
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
    }, removed
