"""The step-time model of plan_training(): seconds per step from the HardwareProfile's rates and
the plan's placements. Pure arithmetic.

Compute, per block and pass (the forward; the backward with the block's recompute), the longer of
    GPU:  matmul flops / (matmul_tflops x MATMUL_EFFICIENCY) + saved-activation bytes x passes /
          HBM_EW_GBPS (elementwise traffic: written in forward, read and its gradient written in
          backward: 1 forward pass, 2 backward, 1 more per recompute)
    host: eager ops x EAGER_OP_S x passes (Python, autograd and launches; a LoRA-wrapped Hugging
          Face layer launches ~90 small ops and waits on them, a GPT block's ~20 hide behind its
          matmuls)
A streamed block's pass takes at least its weights' copy at STREAM_EFFICIENCY x h2d_gbps (the
window of 2 keeps the copy engine busy, it cannot run ahead of a block that waits); the last
block of the stack stays for its backward. Around the stack: the embeddings', head's and loss's
flops, the logits' bytes x 3. AdamW on the GPU (resident, or the "device" share): its state
traffic / DEVICE_ADAMW_GBPS.

The offloaded optimizer (inflight.choose_placements puts the "device" share first in
forward order, then "mapped", the host share last) runs beside the backward on four resources, and
the step is the longest of their lanes:
  gpu:  compute + the stream's stalls + the mapped update. The mapped update is ramstream's CUDA
        AdamW reading and writing its state in pinned host memory (gpu_updates.py), launched from
        each gradient hook on the update stream; its grid (a block of 256 threads per 1024
        elements: 16k blocks for a 16M tensor) fills every SM while it waits on PCIe, and the
        compute stream has the same priority, so the backward's kernels queue behind it: its
        seconds add to the compute, at MAPPED_EFFICIENCY x h2d_gbps each way (mapped bytes: 2
        moments, and a low-precision model's fp32 master, each way). Measured (row G, 6.85B
        bf16): the step exceeds compute by 1.12 s, the mapped update alone takes 1.18 s at the
        kernel's rate, and the host AdamW (1.10 s in that run) hides beside it; the backward
        was throttled 1.11 s, waiting on gradients in flight (the oldest event: a mapped
        update's, or a copy's to the host). With a mapped share (and see below) the eager time of each pass
        adds too, instead of hiding under its GPU time (min(GPU, eager) per pass:
        issue_exposed_s: ISSUE_EXPOSED of it). Measured on the H200 (rows A and A_chunked, 1.8B
        at 24 GiB): the steps exceed compute + mapped update by 0.043 and 0.042 s, half the
        eager time of their 32 blocks' four passes (0.087 s at EAGER_OP_S); where exactly the
        training thread falls behind the GPU is not traced yet. The sixth session's rows A and
        A_chunked, their mapped share moved to the host by the refiner's host-only trial, still
        exceed compute by 0.057 and 0.066 s: the term counts whenever the backward's hooks
        launch GPU updates of full fine-tuning beside host ones (a mapped share, or a device
        share next to a host share). Resident training and LoRA's host updates hide it.
  host: the forward, then host AdamW (host params x 28 B, 20 with bf16 moments, / (adamw_gbps x
        HOST_UNDER_DMA): the mapped update's DMA shares the host's memory bandwidth). The host
        share is the back of the model: its gradients land first in the backward and the next
        forward reads it last, so the host threads work beside the backward and the mapped
        update. A streamed block's trained share is updated on the host as its gradients land,
        lowest bucket first, and the next forward's loads wait for it (stream_host.py runs that
        queue for a few steps: the lane is its cycle). Front blocks' gradients land at the end of
        the backward and the forward loads them first, so their AdamW follows the backward
        (measured: the 6.85B bf16 with 6 front blocks streamed, 1.482 s/step, waited 0.301 s in
        the forward, the 1.21G params of those blocks at the run's 3.84 G params/s: 0.315 s);
        with every block streamed the host starts at the last block's landing and the forward
        trails it (row F: 0.53-0.56 s/step, 0.43-0.44 s of host AdamW). With delayed_update
        the host share's update of step t runs beside step t+1's forward and backward: the
        lane is the host AdamW alone (the mapped share is not delayed: it stays in the gpu lane).
  h2d, d2h: the weight stream, the host share's gradients down and weights up, the mapped
        update's traffic and paged activations, each way at duplex_gbps while both run.
The lanes overlap each other, so a step bound by the mapped update hides the host AdamW, and
the other way round. What finishes after the last block's backward (the mapped updates still in
flight, up to the engine's max_inflight_bytes; the host share's last buckets) is inside its lane.
Paged activations expose (1 - ACT_OVERLAP) of their copies on top. The CPU engine (no GPU in
the profile) computes and updates on the same cores: its step is their sum.

The split these lanes time is the one the run settles on. wrap() splits after step 2 from the
isolated rates (policy.optimizer_split: split.py's crossing); optimizer_mode="auto" then solves the
host / mapped split again after steps 4 and 6 from the rates it measured (runtime/refiner.py), so that
the host AdamW and the PCIe traffic (refine's model: the mapped bytes and the host share's copies at
the kernels' measured rate) finish together. policy.refinement_rounds runs refine.choose_refined
itself on stand-ins of the buckets, with the rates refiner_rates says the run measures at each
round's split: the host at HOST_UNDER_DMA of the profile's rate over the AdamW state bytes (28, 20
with bf16 moments: the refinement measures the real throughput, optimizer_split.py's step-2 rate counts 28),
the mapped kernels at mapped_kernel_s (their bytes at MAPPED_EFFICIENCY, plus the link time of the
host share's copies beside them); plan.py undoes the first move when it predicts the steps after it
more than MIN_GAIN slower, as runtime/refiner.py does, and runs the refiner's host-only trial
(policy.host_trial) when the last round kept a split with a mapped share: the all-host split is
kept when its predicted step is not slower. The gpu lane keeps the mapped update at
MAPPED_EFFICIENCY alone: the kernels' stalls behind the copies do not all delay the compute
stream (the second session's row G, 54 % mapped: the step exceeded compute by 1.12 s, its mapped
bytes at the kernel's rate are 1.18 s, with the copies' link time 1.29 s).

The disk tier (planner/disk.py, nvme_offload): each step reads every byte of the state on disk
before its AdamW and writes it back after, double-buffered with the host AdamW (a bucket read
ahead, one written behind). Reads and writes share one disk, so they add: disk_s = bytes /
disk_read_gbps + bytes / disk_write_gbps. The host AdamW in the host lane then takes the longer of
itself and disk_s, plus the edges no AdamW hides: the first bucket's read and the last one's write
(with_disk). Not measured on a GPU run yet.
Frozen weights on disk (planner/disk_weights.py, nvme_weights) are read again each time their block
loads (forward, and backward unless kept loaded between), read ahead in the streamer's order while
the blocks before them compute: disk_s gains bytes / disk_read_gbps (one disk: it adds to the
state's reads and writes) and the step waits at least one block's read that nothing hides, the
first one (with_disk_reads). Not measured on a GPU run yet.

The constants and their measurements are next to them; tests/test_planner_h200.py holds the
H200 machine's measured rows (the profile's matmul rate calibrated once, on the 1.8B GPT
uncapped).
"""

