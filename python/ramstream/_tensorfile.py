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

import errno
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


# The safetensors library's limits: a header of at most 100 MB, sizes that fit in 64 bits.
_MAX_HEADER = 100_000_000
_U64 = 1 << 64
_FIELDS = ("dtype", "shape", "data_offsets")


def _parse_int(s: str):
    # the safetensors library reads "-0" as a float, which no size or offset may be
    return -0.0 if s == "-0" else int(s)


def _parse_float(s: str) -> float:
    v = float(s)
    if not math.isfinite(v):
        raise ValueError(f"number {s} is out of range")
    return v


def _parse_constant(s: str):
    raise ValueError(f"{s} is not a JSON value")


def _object(pairs: list) -> dict:
    out = {}
    for k, v in pairs:
        k.encode("utf-8")  # a lone surrogate escape ("\\ud800") is no UTF-8 text
        if k in out:
            raise ValueError(f"key {k!r} appears twice")
        out[k] = v
    return out


def _size(v) -> bool:
    """A size or an offset as the format stores it: a JSON integer in [0, 2**64)."""
    return type(v) is int and 0 <= v < _U64


def _parse_header(raw: bytes, at: str) -> dict:
    try:
        text = raw.decode("utf-8")  # strict: no BOM skipped, no other encoding guessed
    except UnicodeDecodeError as e:
        raise ValueError(f"{at}: the header is not UTF-8 text ({e})") from None
    try:
        header = json.loads(
            text,
            object_pairs_hook=_object,
            parse_int=_parse_int,
            parse_float=_parse_float,
            parse_constant=_parse_constant,
        )
    except (ValueError, RecursionError) as e:
        raise ValueError(f"{at}: the header is not valid JSON ({e})") from None
    if not isinstance(header, dict):
        raise ValueError(f"{at}: the header is not a JSON object but a {type(header).__name__}")
    return header


def _check_entry(at: str, info, data: int) -> tuple[int, int]:
    """One tensor's header entry checked on its own; its (begin, end) in the data section."""
    if not isinstance(info, dict):
        raise ValueError(
            f"{at}: the header entry is a {type(info).__name__}, not an object {{{', '.join(_FIELDS)}}}"
        )
    missing = [k for k in _FIELDS if k not in info]
    unknown = sorted(set(info) - set(_FIELDS))
    if missing or unknown:
        raise ValueError(
            f"{at}: the header entry has fields {sorted(info)}; a safetensors entry has exactly "
            f"{', '.join(_FIELDS)}"
        )
    dtype, shape, offsets = info["dtype"], info["shape"], info["data_offsets"]
    if not isinstance(dtype, str) or dtype not in _DTYPES:
        raise ValueError(f"{at}: dtype {dtype!r} is not supported; accepted: {', '.join(_DTYPES)}")
    if not isinstance(shape, list) or not all(_size(d) for d in shape):
        raise ValueError(f"{at}: shape {shape!r} is not a list of non-negative integers")
    if not isinstance(offsets, list) or len(offsets) != 2 or not all(_size(o) for o in offsets):
        raise ValueError(
            f"{at}: data_offsets {offsets!r} is not a pair [begin, end] of non-negative integers"
        )
    numel = 1
    for d in shape:  # in order, as the format's reader multiplies: no size beyond 64 bits
        numel *= d
        if numel >= _U64:
            break
    want = numel * _DTYPES[dtype].itemsize
    if numel >= _U64 or want * 8 >= _U64:
        raise ValueError(f"{at}: shape {shape} of {dtype} holds more bytes than a 64-bit size can count")
    begin, end = offsets
    if not begin <= end or end - begin != want:
        raise ValueError(f"{at}: offsets {begin}..{end} do not hold {shape} {dtype} ({want} bytes)")
    if end > data:
        raise ValueError(
            f"{at}: offsets {begin}..{end} run past the end of the data ({data} bytes): the file is "
            "truncated or its header is wrong"
        )
    return begin, end


def read_header(path: str, where: str) -> tuple[dict[str, dict], dict[str, str], int]:
    """(tensors' header entries, metadata, offset of the data) of a safetensors file, validated as
    the format requires before any tensor byte is used (the one check load_checkpoint and
    load_model share): the 8-byte little-endian header length within the file and at most 100 MB;
    the header a UTF-8 JSON object (padding by trailing spaces allowed); every entry exactly
    {dtype: a known code, shape: [non-negative ints], data_offsets: [begin, end]} with end - begin
    = dtype size x product(shape); "__metadata__", if present, {str: str} (or null); the entries'
    byte ranges, in offset order, contiguous from 0 and covering the data section exactly (no
    overlap, no gap, nothing after the last). A file this accepts, safetensors.safe_open accepts
    too (tests/test_safetensors_fuzz.py). ValueError naming `where` (the caller), the file and the
    tensor or key otherwise; FileNotFoundError naming the file when there is none."""
    try:
        size = os.path.getsize(path)
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise ValueError(f"{where}: {path} is truncated ({size} bytes, not even a header length)")
            (n,) = struct.unpack("<Q", head)
            if 8 + n > size:
                raise ValueError(
                    f"{where}: {path}: header length {n} runs past the end of the file ({size} bytes)"
                )
            if n > _MAX_HEADER:
                raise ValueError(
                    f"{where}: {path}: header length {n} is more than the {_MAX_HEADER} bytes the format allows"
                )
            raw = f.read(n)
    except FileNotFoundError:
        raise FileNotFoundError(errno.ENOENT, f"{where}: no such safetensors file", path) from None
    if len(raw) != n:
        raise ValueError(f"{where}: {path} shrank while its header was read")
    header = _parse_header(raw, f"{where}: {path}")
    meta = header.pop("__metadata__", None)
    if meta is None:
        meta = {}
    if not isinstance(meta, dict) or not all(isinstance(v, str) for v in meta.values()):
        raise ValueError(f"{where}: {path}: __metadata__ {meta!r:.200} is not an object of strings")
    for k, v in meta.items():
        try:
            v.encode("utf-8")  # a lone surrogate escape ("\\ud800") is no UTF-8 text
        except UnicodeEncodeError:
            raise ValueError(f"{where}: {path}: __metadata__ {k!r} is not UTF-8 text") from None
    data = size - 8 - n
    spans = []
    for name, info in header.items():
        spans.append((*_check_entry(f"{where}: {path}, tensor {name!r}", info, data), name))
    spans.sort()
    covered, last = 0, None
    for begin, end, name in spans:
        if begin > covered:
            raise ValueError(
                f"{where}: {path}, tensor {name!r}: offsets {begin}..{end} leave bytes {covered}..{begin} "
                "of the data to no tensor (a gap: the header is wrong)"
            )
        if begin < covered:
            raise ValueError(
                f"{where}: {path}, tensor {name!r}: offsets {begin}..{end} overlap tensor {last!r} "
                f"(which ends at {covered}): the header is wrong"
            )
        covered, last = end, name
    if covered != data:
        raise ValueError(
            f"{where}: {path}: the tensors cover {covered} bytes of the {data}-byte data section; the "
            f"{data - covered} bytes after them belong to no tensor (a header that lies or bytes appended)"
        )
    return header, meta, 8 + n
