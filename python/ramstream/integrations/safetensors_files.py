"""The safetensors files of a checkpoint folder, their headers validated as the format requires
before any tensor is read (_tensorfile.read_header: errors name the file and the tensor)."""

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
            with open(index, "rb") as f:
                weight_map = json.loads(f.read().decode("utf-8"))["weight_map"]
        except (OSError, ValueError, KeyError, TypeError, RecursionError) as e:
            raise ValueError(
                f"load_model(): {index} is not a safetensors index ({type(e).__name__}: {e})"
            ) from None
        if not isinstance(weight_map, dict) or not all(isinstance(v, str) and v for v in weight_map.values()):
            raise ValueError(
                f"load_model(): {index}: 'weight_map' must be an object {{tensor name: file name}}, got "
                f"{str(weight_map)[:80]}"
            )
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
    file, validated as the format requires (_tensorfile.read_header: offsets contiguous, covering
    the data exactly, sizes matching dtype x shape); a tensor's bytes lie at data offset +
    data_offsets. ValueError naming the file (and the tensor) otherwise."""
    header, _meta, start = _tensorfile.read_header(path, "load_model()")
    return header, start