from __future__ import annotations

from .shape import lora_like

# share of the profile's matmul rate (a 4096^3 bf16 GEMM, ~790 TFLOP/s on the H200) a training
# step's matmuls reach: calibrated on the 1.8B GPT uncapped (0.112 s/step: 632 TFLOP/s effective)
MATMUL_EFFICIENCY = 0.8
HBM_EW_GBPS = 1500.0  # elementwise traffic (norms, activations, casts, their gradients), GB/s
EAGER_OP_S = 34e-6  # host seconds per eager op and pass (H200 machine's CPU, torch 2.11)
STREAM_EFFICIENCY = 0.84  # weight stream / measured H2D (7B LoRA at 8 GiB: 45.9 of 54.9 GB/s)
DEVICE_ADAMW_GBPS = 3000.0  # AdamW on GPU state (fused or ramstream's kernel), GB/s of state
# host AdamW rate while DMA runs / the profile's rate: row A's log (second session); the fourth
# session's G_defaults refinement measured 3.73 of 4.56 G params/s (0.818)
HOST_UNDER_DMA = 0.82
# the mapped AdamW's PCIe rate each way / the pinned H2D copy's: bench_cuda_kernels on the H200,
# 16M params with fp32 moments in mapped memory in 3.55 ms = 75.7 GB/s both ways, 37.8 each way,
# of 54.9 GB/s (bench/RESULTS.md, issue 2); bf16 moments: half the bytes in half the time
MAPPED_EFFICIENCY = 0.69
ACT_OVERLAP = 0.9  # share of activation copies hidden behind compute, until measured
# share of the eager issue time exposed with a mapped share (module docstring): rows A and
# A_chunked after autocast's weight casts stopped filling VRAM (call 2 of 2026-12-02, fourth
# session: 0.232 and 0.208 s) exceed compute + mapped update by 0.043 and 0.042 s, half of their
# 0.087 s of eager time. (Before, with the casts held, the excess was 0.100 s: the allocator's
# retries under the cap, which the casts caused, counted in it.)
ISSUE_EXPOSED = 0.5
LOGIT_PASSES = 3


