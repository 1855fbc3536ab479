"""safetensors files written one tensor at a time and read back memory-mapped (no pickle).

The format (https://huggingface.co/docs/safetensors): an 8-byte little-endian header length,
a JSON header {name: {"dtype", "shape", "data_offsets"}, "__metadata__": {str: str}}, then the
tensors' bytes back to back. The writer takes each tensor from a callable at the moment its
bytes go to disk, so saving the host state holds one tensor's copy at most (none for CPU
tensors, which are written from their own memory). Tensors are laid out widest dtype first, so
that every tensor starts at a multiple of its element size and the reader can view the mapped
file in place. Files are written to a temporary name, flushed to disk and renamed.
"""

from __future__ import annotations

import json
import math
import os
import struct
from collections.abc import Callable, Iterable

import torch

_CODES = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
}
_DTYPES = {v: k for k, v in _CODES.items()}

# (name, dtype, shape, get): get() returns the tensor when its bytes are written
Entry = tuple[str, torch.dtype, tuple, Callable[[], torch.Tensor]]


def entry(name: str, t: torch.Tensor) -> Entry:
    """An Entry for a tensor that already exists."""
    return (name, t.dtype, tuple(t.shape), lambda: t)


def _write_tensor(f, t: torch.Tensor) -> None:
    """Writes a contiguous CPU tensor's bytes (a module function so tests can interrupt it)."""
    if t.numel():
        f.write(memoryview(t.reshape(-1).view(torch.uint8).numpy()))


def fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_json(path: str, obj) -> None:
    """JSON to a temporary name, flushed, then renamed to `path`."""
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=1, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def write_safetensors(path: str, entries: Iterable[Entry], metadata: dict | None = None) -> int:
    """Writes the entries as one safetensors file at `path`; returns the bytes of tensor data.
    ValueError when a tensor's dtype is not storable or get() returns another dtype or shape."""
    items = list(entries)
    for name, dtype, _, _ in items:
        if dtype not in _CODES:
            raise ValueError(f"save_checkpoint: tensor {name!r} has dtype {dtype}, which is not storable")
    items.sort(key=lambda e: -torch.empty((), dtype=e[1]).element_size())  # stable
    header: dict = {}
    offset = 0
    for name, dtype, shape, _ in items:
        n = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
        header[name] = {"dtype": _CODES[dtype], "shape": list(shape), "data_offsets": [offset, offset + n]}
        offset += n
    if metadata:
        header["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # tensor data starts 8-byte aligned
    tmp = path + ".tmp"
    with open(tmp, "wb") as f:
        f.write(struct.pack("<Q", len(raw)))
        f.write(raw)
        for name, dtype, shape, get in items:
            t = get().detach()
            if t.dtype != dtype or tuple(t.shape) != tuple(shape):
                raise ValueError(
                    f"save_checkpoint: tensor {name!r} changed while saving "
                    f"({dtype} {tuple(shape)} -> {t.dtype} {tuple(t.shape)})"
                )
            _write_tensor(f, t.to("cpu").contiguous())
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    return offset


def read_safetensors(path: str) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """(tensors, metadata) of a safetensors file. The tensors are views of the file mapped
    privately (copy-on-write), so reading a large file costs page cache, not a second copy in
    RAM; a tensor not aligned to its element size (a file from another writer) is copied.
    ValueError naming the file (and tensor) when it is not a valid safetensors file (read_header)."""
    header, meta, start = read_header(path, "load_checkpoint")
    size = os.path.getsize(path)
    base = torch.from_file(path, shared=False, size=size, dtype=torch.uint8) if size else None
    out = {}
    for name, info in header.items():
        dtype, shape, (a, b) = _DTYPES[info["dtype"]], tuple(info["shape"]), info["data_offsets"]
        width = dtype.itemsize
        raw = base[start + a : start + b] if b > a else torch.empty(0, dtype=torch.uint8)
        if (start + a) % width:
            raw = raw.clone()
        out[name] = raw.view(dtype).view(shape)
    return out, meta


_MAX_HEADER = 100 << 20


def read_header(path: str, where: str) -> tuple[dict[str, dict], dict[str, str], int]:
    """(tensors' header entries, metadata, offset of the data) of a safetensors file, checked: the
    header is JSON, every dtype known, every tensor's byte range matches its shape and lies inside
    the file. ValueError naming `where` (the caller), the file and the tensor otherwise."""
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise ValueError(f"{where}: {path} is truncated ({size} bytes, not even a header length)")
        (n,) = struct.unpack("<Q", head)
        if n > _MAX_HEADER or 8 + n > size:
            raise ValueError(
                f"{where}: {path}: header length {n} runs past the end of the file ({size} bytes)"
            )
        raw = f.read(n)
    try:
        header = json.loads(raw)
    except ValueError as e:
        raise ValueError(f"{where}: {path}: the header is not valid JSON ({e})") from None
    if not isinstance(header, dict):
        raise ValueError(f"{where}: {path}: the header is not a JSON object")
    meta = header.pop("__metadata__", None) or {}
    data = size - 8 - n
    for name, info in header.items():
        at = f"{where}: {path}, tensor {name!r}"
        try:
            dtype, shape, (begin, end) = info["dtype"], info["shape"], info["data_offsets"]
        except (KeyError, TypeError, ValueError):
            raise ValueError(f"{at}: malformed header entry {info!r}") from None
        if dtype not in _DTYPES:
            raise ValueError(f"{at}: dtype {dtype!r} is not supported; accepted: {', '.join(_DTYPES)}")
        if not all(isinstance(d, int) and d >= 0 for d in shape) or not all(
            isinstance(o, int) for o in (begin, end)
        ):
            raise ValueError(f"{at}: malformed shape {shape!r} or offsets {(begin, end)!r}")
        want = math.prod(shape) * _DTYPES[dtype].itemsize
        if not 0 <= begin <= end or end - begin != want:
            raise ValueError(f"{at}: offsets {begin}..{end} do not hold {shape} {dtype} ({want} bytes)")
        if end > data:
            raise ValueError(
                f"{at}: offsets {begin}..{end} run past the end of the data ({data} bytes): the file is "
                "truncated or its header is wrong"
            )
    return header, meta, 8 + n
