"""wrap()'s quantize / prefer decision: which format the frozen block weights are packed in, with
the numbers behind it (memory_report(model)["params"]["quantization"])."""

from __future__ import annotations

import torch

from ..options import parse_prefer, parse_quant_block_size, parse_quantize_option  # defined there (a leaf)
from .model import quantize_model, targets

__all__ = ["parse_quantize_option", "parse_prefer", "parse_quant_block_size", "decide", "apply_quantize"]

GIB = 2**30


def _sizes(total: int, packable_bytes: int, packable_numel: int, block_size: int) -> dict:
    """The weights' bytes unquantized and with the frozen block weights packed as int8 / NF4 (codes
    plus a float32 absmax per block)."""
    rest = total - packable_bytes
    return {
        "none": total,
        "int8": rest + packable_numel * (1 + 4 / block_size),
        "nf4": rest + packable_numel * (0.5 + 4 / block_size),
    }


def decide(
    *,
    total: int,
    packable_bytes: int,
    packable_numel: int,
    room: int | None,
    prefer: str,
    can_stream: bool,
    block_size: int,
    host_room: int | None = None,
    check: bool = True,
    explain: str = "",
) -> tuple[str, str]:
    """(format, reason) for quantize='auto'. ``total``: bytes of the weights and buffers on the
    device unquantized; ``packable_*``: the frozen block weights; ``room``: bytes the weights may
    take on the device (None: the CPU engine, which never quantizes); ``can_stream``: whether
    param_offload may stream blocks instead; ``host_room``: bytes of pinned host memory streamed
    blocks may take (None: not limited). The unquantized weights come first, then int8, then NF4:
    resident when they fit in ``room``, else streamed when they fit in room + host_room.
    prefer='speed' picks NF4 when it keeps every block resident while the unquantized weights
    would stream. When even NF4 does not fit: MemoryError showing the arithmetic (``explain``
    says where room and host_room come from), or ("none", why) with ``check=False``."""
    if room is None:
        return "none", "the CPU engine never quantizes on its own"
    if packable_numel == 0:
        return "none", "no frozen block weights"
    size = _sizes(total, packable_bytes, packable_numel, block_size)
    if total <= room:
        return "none", f"the weights fit: {total / GIB:.2f} GiB <= {room / GIB:.2f} GiB"
    if prefer == "speed" and size["nf4"] <= room:
        return "nf4", (
            f"prefer='speed': NF4 keeps every block on the device ({size['nf4'] / GIB:.2f} GiB <= "
            f"{room / GIB:.2f} GiB) where the unquantized weights ({total / GIB:.2f} GiB) would stream"
        )
    cap = room + (host_room if host_room is not None else float("inf")) if can_stream else room
    for fmt in ("none", "int8", "nf4"):
        if fmt != "none" and size[fmt] <= room:
            return fmt, (
                f"{total / GIB:.2f} GiB > {room / GIB:.2f} GiB"
                + (" and nothing streams" if not can_stream else "")
                + f": {fmt} needs {size[fmt] / GIB:.2f} GiB (every block on the device)"
            )
        if can_stream and size[fmt] <= cap:
            if fmt == "none":
                return "none", f"{total / GIB:.2f} GiB > {room / GIB:.2f} GiB: blocks stream instead (exact)"
            return fmt, (
                f"{total / GIB:.2f} GiB > {room / GIB:.2f} GiB on the device + {host_room / GIB:.2f} GiB "
                f"of pinned host memory: {fmt} needs {size[fmt] / GIB:.2f} GiB (blocks stream)"
            )
    where = f"{room / GIB:.2f} GiB on the device" + (
        f" + {host_room / GIB:.2f} GiB of pinned host memory for streamed blocks" if can_stream else ""
    )
    why = (
        f"even NF4 ({size['nf4'] / GIB:.2f} GiB) exceeds {where} (= {cap / GIB:.2f} GiB); "
        f"unquantized {size['none'] / GIB:.2f}, int8 {size['int8'] / GIB:.2f} GiB"
    )
    if not check:
        return "none", why + "; check_memory=False: going on"
    hints = ["a smaller model", "a larger GPU or more RAM"]
    if not can_stream:
        hints.insert(0, "param_offload='auto' or True (blocks stream from pinned host memory)")
    raise MemoryError(
        f"wrap(): quantize='auto': the weights do not fit even as NF4: {packable_numel:,} frozen "
        f"block weight elements x (0.5 + 4/{block_size}) B + {(total - packable_bytes) / GIB:.2f} GiB "
        f"of other weights = {size['nf4'] / GIB:.2f} GiB > {where} = {cap / GIB:.2f} GiB"
        + (f" ({explain})" if explain else "")
        + f". Unquantized {size['none'] / GIB:.2f} GiB, int8 {size['int8'] / GIB:.2f} GiB. "
        "What would fit: " + "; ".join(hints) + " (check_memory=False skips this check)"
    )


def _host_room(model) -> tuple[int, str]:
    """Pinned host bytes streamed blocks may take: 90 % of the available RAM less the trained
    parameters' host state at its smallest (fp32 master, bf16 moments, landing buffer)."""
    from ..host_fit import SHARE  # noqa: PLC0415
    from ..planner.profile import available_ram  # noqa: PLC0415

    ram = available_ram()
    trained = [p for p in dict.fromkeys(model.parameters()) if p.requires_grad]
    state = sum(p.numel() * (4 + 2 * 2 + p.element_size()) for p in trained)
    room = max(0, int(SHARE * ram["available"]) - state)
    text = (
        f"host: {SHARE:.0%} of {ram['available'] / GIB:.2f} GiB available RAM - "
        f"{state / GIB:.2f} GiB of host optimizer state = {room / GIB:.2f} GiB"
    )
    return room, text


def apply_quantize(model, opts, device: torch.device, log) -> tuple[dict | None, set]:
    """Runs wrap()'s quantize option on the model before streaming is planned: returns (the
    report for memory_report, ids of the weight parameters it replaced)."""
    from .packed import is_quantized  # noqa: PLC0415

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
            from ..hardware import gpu_memory  # noqa: PLC0415

            mem = gpu_memory(device)
            on_dev = sum(
                t.nbytes for t in list(model.parameters()) + list(model.buffers()) if t.device == device
            )
            from ..blocks import find_blocks  # noqa: PLC0415
            from ..weights.setup import weight_share  # noqa: PLC0415

            # the share param_offload="auto" keeps for weights: what is planned resident here stays so
            share = weight_share(list(opts.blocks) if opts.blocks is not None else find_blocks(model))
            room = int((mem["free"] + on_dev) * (1 - opts.vram_headroom) * share)
            explain = (
                f"device: {share:.0%} of ({mem['free'] / GIB:.2f} GiB free + {on_dev / GIB:.2f} GiB already "
                f"there) after {opts.vram_headroom:.0%} headroom = {room / GIB:.2f} GiB"
            )
            if can_stream:
                host_room, host_text = _host_room(model)
                explain += "; " + host_text
        total = sum(
            t.nbytes for t in {id(t): t for t in list(model.parameters()) + list(model.buffers())}.values()
        )
        fmt, reason = decide(
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