def _pcie(prof, up: float, down: float) -> tuple[float, float]:
    """(h2d_s, d2h_s) for the bytes each way: while both directions carry data each runs at
    duplex_gbps, the longer one's rest at its own rate."""
    if not (prof.duplex_gbps and prof.h2d_gbps and prof.d2h_gbps):
        return 0.0, 0.0  # the CPU engine: no PCIe
    both = min(up, down)
    t_both = both / (prof.duplex_gbps * 1e9) if both else 0.0
    up_s = (up - both) / (prof.h2d_gbps * 1e9) if up > both else 0.0
    down_s = (down - both) / (prof.d2h_gbps * 1e9) if down > both else 0.0
    return t_both + up_s, t_both + down_s


def mapped_kernel_s(
    prof, mapped_bytes: float, host_numel: int, wb: int, host_params_per_s: float = 0.0
) -> float:
    """Seconds the mapped AdamW kernels take per step on the update stream: their bytes each way
    at MAPPED_EFFICIENCY x h2d_gbps, plus the time the host share's copies hold the link while the
    kernels run (host_numel x wb the larger way, at duplex_gbps). The kernels' loads and stores and
    the copy engines' DMA share PCIe. The host share's new weights go up as its AdamW finishes them,
    spread over the host AdamW's seconds (host_numel / host_params_per_s), so the share of those
    copies that meets the kernels is the kernels' seconds over the host AdamW's, at most all of them
    (all of them without a host rate). Checked on row G_defaults's first refinement window (42 %
    mapped, 51 % host, tests/test_planner_h200.py: the kernels and the host AdamW take about as
    long, every copy meets them): 32.8 GB/s each way predicted, 32.6 measured by the refiner's CUDA
    events; on row A's of the fifth session (10 % mapped, 11 % host, the host AdamW half again as
    long as the kernels): 28.4 GB/s predicted, 29.0 measured (26.6 when every copy counted), and
    at the split it moved to (8 % mapped, 13 % host) 28.4 against 32.0. No constant is fitted here."""
    if not (mapped_bytes and prof.h2d_gbps):
        return 0.0
    seconds = mapped_bytes / (prof.h2d_gbps * 1e9 * MAPPED_EFFICIENCY)
    copies = host_numel * wb / ((prof.duplex_gbps or prof.h2d_gbps) * 1e9)
    if host_numel and host_params_per_s > 0:
        copies *= min(1.0, seconds / (host_numel / host_params_per_s))
    return seconds + copies


