"""load_model()'s arguments, checked before anything is read: ValueError/TypeError naming the
argument and what is accepted; the model's folder resolved locally (nothing is downloaded)."""

from __future__ import annotations

import os

import torch

from ..quant.model import parse_block_size, parse_format

_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def _parse(quantize, dtype, quant_block_size, random_weights, ram_fraction, disable_mmap, trust_remote_code):
    if quantize is None or quantize is False or quantize == "none":
        fmt = "none"
    elif quantize == "auto":
        fmt = "auto"
    else:
        fmt = parse_format(quantize, "load_model(): quantize")  # lists int8, nf4
    if fmt != "none" and not isinstance(quantize, str):
        raise ValueError(f"load_model(): quantize={quantize!r} is not accepted")
    if dtype not in _DTYPES:
        raise ValueError(
            f"load_model(): dtype={dtype!r} is not accepted; accepted: torch.bfloat16, torch.float16, torch.float32"
        )
    block = parse_block_size(quant_block_size, "load_model(): quant_block_size")
    if not isinstance(random_weights, bool):
        raise ValueError(
            f"load_model(): random_weights={random_weights!r} is not accepted; accepted: True, False"
        )
    if not isinstance(disable_mmap, bool):
        raise ValueError(
            f"load_model(): disable_mmap={disable_mmap!r} is not accepted; accepted: True, False"
        )
    if not isinstance(trust_remote_code, bool):
        raise ValueError(
            f"load_model(): trust_remote_code={trust_remote_code!r} is not accepted; accepted: True, False"
        )
    if (
        isinstance(ram_fraction, bool)
        or not isinstance(ram_fraction, (int, float))
        or not 0 < ram_fraction <= 1
    ):
        raise ValueError(
            f"load_model(): ram_fraction={ram_fraction!r} is not accepted; accepted: a number in (0, 1]"
        )
    return fmt, block


def _resolve(name_or_path) -> str:
    if not isinstance(name_or_path, (str, os.PathLike)):
        raise TypeError(
            f"load_model(): name_or_path must be a str or path, got {type(name_or_path).__name__}"
        )
    path = os.fspath(name_or_path)
    if os.path.isdir(path):
        return path
    try:  # a Hub id already in the local Hugging Face cache; nothing is downloaded
        from huggingface_hub import snapshot_download  # noqa: PLC0415

        return snapshot_download(path, local_files_only=True)
    except Exception:
        raise ValueError(
            f"load_model(): {path!r} is neither a local folder nor a model in the Hugging Face cache "
            "(load_model downloads nothing: fetch it first, e.g. `huggingface-cli download`)"
        ) from None
