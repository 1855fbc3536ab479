"""Example: show where training memory lives under ramstream (VRAM, pinned host, pageable host) and
check it against what the plan said, with a PASS/FAIL verdict.

    python examples/verify_ram_offload.py                       # 350M GPT, bf16, planner's choices
    python examples/verify_ram_offload.py --size 1.8b --cap-gib 8 --param-offload
    python examples/verify_ram_offload.py --tiny                # the CPU engine, seconds

After a few steps it prints ramstream.memory_report's decisions, the memory each place holds
(torch's VRAM counters, ramstream.memory_stats() for pinned host memory, the process's resident
set for the rest) and checks, each with the expected and the measured number:
  optimizer  the fp32 masters and moments are in host RAM: memory_report's host_state_bytes equals
             the buckets' elements x (4 + 2 x moment bytes [+ 4 with accumulation])
  weights    the blocks the plan streams were loaded (bytes moved host -> device) and never all
             on the device at once
  activations  the blocks the plan pages moved saved activations to the host
  vram       (GPU) the peak stayed under the cap, and below what the same model's weights,
             gradients and fp32 AdamW state would take in VRAM
Exit status 0 when every check passes, 1 otherwise.
"""

from __future__ import annotations

import argparse
import os

import torch
from train_bigger_than_vram import GPT, SIZES  # the example's GPT (examples/ is on sys.path)

import ramstream

GIB = 2**30
WINDOW = 2  # wrap()'s default weight_window: blocks loaded ahead of the running one