def refiner_rates(prof, split: dict, *, wb: int, mb: int, state_bytes: int) -> tuple[float, float]:
    """(host params/s, mapped PCIe bytes/s each way) that runtime/refiner.py measures at `split`
    (numel per placement): the host AdamW's elements / its seconds, memory-bound at state_bytes per
    parameter (28, 20 with bf16 moments) at HOST_UNDER_DMA of the profile's rate beside the DMA;
    the mapped kernels' bytes / their seconds (mapped_kernel_s). Without a host (mapped) share the
    isolated rate stands in, as in refine.py: the profile's AdamW rate over 28 B (split.seed), its
    H2D rate."""
    if not (prof.h2d_gbps and prof.adamw_gbps):
        return 0.0, 0.0
    if split["host"]:
        host = prof.adamw_gbps * 1e9 * (HOST_UNDER_DMA if prof.vram_total else 1.0) / state_bytes
    else:
        host = prof.adamw_gbps * 1e9 / 28
    mapped_bytes = split["mapped"] * (2 * mb + (4 if wb < 4 else 0))
    if not mapped_bytes:
        return host, prof.h2d_gbps * 1e9
    return host, mapped_bytes / mapped_kernel_s(prof, mapped_bytes, split["host"], wb, host)


def step_times(
    shape, prof, weight_of, *, streamed, modes, paged_bytes: int, split: dict, state_bytes: int,
    mapped_bytes_per_param: int, delayed: bool = False,
) -> dict:  # fmt: skip
    """Seconds per resource (OVERLAPPED), per lane (gpu_lane_s, host_lane_s) and their parts,
    and exposed_s: what the step takes beyond its largest resource (module docstring). split:
    numel per placement {"device", "mapped", "host"}; state_bytes: AdamW state traffic per
    parameter (28 / 20); mapped_bytes_per_param: what one mapped update moves each way.
    delayed: delayed_update, past its warm-up (the host lane is the host AdamW alone)."""
    sh, p = shape, prof
    T, n = sh.tokens, len(sh.blocks)
    rate = p.matmul_tflops * 1e12 * MATMUL_EFFICIENCY if p.matmul_tflops else None
    ss = set(streamed)

    def gpu(flops: float, nbytes: float) -> float:
        return (flops / rate if rate else 0.0) + nbytes / (HBM_EW_GBPS * 1e9)

    stream_rate = p.h2d_gbps * 1e9 * STREAM_EFFICIENCY if p.h2d_gbps else None
    compute = stall = fwd = issue = 0.0
    per_f, per_b = [], []  # each block's pass seconds, for the streamed host queue (stream_host.py)
    for i, b in enumerate(sh.blocks):
        rc = 1 if modes[i] == "recompute" else 0
        act = sh.act_bytes(i)
        f, bw = b.fwd_flops_per_token * T, b.bwd_flops_per_token * T
        g_f, e_f = gpu(f, act), b.fwd_ops * EAGER_OP_S
        g_b, e_b = gpu(bw + rc * f, act * (2 + rc)), b.fwd_ops * EAGER_OP_S * (2 + rc)
        t_f, t_b = max(g_f, e_f), max(g_b, e_b)
        per_f.append(t_f)
        per_b.append(t_b)
        compute += t_f + t_b
        fwd += t_f
        issue += min(g_f, e_f) + min(g_b, e_b)
        if i in ss and stream_rate:
            load = weight_of(b) / stream_rate
            passes = [t_f] + ([t_b] if i < n - 1 else [])
            stall += sum(max(0.0, load - t) for t in passes)
    fwd += gpu(sum(q.fwd_flops_per_token * T for q in (sh.embed, sh.head)), 0.0)
    outside = sum((q.fwd_flops_per_token + q.bwd_flops_per_token) * T for q in (sh.embed, sh.head))
    outside_s = gpu(outside, LOGIT_PASSES * sh.logits_bytes)
    compute += outside_s
    compute += split["device"] * state_bytes / (DEVICE_ADAMW_GBPS * 1e9)
    wb = sh.elem_bytes
    streamed_tr = sum(sh.blocks[i].trained_numel for i in ss)
    w_stream = sum(weight_of(sh.blocks[i]) * (2 if i < n - 1 else 1) for i in ss)
    mapped_bytes = split["mapped"] * mapped_bytes_per_param  # each way
    opt_up = max(0, split["host"] - streamed_tr) * wb + mapped_bytes
    opt_down = split["host"] * wb + mapped_bytes
    opt_h2d, opt_d2h = _pcie(p, opt_up, opt_down)
    host = host_front = per_param = 0.0
    if split["host"] and p.adamw_gbps:
        per_param = state_bytes / (p.adamw_gbps * 1e9 * (HOST_UNDER_DMA if p.vram_total else 1.0))
        host = split["host"] * per_param
        host_front = min(split["host"], streamed_tr) * per_param
    mapped = 0.0
    if mapped_bytes and p.h2d_gbps:  # the gpu lane's share of the kernels' seconds (docstring)
        mapped = mapped_bytes / (p.h2d_gbps * 1e9 * MAPPED_EFFICIENCY)
    # module docstring: the thread's issue when the backward's hooks launch GPU updates beside an
    # offloaded optimizer (a mapped share, or full fine-tuning's device share next to a host one)
    hooks_update = bool(mapped or (split["device"] and split["host"] and not lora_like(sh)))
    issue = ISSUE_EXPOSED * issue if hooks_update else 0.0
    act_h2d, act_d2h = _pcie(p, paged_bytes, paged_bytes)
    act_exposed = (1 - ACT_OVERLAP) * (act_h2d + act_d2h)
    stream_s = w_stream / stream_rate if stream_rate else 0.0
    h2d = stream_s + opt_h2d + act_h2d
    d2h = opt_d2h + act_d2h
    gpu_lane = compute + stall + mapped + issue
    host_lane = fwd + host - host_front if host else 0.0  # the back of the model, beside the backward
    if host_front:  # streamed blocks' share: updated as their gradients land, the forward waits
        host_lane = _streamed_host_lane(sh, p, weight_of, ss, split, per_f, per_b, outside_s, per_param,
                                        mapped_bytes_per_param, stream_rate)  # fmt: skip
    if host and delayed:  # the host share's update runs beside the next forward and backward
        host_lane = host
    if host and not p.vram_total:  # the CPU engine: the same cores compute and update
        host_lane = gpu_lane + host
    step = max(gpu_lane, host_lane, h2d, d2h) + act_exposed
    bounds = {
        "gpu_compute_s": compute,
        "h2d_s": h2d,
        "d2h_s": d2h,
        "host_adamw_s": host,
        "mapped_update_s": mapped,
    }
    bounds["exposed_s"] = max(0.0, step - max(bounds.values()))
    bounds.update(
        gpu_lane_s=gpu_lane,
        host_lane_s=host_lane,
        weight_stream_s=stream_s,
        stream_stall_s=stall,
        optimizer_pcie_s=max(opt_h2d, opt_d2h),
        issue_exposed_s=issue,
        activation_copy_s=act_exposed,
    )
    return bounds


