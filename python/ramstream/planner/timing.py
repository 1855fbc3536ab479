"""The step-time model of plan_training(): seconds per step from the HardwareProfile's rates and
the plan's placements. Pure arithmetic.

Per block and pass (the forward; the backward with the block's recompute), the longer of
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

The offloaded optimizer's work adds to that: host AdamW (host params x 28 B, 20 with bf16
moments, / (adamw_gbps x HOST_UNDER_DMA): the DMA shares the host's memory bandwidth) and its
PCIe time (mapped moments, and a low-precision model's master, both ways; the host share's
gradients down and weights up; each way at duplex_gbps while both run). Measured on the H200
(1.8B GPT at 24 GiB, dense and chunked loss: 0.341 and 0.308 s/step): the step grows by about
both, the backward throttled and the next forward waiting for the last buckets. Paged
activations expose (1 - ACT_OVERLAP) of their copies.

The constants are fitted on the H200 machine's rows in tests/test_planner_h200.py; the profile's
matmul rate there is calibrated once, from the 1.8B GPT uncapped.
"""

from __future__ import annotations

# share of the profile's matmul rate (a 4096^3 bf16 GEMM, ~790 TFLOP/s on the H200) a training
# step's matmuls reach: calibrated on the 1.8B GPT uncapped (0.112 s/step: 632 TFLOP/s effective)
MATMUL_EFFICIENCY = 0.8
HBM_EW_GBPS = 1500.0  # elementwise traffic (norms, activations, casts, their gradients), GB/s
EAGER_OP_S = 34e-6  # host seconds per eager op and pass (H200 machine's CPU, torch 2.11)
STREAM_EFFICIENCY = 0.84  # weight stream / measured H2D (7B LoRA at 8 GiB: 45.9 of 54.9 GB/s)
DEVICE_ADAMW_GBPS = 3000.0  # AdamW on GPU state (fused or ramstream's kernel), GB/s of state
HOST_UNDER_DMA = 0.82  # host AdamW rate while DMA runs / the profile's rate (row A's log)
ACT_OVERLAP = 0.9  # share of activation copies hidden behind compute, until measured
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


def step_times(
    shape, prof, weight_of, *, streamed, modes, paged_bytes: int, split: dict, state_bytes: int,
    mapped_bytes_per_param: int,
) -> dict:  # fmt: skip
    """Seconds per resource and the predicted step (module docstring). split: numel per placement
    {"device", "mapped", "host"}; state_bytes: AdamW state traffic per parameter (28 / 20);
    mapped_bytes_per_param: what one mapped update moves each way."""
    sh, p = shape, prof
    T, n = sh.tokens, len(sh.blocks)
    rate = p.matmul_tflops * 1e12 * MATMUL_EFFICIENCY if p.matmul_tflops else None
    ss = set(streamed)

    def gpu(flops: float, nbytes: float) -> float:
        return (flops / rate if rate else 0.0) + nbytes / (HBM_EW_GBPS * 1e9)

    stream_rate = p.h2d_gbps * 1e9 * STREAM_EFFICIENCY if p.h2d_gbps else None
    compute = stall = loads = 0.0
    for i, b in enumerate(sh.blocks):
        rc = 1 if modes[i] == "recompute" else 0
        act = sh.act_bytes(i)
        f, bw = b.fwd_flops_per_token * T, b.bwd_flops_per_token * T
        t_f = max(gpu(f, act), b.fwd_ops * EAGER_OP_S)
        t_b = max(gpu(bw + rc * f, act * (2 + rc)), b.fwd_ops * EAGER_OP_S * (2 + rc))
        compute += t_f + t_b
        if i in ss and stream_rate:
            load = weight_of(b) / stream_rate
            passes = [t_f] + ([t_b] if i < n - 1 else [])
            loads += len(passes)
            stall += sum(max(0.0, load - t) for t in passes)
    outside = sum((q.fwd_flops_per_token + q.bwd_flops_per_token) * T for q in (sh.embed, sh.head))
    compute += gpu(outside, LOGIT_PASSES * sh.logits_bytes)
    compute += split["device"] * state_bytes / (DEVICE_ADAMW_GBPS * 1e9)
    wb = sh.elem_bytes
    streamed_tr = sum(sh.blocks[i].trained_numel for i in ss)
    w_stream = sum(weight_of(sh.blocks[i]) * (2 if i < n - 1 else 1) for i in ss)
    opt_up = max(0, split["host"] - streamed_tr) * wb + split["mapped"] * mapped_bytes_per_param
    opt_down = split["host"] * wb + split["mapped"] * mapped_bytes_per_param
    opt_h2d, opt_d2h = _pcie(p, opt_up, opt_down)
    opt_pcie = max(opt_h2d, opt_d2h)
    host = 0.0
    if split["host"] and p.adamw_gbps:
        host = split["host"] * state_bytes / (p.adamw_gbps * 1e9 * (HOST_UNDER_DMA if p.vram_total else 1.0))
    act_h2d, act_d2h = _pcie(p, paged_bytes, paged_bytes)
    act_exposed = (1 - ACT_OVERLAP) * (act_h2d + act_d2h)
    stream_s = w_stream / stream_rate if stream_rate else 0.0
    h2d = stream_s + opt_h2d + act_h2d
    d2h = opt_d2h + act_d2h
    step = compute + stall + host + opt_pcie + act_exposed
    bounds = {"gpu_compute_s": compute, "h2d_s": h2d, "d2h_s": d2h, "host_adamw_s": host}
    bounds["exposed_s"] = max(0.0, step - max(bounds.values()))
    bounds.update(
        weight_stream_s=stream_s,
        stream_stall_s=stall,
        optimizer_pcie_s=opt_pcie,
        activation_copy_s=act_exposed,
    )
    return bounds


OVERLAPPED = ("gpu_compute_s", "h2d_s", "d2h_s", "host_adamw_s")


def step_of(bounds: dict) -> tuple[float, str]:
    """(predicted step seconds, the bound: the largest of compute, each PCIe way, host AdamW)."""
    overl = {k: bounds[k] for k in OVERLAPPED}
    bound = max(overl, key=overl.get)
    return overl[bound] + bounds["exposed_s"], bound[:-2]
