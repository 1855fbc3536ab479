"""bench_nvme.py --what offload (issue 29): OffloadModel's chunks with their weights on disk
(nvme=, nvme_path=) or in pinned RAM, on the GPT of bench_offload_model.py (its build_chunks).

OffloadModel puts only chunks without a trained parameter on disk (frozen/disk.py's check), so a
block whose norms are trained cannot go there: every block is one chunk, frozen whole (the
LoRA-base shape with the norms frozen too), and what trains is outside OffloadModel on the device:
the embedding (wte, wpe), ln_f and the head, with torch's AdamW. Their gradients need the
backward through every block (the input's gradient), so each block is read from disk in the
forward and again in the backward (all but the last `--window` of the forward).
"""

from __future__ import annotations

import contextlib
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))


def run_offload(args, on_disk: bool) -> dict:
    """One training run in this process: the blocks streamed by OffloadModel from pinned RAM, or
    (on_disk) all of them from a scratch file in args.dir."""
    import torch

    import ramstream

    sys.path.insert(0, HERE)
    from bench_delayed import capped_device, markov_batches
    from bench_nvme import timed_steps
    from bench_offload_model import _loss, build_chunks

    dev = capped_device(args)
    cuda = dev.type == "cuda"
    torch.manual_seed(0)
    chunks, vocab = build_chunks("tiny" if args.tiny else args.model, args.seq)
    embed, blocks, head = chunks[0].to(dev), chunks[1:-1], chunks[-1].to(dev)
    low = torch.bfloat16 if args.dtype == "bf16" else None
    for b in blocks:
        b.requires_grad_(False)
        if low is not None:
            b.to(low)  # frozen: stored (and read from disk) in bf16
    frozen = [p for b in blocks for p in b.parameters()]  # (on disk: empty stand-ins once built)
    frozen_params, frozen_bytes = sum(p.numel() for p in frozen), sum(p.nbytes for p in frozen)
    n = len(blocks)
    kw = dict(nvme=n, nvme_path=args.dir) if on_disk else {}
    model = ramstream.OffloadModel(blocks, device=str(dev), window=args.window, keep_activations=True, **kw)
    trained = [*embed.parameters(), *head.parameters()]
    opt = torch.optim.AdamW(trained, lr=args.lr, weight_decay=0.1, fused=cuda)
    data = markov_batches(vocab, args.batch, args.seq, args.steps)

    def cast():  # --dtype bf16: the trained fp32 embedding and head under bf16 autocast, as the blocks
        return torch.autocast(dev.type, dtype=low) if low is not None else contextlib.nullcontext()

    def step(i: int) -> float:
        x = data[i].to(dev, non_blocking=True)
        with cast():
            res = model.step(embed(x[:, :-1]), x[:, 1:], loss_fn=lambda out, t: _loss(head(out), t))
        opt.step()
        opt.zero_grad(set_to_none=True)
        return float(res.loss)

    def io() -> tuple[int, int]:
        return model.stats["nvme_bytes_read"], 0  # frozen: nothing written per step

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize(dev)

    if cuda:
        torch.cuda.reset_peak_memory_stats(dev)
    out = dict(share=n if on_disk else 0, chunks=n, window=args.window)
    out.update(disk_state_bytes=frozen_bytes if on_disk else 0, frozen_params=frozen_params)
    out.update(timed_steps(args, step, io, sync))
    st = model.stats
    out.update(
        nvme_loads=st["nvme_loads"],
        nvme_reads_ahead=st["nvme_reads_ahead"],
        nvme_staging_bytes=st["nvme_staging_bytes"],
        nvme_direct=st["nvme_direct"],
        trained_params=sum(p.numel() for p in trained),
    )
    if cuda:
        out["peak_gib"] = torch.cuda.max_memory_allocated(dev) / 2**30
    model.close()
    return out