def _streamed_host_lane(sh, p, weight_of, ss, split, per_f, per_b, outside_s, per_param, mapped_per_param,
                        stream_rate) -> float:  # fmt: skip
    """The step as stream_host.host_cycle runs the engine's queue: per part its host AdamW (per_param
    seconds a parameter), its gradients down and weights up at duplex_gbps / h2d_gbps, its mapped
    update at MAPPED_EFFICIENCY; a streamed block's copy at STREAM_EFFICIENCY x h2d_gbps, at
    duplex_gbps in the backward while gradients go down beside it."""
    from .stream_host import AHEAD, host_cycle, parts_split

    wb, n = sh.elem_bytes, len(sh.blocks)
    rows = parts_split(sh, split, ss)
    down = (p.duplex_gbps or p.d2h_gbps) * 1e9
    host_s = [r["host"] * per_param for r in rows]
    d2h_s = [r["host"] * wb / down for r in rows]
    ready_s = [
        0.0 if 1 <= i <= n and (i - 1) in ss else r["host"] * wb / (p.h2d_gbps * 1e9)
        for i, r in enumerate(rows)
    ]
    mapped_s = [r["mapped"] * mapped_per_param / (p.h2d_gbps * 1e9 * MAPPED_EFFICIENCY) for r in rows]
    load_f = [weight_of(b) / stream_rate if i in ss else 0.0 for i, b in enumerate(sh.blocks)]
    load_b = [
        weight_of(b) / min(stream_rate, down) if rows[i + 1]["host"] else load_f[i]
        for i, b in enumerate(sh.blocks)
    ]
    return host_cycle(fwd=per_f, bwd=per_b, load_f=load_f, load_b=load_b, streamed=ss, ahead=AHEAD, outside=outside_s,
                      host_s=host_s, d2h_s=d2h_s, mapped_s=mapped_s, ready_s=ready_s)  # fmt: skip


