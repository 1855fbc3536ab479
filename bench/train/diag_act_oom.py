"""Diagnostic (GPU): what VRAM stays held after an out-of-memory step with activation paging, in the
setup of bench_activations.py (1.8B GPT, VRAM cap, ActivationOffloader in measuring mode).
Prints memory_allocated() before/after and, for the largest live CUDA tensors, who refers to them.
    python bench/train/diag_act_oom.py --model 1.8b --seq 1024 --batch 8 --cap-gib 24"""

from __future__ import annotations

import argparse
import gc
import os
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)


def live_cuda(limit=6):
    seen = []
    for o in gc.get_objects():
        try:
            if isinstance(o, torch.Tensor) and o.is_cuda:
                seen.append(o)
        except Exception:  # noqa: BLE001 - objects that fail isinstance probes
            pass
    seen.sort(key=lambda t: -t.untyped_storage().nbytes())
    total = sum(t.untyped_storage().nbytes() for t in seen)
    print(
        f"  live CUDA tensors reachable by gc: {len(seen)}, {total / 2**30:.2f} GiB "
        "(storage bytes, shared storages counted per tensor)"
    )
    for t in seen[:limit]:
        refs = [
            type(r).__name__ + (f"({r.__class__.__module__})" if hasattr(r, "__class__") else "")
            for r in gc.get_referrers(t)
            if r is not seen
        ]
        print(
            f"   {tuple(t.shape)} {t.dtype} {t.untyped_storage().nbytes() / 2**20:.0f} MiB "
            f"param={isinstance(t, torch.nn.Parameter)} referrers={refs[:5]}"
        )


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="1.8b")
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--cap-gib", type=float, default=24.0)
    ap.add_argument("--measuring", type=int, default=1)
    a = ap.parse_args()
    from gpt import CONFIGS, GPT
    from vram_cap import cap_vram

    import ramstream
    from ramstream.activations import ActivationOffloader, find_blocks

    dev = cap_vram("cuda:0", a.cap_gib)
    torch.manual_seed(0)
    cfg = dict(CONFIGS[a.model], ctx=max(1024, a.seq))
    model = GPT(**cfg).to(dev)
    model, opt = ramstream.wrap(model, torch.optim.AdamW(model.parameters(), lr=1e-4))
    off = ActivationOffloader(find_blocks(model), dev).attach()

    def step(batch, paged, measuring):
        off.set_paged(paged)
        off.set_measuring(measuring)
        x = torch.randint(0, cfg["vocab"], (batch, a.seq), device=dev)
        before = torch.cuda.memory_allocated(dev)
        try:
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = model(x, x)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            torch.cuda.synchronize()
            res = f"ok loss {loss.item():.3f}"
            del loss
        except torch.OutOfMemoryError as e:
            res = "OOM " + str(e).split("\n")[0][:100]
            tb = e.__traceback__
            while tb.tb_next is not None:
                tb = tb.tb_next
            res += f" (raised in {tb.tb_frame.f_code.co_filename}:{tb.tb_lineno})"
            del e, tb
            loss = None  # noqa: F841 - the graph goes before the cache is emptied
        opt.zero_grad(set_to_none=True)
        gc.collect()
        torch.cuda.empty_cache()
        after = torch.cuda.memory_allocated(dev)
        print(
            f"batch {batch} paged {len(paged)} measuring {measuring}: {res}; allocated "
            f"{before / 2**30:.2f} -> {after / 2**30:.2f} GiB, peak "
            f"{torch.cuda.max_memory_allocated(dev) / 2**30:.2f}",
            flush=True,
        )
        torch.cuda.reset_peak_memory_stats(dev)
        return after - before

    allp = list(range(len(off.blocks)))
    step(2, [], False)
    print("baseline after a small step:")
    live_cuda(3)
    before = {
        b["address"]
        for seg in torch.cuda.memory._snapshot()["segments"]
        for b in seg["blocks"]
        if b["state"] == "active_allocated"
    }
    torch.cuda.memory._record_memory_history(max_entries=200000)
    leak = step(a.batch, [], bool(a.measuring))
    if leak > 2**26:
        print("LEAK after the OOM step:")
        live_cuda()
        new = [
            b
            for seg in torch.cuda.memory._snapshot()["segments"]
            for b in seg["blocks"]
            if b["state"] == "active_allocated" and b["address"] not in before
        ]
        new.sort(key=lambda b: -b["size"])
        print(
            f"  {len(new)} blocks allocated in the failed step still live, "
            f"{sum(b['size'] for b in new) / 2**30:.2f} GiB; the largest, where allocated:"
        )
        for b in new[:5]:
            frames = [
                f"{f['filename'].split('/')[-1]}:{f['line']}:{f['name']}"
                for f in b.get("frames", [])
                if f["filename"].endswith(".py")
            ][:9]
            print(f"   {b['size'] / 2**20:.0f} MiB <- {' <- '.join(frames)}")
    torch.cuda.memory._record_memory_history(enabled=None)
    step(a.batch, [], False)  # the same batch, unpaged, not measuring: does it fit now?
    step(a.batch, allp, False)
    step(a.batch, allp, False)


if __name__ == "__main__":
    main()
