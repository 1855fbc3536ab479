"""The safetensors files of a checkpoint folder, their headers validated against the file sizes
before any tensor is read (a truncated file or offsets past the end name the file and tensor)."""

from __future__ import annotations

import json
import math
import os
import struct

__all__ = ["checkpoint_files", "read_header", "DTYPES"]

# safetensors dtype names -> bytes per element
DTYPES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1, "BOOL": 1}
_PICKLES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")
_MAX_HEADER = 100 << 20


def checkpoint_files(folder: str) -> list[str]:
    """The .safetensors files of ``folder`` (those the index names when model.safetensors.index.json
    exists), in order. ValueError for a folder without them; pickle checkpoints are refused, never
    opened."""
    index = os.path.join(folder, "model.safetensors.index.json")
    if os.path.exists(index):
        try:
            with open(index) as f:
                weight_map = json.load(f)["weight_map"]
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise ValueError(f"load_model(): {index} is not a safetensors index ({e})") from None
        names = list(dict.fromkeys(weight_map.values()))
        files = [os.path.join(folder, n) for n in names]
        missing = [f for f in files if not os.path.exists(f)]
        if missing:
            raise ValueError(f"load_model(): {index} names shards that do not exist: {', '.join(missing)}")
        return files
    entries = sorted(os.listdir(folder))
    files = [os.path.join(folder, n) for n in entries if n.endswith(".safetensors")]
    if files:
        return files
    pickles = [n for n in entries if n.endswith(_PICKLES)]
    if pickles:
        raise ValueError(
            f"load_model(): {folder} holds only pickle checkpoints ({', '.join(pickles)}); ramstream never "
            "unpickles files (they can run code): convert them to .safetensors (safetensors.torch.save_file)"
        )
    raise ValueError(
        f"load_model(): {folder} has no .safetensors files (found: {', '.join(entries) or 'nothing'})"
    )


def read_header(path: str) -> dict[str, dict]:
    """{tensor name: {"dtype", "shape", "data_offsets"}} of a safetensors file, checked: the header
    is JSON, every dtype known, every tensor's byte range matches its shape and lies inside the
    file. ValueError naming the file (and the tensor) otherwise."""
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise ValueError(f"load_model(): {path} is truncated ({size} bytes, not even a header length)")
        (n,) = struct.unpack("<Q", head)
        if n > _MAX_HEADER or 8 + n > size:
            raise ValueError(
                f"load_model(): {path}: header length {n} runs past the end of the file ({size} bytes)"
            )
        raw = f.read(n)
    try:
        header = json.loads(raw)
    except ValueError as e:
        raise ValueError(f"load_model(): {path}: the header is not valid JSON ({e})") from None
    if not isinstance(header, dict):
        raise ValueError(f"load_model(): {path}: the header is not a JSON object")
    header.pop("__metadata__", None)
    data = size - 8 - n
    for name, info in header.items():
        where = f"load_model(): {path}, tensor {name!r}"
        try:
            dtype, shape, (begin, end) = info["dtype"], info["shape"], info["data_offsets"]
        except (KeyError, TypeError, ValueError):
            raise ValueError(f"{where}: malformed header entry {info!r}") from None
        if dtype not in DTYPES:
            raise ValueError(f"{where}: dtype {dtype!r} is not supported; accepted: {', '.join(DTYPES)}")
        if not all(isinstance(d, int) and d >= 0 for d in shape) or not all(
            isinstance(o, int) for o in (begin, end)
        ):
            raise ValueError(f"{where}: malformed shape {shape!r} or offsets {(begin, end)!r}")
        want = math.prod(shape) * DTYPES[dtype]
        if not 0 <= begin <= end or end - begin != want:
            raise ValueError(f"{where}: offsets {begin}..{end} do not hold {shape} {dtype} ({want} bytes)")
        if end > data:
            raise ValueError(
                f"{where}: offsets {begin}..{end} run past the end of the data ({data} bytes): the file is "
                "truncated or its header is wrong"
            )
    return header