OVERLAPPED = ("gpu_compute_s", "h2d_s", "d2h_s", "host_adamw_s", "mapped_update_s", "disk_s")


def with_disk(bounds: dict, disk_bytes: int, read_gbps, write_gbps, bucket_bytes: int) -> dict:
    """`bounds` with the disk tier (module docstring): disk_s (its reads and writes, one after the
    other), the host lane stretched to max(host AdamW, disk_s) + one bucket's read and write (the
    edges), the step and exposed_s again. Unchanged without bytes or rates."""
    if not (disk_bytes and read_gbps and write_gbps):
        return bounds
    r, w = read_gbps * 1e9, write_gbps * 1e9
    disk = disk_bytes / r + disk_bytes / w
    edge = min(bucket_bytes, disk_bytes) * (1 / r + 1 / w)
    lane = bounds["host_lane_s"] + max(0.0, disk - bounds["host_adamw_s"]) + edge
    step = max(step_of(bounds)[0], lane + bounds["activation_copy_s"])
    out = {}
    for k, v in bounds.items():
        if k == "exposed_s":
            out["disk_s"] = disk
        out[k] = v
    out["host_lane_s"] = lane
    out["exposed_s"] = max(0.0, step - max(out[k] for k in OVERLAPPED))
    return out


def with_disk_reads(bounds: dict, read_bytes: int, read_gbps, first_bytes: int) -> dict:
    """`bounds` with the frozen weights' disk reads (module docstring): disk_s += read_bytes / rate,
    the first block's read exposed, the step and exposed_s again. Unchanged without bytes or rate."""
    if not (read_bytes and read_gbps):
        return bounds
    r = read_gbps * 1e9
    reads, first = read_bytes / r, min(first_bytes, read_bytes) / r
    step = max(step_of(bounds)[0], bounds.get("disk_s", 0.0) + reads) + first
    out = {**bounds, "disk_s": bounds.get("disk_s", 0.0) + reads}
    out["disk_weights_read_s"] = reads
    out["exposed_s"] = max(0.0, step - max(out.get(k, 0.0) for k in OVERLAPPED))
    return out


def step_of(bounds: dict) -> tuple[float, str]:
    """(predicted step seconds, the bound: the largest of compute, each PCIe way, host AdamW and
    the mapped update)."""
    overl = {k: bounds.get(k, 0.0) for k in OVERLAPPED}
    bound = max(overl, key=overl.get)
    return overl[bound] + bounds["exposed_s"], bound[:-2]
