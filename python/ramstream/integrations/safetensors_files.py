"""The safetensors files of a checkpoint folder, their headers validated against the file sizes
before any tensor is read (a truncated file or offsets past the end name the file and tensor)."""

from __future__ import annotations

import json
import os

from .. import _tensorfile

__all__ = ["checkpoint_files", "read_header"]

_PICKLES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")


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


def read_header(path: str) -> tuple[dict[str, dict], int]:
    """({tensor name: {"dtype", "shape", "data_offsets"}}, file offset of the data) of a safetensors
    file, checked against the file's size (_tensorfile.read_header); a tensor's bytes lie at
    data offset + data_offsets. ValueError naming the file (and the tensor) otherwise."""
    header, _meta, start = _tensorfile.read_header(path, "load_model()")
    return header, start
