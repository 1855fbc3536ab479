"""quantize="auto": which format the frozen block weights are packed in (none, int8, NF4), and the
device and pinned-host room it weighs them against; pure arithmetic over byte counts that
runtime/quantize.py counts on the live model."""

from __future__ import annotations

from .rules import HOST_RAM_SHARE

GIB = 2**30


def device_room(free: int, on_device: int, headroom: float, share: float) -> tuple[int, str]:
    """(bytes the weights may take on the device, the text saying so): `share` (wrap_rules.weight_share,
    the share param_offload="auto" keeps for weights, so that what is planned resident here stays
    so) of what the process may still take (`free`) plus what the model holds there already
    (`on_device`), after `headroom`."""
    room = int((free + on_device) * (1 - headroom) * share)
    return room, (
        f"device: {share:.0%} of ({free / GIB:.2f} GiB free + {on_device / GIB:.2f} GiB already "
        f"there) after {headroom:.0%} headroom = {room / GIB:.2f} GiB"
    )


def smallest_host_state(numel: int, working_bytes: int) -> int:
    """Host bytes of `numel` trained elements' optimizer state at its smallest: an fp32 master,
    two bf16 moments and the landing buffer in the working dtype."""
    return numel * (4 + 2 * 2 + working_bytes)


def host_room(available: int, state: int) -> tuple[int, str]:
    """(pinned host bytes streamed blocks may take, the text saying so): HOST_RAM_SHARE of the
    `available` RAM less the trained parameters' host `state` (smallest_host_state)."""
    room = max(0, int(HOST_RAM_SHARE * available) - state)
    return room, (
        f"host: {HOST_RAM_SHARE:.0%} of {available / GIB:.2f} GiB available RAM - "
        f"{state / GIB:.2f} GiB of host optimizer state = {room / GIB:.2f} GiB"
    )


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
