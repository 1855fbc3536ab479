"""Every threshold the planner's decisions use, once (a leaf: imports nothing). Only planner modules
read them: policy.py, plan.py and the in-training decisions (inflight.py, levers.py), and wrap()'s
size rules as pure functions over numbers (wrap_rules.py: LoRA-like, the weights' VRAM share,
activation_checkpointing="auto", the gradients' in-flight budget; quantize.py: quantize="auto";
host_fit.py: moment_dtype="auto"), which the runtime asks with the numbers it counts on the live
model (runtime/inspect.py, runtime/quantize.py) and policy.py with a ModelShape's, so that no copy
can disagree. Mechanisms (engine/, weights/, activations/, quant/) never read them
(tests/test_layering.py)."""

from __future__ import annotations

# A model whose blocks train less than this share of their elements is LoRA-like (a frozen base).
LORA_LIKE = 0.10
# The share of usable VRAM resident weights may take (wrap_rules.weight_share: param_offload="auto" and
# quantize="auto"): 70 % when every block recomputes or the model is LoRA-like, 50 % otherwise.
STREAM_SHARE = {True: 0.7, False: 0.5}
# activation_checkpointing="auto": a LoRA-like model recomputes when its block weights fill more
# than this share of usable VRAM; a full fine-tune when weights + moments + gradients exceed this
# share.
RECOMPUTE_LORA_WEIGHTS = 0.25
RECOMPUTE_FULL_FT = 0.9
# The device bytes gradients on their way to the host may hold (max_inflight_bytes=None): a tenth of
# usable VRAM within these bounds (wrap_rules.grad_inflight_bytes).
GRAD_INFLIGHT_MIN = 1 << 20
GRAD_INFLIGHT_MAX = 1 << 30
# Kept free beyond the headroom when the optimizer state takes a share of VRAM (runtime/optimizer_split.py maybe_share).
MARGIN_BYTES = 512 << 20
# The share of available host RAM ramstream's host memory may take (host_fit.py, moment dtype;
# quantize.py host_room).
HOST_RAM_SHARE = 0.9
# The share of the machine's RAM a bucket moved mid-run (runtime/refiner.py, runtime/watchdog.py
# through runtime/measure.py host_room) must leave available: a move that would eat into it stays.
HOST_RESERVE_SHARE = 1 - HOST_RAM_SHARE

# The step wrap() plans for when it is not told (batch=, seq=): PLAN_BATCH x PLAN_SEQ tokens; when
# that cannot fit, the batch halves (then the sequence) down to PLAN_MIN_TOKENS, and the plan
# records the tokens it was made for. A larger step is checked against the plan at its first
# forward (runtime/tokens.py) and refused with the arithmetic when it cannot fit.
PLAN_BATCH = 8
PLAN_SEQ = 512
PLAN_MIN_TOKENS = 256
# The loss the plan counts unless told: a dense cross-entropy keeps its logits, their fp32 copy
# and their gradient (planner/shape.py logits_bytes).
PLAN_LOSS = "dense"

# offload="auto" decides after this many steps whether the state goes resident or a share of it
# moves to VRAM (optim.py, runtime/refiner.py schedules its refinements after it).
SWITCH_AFTER_STEPS = 2

# The H200 machine's profile, used when no cached profile exists: the rates `ramstream doctor`
# and the engine measured there (tests/test_planner_h200.py, whose rows the step model is checked
# on): pinned copies each way and both at once; host AdamW 4.56 G params/s x 28 B, the rate the
# fourth session's profile gave the engine's optimizer split (HOST_UNDER_DMA is relative to it;
# bench_adamw: 4.51, 110-126 GB/s, DESIGN.md; the second session's in-process figure was 2.86);
# the bf16 GEMM rate (DESIGN.md).
DEFAULT_RATES = {
    "h2d_gbps": 54.9,
    "d2h_gbps": 55.0,
    "duplex_gbps": 49.5,
    "adamw_gbps": 4.56 * 28,
    "matmul_tflops": 790.0,
}
DEFAULT_VRAM = 140 * 2**30  # an H200's 143771 MiB

# The disk tier (nvme_offload="auto", planner/disk.py): when the host RAM cannot hold the host-updated
# optimizer state, the smallest share of it (fp32 master + moments) goes to a scratch file in
# nvme_dir. The file may take this share of the disk's free space (the rest stays for the
# filesystem and whatever else writes there) ...
DISK_FREE_SHARE = 0.9
# ... and this much host RAM stays reserved beside it: the disk reads and write-backs are
# double-buffered with the host AdamW (a bucket of state read ahead, one written behind: two
# buckets of 8M params x 12 B each way, ~400 MiB), and the engine places whole buckets, so its
# share may land one bucket above the plan's.
NVME_RAM_MARGIN = 1 << 30

# optimizer_mode="auto"'s measured refinement (runtime/refiner.py, planner/inflight.py): steps
# measured before a refinement; refinements that may move buckets (the split settles afterwards: no
# oscillation); the predicted optimizer time must fall by more than MIN_GAIN, and a measured step
# more than MIN_GAIN slower than before the move undoes it. The host-only trial runs when the host
# AdamW of every movable bucket, at the measured rate, takes at most HOST_TRIAL_SHARE of the
# measured step (the host lane is the forward and the host AdamW beside the backward: the forward
# is about a quarter of a recomputed step).
MEASURE_STEPS = 2
MAX_REFINEMENTS = 2
MIN_GAIN = 0.05
HOST_TRIAL_SHARE = 0.6

# activation_checkpointing="auto" in LoRA (runtime/keep.py, planner/levers.py keep_count): after
# KEEP_DECIDE_AFTER steps the last blocks whose activations fit keep them; a block's measured bytes
# are taken KEEP_SAFETY times larger.
KEEP_DECIDE_AFTER = 1
KEEP_SAFETY = 1.1

# The watchdog (runtime/watchdog.py, planner/levers.py): it acts when a step's peak uses up this
# share of the plan's vram_headroom (half: 95 % of the cap with the default 10 % headroom).
WATCHDOG_HEADROOM_USED = 0.5

# A streamed pipeline stage (Pipeline(offload=True), offload_window="auto"): the streaming window it
# gets when its device budget allows (the running chunk and the next one loading: window 1
# serialises every load behind the compute before it); it falls to 1 when two slots do not fit.
# Pinned chunks (offload_pin="auto") then take what the budget leaves, as many as fit. Without a
# budget (device_memory=None) a stage gets this window and no pinned chunk.
PIPELINE_STREAM_WINDOW = 2
# AdamW's two fp32 moments per trainable element: what a resident pipeline stage (and a pinned
# chunk of a streamed one) keeps on its device beside parameters and gradients.
PIPELINE_OPTIMIZER_BYTES = 8
# The disk tier's weights (nvme_weights, planner/disk_weights.py): blocks' frozen weights on disk are
# staged through a ring of this many pinned buffers (the streamer's weight_window=2 ahead + the running
# block), and the last this many streamed blocks stay loaded from the forward into the backward (read
# once per step; the others twice).
NVME_WEIGHTS_WINDOW = 3

# delayed_update with optimizer_mode="auto": the plan tries this many + 1 mapped shares of the movable
# parameters (0, 1/N, ..., 1) and keeps the one with the shortest predicted step (delayed_split.py)
DELAYED_SPLIT_STEPS = 20
# wrap(delayed_update=...) warns when the plan without it predicts a step this much shorter
# (no resident switch with delayed_update, no refinement: policy.delayed_verdict)
DELAYED_SLOWER = 0.05