def parse(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n")[0], formatter_class=argparse.RawTextHelpFormatter
    )
    p.add_argument("--size", choices=list(SIZES), default="350m", help="the GPT (default 350m)")
    p.add_argument("--cap-gib", type=float, help="VRAM cap in GiB (set_per_process_memory_fraction)")
    p.add_argument("--batch", type=int, default=2, help="rows per step (default 2)")
    p.add_argument("--seq", type=int, default=512, help="tokens per row (default 512)")
    p.add_argument("--steps", type=int, default=3, help="optimizer steps (default 3)")
    p.add_argument("--accum", type=int, default=1, help="accumulation_steps (default 1)")
    p.add_argument("--param-offload", action="store_true", help="stream every block's weights")
    p.add_argument("--activation-offload", action="store_true", help="page every block's activations")
    p.add_argument("--tiny", action="store_true", help="a tiny GPT on the CPU engine, streaming and paging")
    a = p.parse_args(argv)
    if a.tiny:
        a.size, a.batch, a.seq, a.steps, a.accum = "tiny", 2, 32, 2, 2
        a.param_offload = a.activation_offload = True
    return a


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def main(argv=None) -> int:
    a = parse(argv)
    gpu = torch.cuda.is_available() and not a.tiny
    dev = torch.device("cuda", 0) if gpu else torch.device("cpu")
    if gpu and a.cap_gib:
        total = torch.cuda.get_device_properties(0).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, a.cap_gib * GIB / total), 0)
    vocab, d, layers, heads = SIZES[a.size]
    torch.manual_seed(0)
    model = GPT(vocab, d, layers, heads, ctx=max(a.seq, 1024)).to(torch.bfloat16 if gpu else torch.float32)
    n = sum(p.numel() for p in model.parameters())
    wbytes = sum(p.nbytes for p in model.parameters())
    print(f"GPT {a.size}: {n:,} parameters ({wbytes / GIB:.2f} GiB of weights), on {dev}")
    opts: dict = {"accumulation_steps": a.accum}
    if gpu:  # keep the state on the host: offload="auto" may move it into VRAM when it fits there
        opts.update(offload=True, device="cuda")
    else:
        opts.update(device="cpu", min_offload_bytes=0)
    if a.param_offload:
        opts.update(param_offload=True, weight_window=WINDOW)
    if a.activation_offload:
        opts["activation_offload"] = True
    model, opt = ramstream.wrap(model, torch.optim.AdamW(model.parameters(), lr=1e-4), **opts)
    rep = ramstream.memory_report(model)
    print("the plan:")
    for line in rep["events"]:
        print("  ", line)
    g = torch.Generator().manual_seed(1)
    if gpu:
        torch.cuda.reset_peak_memory_stats(0)
    for step in range(a.steps):
        for _ in range(a.accum):
            ids = torch.randint(0, vocab, (a.batch, a.seq + 1), generator=g).to(dev)
            loss = model(ids[:, :-1], ids[:, 1:]) / a.accum
            loss.backward()
        opt.step()
        opt.zero_grad()
        print(f"step {step + 1}: loss {loss.item() * a.accum:.4f}")
    opt.synchronize()
    rep, ms = ramstream.memory_report(model), ramstream.memory_stats()
    o, prm, act = rep["optimizer"], rep["params"], rep["activations"]
    pinned = ms["bytes_pinned"] + ms["bytes_registered"]
    vram_now = torch.cuda.memory_allocated(0) if gpu else 0
    vram_peak = torch.cuda.max_memory_allocated(0) if gpu else 0
    print("\nwhere the memory is:")
    print(
        f"  VRAM            {vram_now / GIB:8.3f} GiB now, {vram_peak / GIB:.3f} GiB peak (torch's allocator)"
    )
    print(
        f"  pinned host     {pinned / GIB:8.3f} GiB (ramstream's arena; pinning available: {ms['pinning_available']})"
    )
    print(f"  pageable host   {max(0, rss_bytes() - pinned) / GIB:8.3f} GiB (the rest of this process's RSS)")
    print(f"    optimizer state (fp32 masters, moments, sums)  {o['host_state_bytes'] / GIB:.3f} GiB")
    print(f"    gradient landing buffers                       {o['landing_bytes'] / GIB:.3f} GiB")
    held = (rep["plan"]["activations"] or {}).get("stats", {}).get("host_bytes_held", 0)
    print(f"    saved-activation buffers                       {held / GIB:.3f} GiB")

    checks = []
    check = lambda name, expected, measured, ok: checks.append((name, expected, measured, ok))
    mom = torch.empty(0, dtype=getattr(torch, o["moment_dtype"])).element_size()
    want = sum(prm["bucket_numel"]) * (4 + 2 * mom + (4 if a.accum > 1 else 0))
    got = o["host_state_bytes"]
    check("optimizer state in host RAM (bytes)", want, got, got == want and not o["resident"])
    streamed = prm["streamed_blocks"]
    planned = (rep["plan"].get("weights") or {}).get("streamed", [])
    check("streamed blocks: plan vs streamer", planned, streamed, list(planned) == list(streamed))
    if streamed:
        size = sum(p.nbytes for i in streamed for p in model.layers[i].parameters())
        moved, peak = prm["stream"]["bytes_h2d"], prm["stream"]["peak_loaded_bytes"]
        check("streamed weights moved host -> device (bytes)", "> 0", moved, moved > 0)
        if len(streamed) > WINDOW + 1:  # the running block and the window ahead of it
            check("streamed weights on the device at once (peak bytes)", f"< {size}", peak, peak < size)
    if act["paged_blocks"]:
        got = act["packed_bytes"]
        check("paged activations moved to the host (bytes)", "> 0", got, got > 0)
    if gpu:
        stock = n * (2 + 2 + 4 + 4 + 4)  # weights, grads (model dtype), fp32 masters and two moments
        check("peak VRAM below a resident AdamW's state (bytes)", f"< {stock}", vram_peak, vram_peak < stock)
        if a.cap_gib:
            cap = int(a.cap_gib * GIB)
            check("peak VRAM within the cap (bytes)", f"<= {cap}", vram_peak, vram_peak <= cap)
    print("\nchecks (expected, measured):")
    for name, exp, got, ok in checks:
        print(f"  {'PASS' if ok else 'FAIL'}  {name}: expected {exp}, measured {got}")
    verdict = all(ok for *_, ok in checks)
    print(
        f"\nverdict: {'PASS' if verdict else 'FAIL'} ({sum(ok for *_, ok in checks)} of {len(checks)} checks)"
    )
    return 0 if verdict else 1


if __name__ == "__main__":
    raise SystemExit(main())
