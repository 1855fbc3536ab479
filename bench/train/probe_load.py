"""Where load_model's time goes, beside from_pretrained + quantize_model, on a checkpoint written by
load_ckpt.py (page cache warm): the phases of each (headers, config, skeleton, fill; from_pretrained,
quantize_model), the floor (the NF4 packing kernel over whole-file mappings, no transformers), and
load_model's fill with other worker counts and piece sizes. One JSON line per measurement.

    python bench/train/load_ckpt.py /tmp/ckpt --layers 28 --shard 4GB
    python bench/train/probe_load.py /tmp/ckpt --repeat 2
    RAMSTREAM_FORCE_ISA=avx2 python bench/train/probe_load.py /tmp/ckpt --only floor,load
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import sys
import time


def _rss_peak_gib() -> float:
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


@contextlib.contextmanager
def _timed(mod, name: str, out: dict):
    """Wraps mod.name so that its total seconds add up in out[name]."""
    orig = getattr(mod, name)

    def wrapper(*a, **k):
        t0 = time.perf_counter()
        try:
            return orig(*a, **k)
        finally:
            out[name] = out.get(name, 0.0) + time.perf_counter() - t0

    setattr(mod, name, wrapper)
    try:
        yield
    finally:
        setattr(mod, name, orig)


def _load(folder: str, **tune) -> dict:
    import torch

    from ramstream.integrations import hf_load, tensor_reads
    from ramstream.integrations.huggingface import load_model

    def where(k):  # hf_load's constants, or tensor_reads' (_POPULATE_RANGES)
        return tensor_reads if k == "_POPULATE_RANGES" else hf_load

    saved = {k: getattr(where(k), k) for k in tune}
    for k, v in tune.items():
        setattr(where(k), k, v)
    phases: dict = {}
    try:
        with (
            _timed(hf_load, "read_header", phases),
            _timed(hf_load, "_skeleton", phases),
            _timed(hf_load, "_fill", phases),
            _timed(hf_load, "quantize_into_", phases),
        ):
            t0 = time.perf_counter()
            model = load_model(folder, quantize="nf4", dtype=torch.bfloat16)
            total = time.perf_counter() - t0
    finally:
        for k, v in saved.items():
            setattr(where(k), k, v)
    del model
    gc.collect()
    phases["quantize_into_ (summed over threads)"] = phases.pop("quantize_into_", 0.0)
    return dict(total_s=total, **{k + "_s": v for k, v in phases.items()})


def _baseline(folder: str) -> dict:
    import torch
    from transformers import AutoModelForCausalLM

    import ramstream

    t0 = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16)
    t1 = time.perf_counter()
    model.requires_grad_(False)
    ramstream.quantize_model(model, "nf4")
    t2 = time.perf_counter()
    del model
    gc.collect()
    return dict(total_s=t2 - t0, from_pretrained_s=t1 - t0, quantize_model_s=t2 - t1)


def _floor(folder: str) -> dict:
    """The packing kernel alone over every block weight of the files (safetensors' whole-file
    mappings, as from_pretrained reads them), into fresh outputs."""
    import torch
    from safetensors import safe_open

    from ramstream.ops.quant import quantize_into_

    files = sorted(f for f in os.listdir(folder) if f.endswith(".safetensors"))
    t_pack = n = 0.0
    t0 = time.perf_counter()
    for f in files:
        with safe_open(os.path.join(folder, f), framework="pt") as sf:
            for k in sf.keys():
                if ".layers." not in k or not k.endswith(".weight") or "norm" in k:
                    continue
                x = sf.get_tensor(k)
                t1 = time.perf_counter()
                codes = torch.empty((x.numel() + 1) // 2, dtype=torch.uint8)
                absmax = torch.empty(-(-x.numel() // 64), dtype=torch.float32)
                quantize_into_("nf4", x.view(-1), codes, absmax, 64)
                t_pack += time.perf_counter() - t1
                n += x.numel() * x.element_size()
    return dict(total_s=time.perf_counter() - t0, pack_s=t_pack, gb_read=n / 1e9, pack_gbps=n / 1e9 / t_pack)


def _kernel(threads: int) -> dict:
    """The NF4 packing kernel alone on bf16 values already in memory, into outputs already
    faulted in (the compute rate), on ``threads`` pool threads; then into fresh outputs."""
    import torch

    from ramstream._native import lib
    from ramstream.ops.quant import quantize_into_

    n = 256 << 20
    x = torch.randn(n, generator=torch.Generator().manual_seed(0)).bfloat16()
    codes, absmax = torch.zeros(n // 2, dtype=torch.uint8), torch.zeros(n // 64)
    prev = lib().num_threads()
    lib().set_num_threads(threads)
    try:
        warm = []
        for _ in range(4):
            t0 = time.perf_counter()
            quantize_into_("nf4", x, codes, absmax, 64)
            warm.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        quantize_into_("nf4", x, torch.empty(n // 2, dtype=torch.uint8), torch.empty(n // 64), 64)
        fresh = time.perf_counter() - t0
    finally:
        lib().set_num_threads(prev)
    best = min(warm)
    return dict(total_s=best, threads=threads, gelem_per_s=n / best / 1e9, fresh_s=fresh)


def _pages(folder: str) -> dict:
    """Reading the files' bytes (page cache -> fresh memory) with one pread per 64 MiB: the copy
    floor the embeddings and head would cost if copied."""
    import torch

    from ramstream.integrations.tensor_reads import read_into

    files = sorted(f for f in os.listdir(folder) if f.endswith(".safetensors"))
    t0 = time.perf_counter()
    n = 0
    for f in files[:1]:
        p = os.path.join(folder, f)
        size = os.path.getsize(p)
        buf = torch.empty(64 << 20, dtype=torch.uint8)
        for off in range(0, size - (64 << 20), 64 << 20):
            read_into(p, off, buf)
            n += 64 << 20
    dt = time.perf_counter() - t0
    return dict(total_s=dt, gb=n / 1e9, gbps=n / 1e9 / dt)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("folder")
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--only", default="kernel,floor,baseline,load,modes")
    args = ap.parse_args()
    import torch

    import ramstream  # noqa: F401
    from ramstream.integrations.huggingface import load_model  # noqa: F401 (imports before clocks)

    only = set(args.only.split(","))
    isa = os.environ.get("RAMSTREAM_FORCE_ISA", "default")
    thp = "/sys/kernel/mm/transparent_hugepage/enabled"
    info = dict(isa=isa, threads=torch.get_num_threads(), cores=os.cpu_count())
    info["thp"] = open(thp).read().strip() if os.path.exists(thp) else None
    print("INFO " + json.dumps(info), flush=True)
    runs = []
    if "kernel" in only:
        for t in sorted({1, os.cpu_count() or 1}):
            runs += [(f"kernel_t{t}", lambda t=t: _kernel(t))]
    if "floor" in only:
        runs += [("floor", lambda: _floor(args.folder))]
    if "pages" in only:
        runs += [("pages", lambda: _pages(args.folder))]
    if "baseline" in only:
        runs += [("baseline", lambda: _baseline(args.folder))]
    if "load" in only:
        runs += [("load", lambda: _load(args.folder))]
    if "modes" in only:  # against the default, each in turn (A B A C ...): drift hits all alike
        variants = {
            "w4": dict(_WORKERS=4),
            "w8_nopopulate": dict(_WORKERS=8, _POPULATE_RANGES=False),
            "w16": dict(_WORKERS=16),
        }
        for name, tune in variants.items():
            runs += [("baseline", lambda: _baseline(args.folder))]
            runs += [(f"load_{name}", lambda tune=tune: _load(args.folder, **tune))]
    if "tune" in only:
        for w in (1, 2, 16):
            runs += [(f"load_workers{w}", lambda w=w: _load(args.folder, _WORKERS=w))]
        for c in (16 << 20, 256 << 20):
            runs += [
                (f"load_chunk{c >> 20}M", lambda c=c: _load(args.folder, _CHUNK_BYTES=c, _WORKING_SHARE=4))
            ]
    for name, fn in runs:
        for i in range(args.repeat):
            try:
                r = fn()
            except Exception as e:  # reported; the next measurement goes on
                r = dict(error=f"{type(e).__name__}: {e}"[:300])
            r.update(name=name, i=i, isa=isa, rss_peak_gib=_rss_peak_gib())
            print("RESULT " + json.dumps(r), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
