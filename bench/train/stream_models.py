"""Models and measurements shared by the weight-streaming benchmarks (bench_stream.py,
probe_stream.py): Qwen2.5-shaped LoRA models and GPT configurations built without their
initialisation and filled cheaply, and the pinned H2D bandwidth of the machine."""

from __future__ import annotations

import contextlib
import json
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))

LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
QWEN = {
    "qwen7b": dict(
        hidden_size=3584,
        intermediate_size=18944,
        num_hidden_layers=28,
        num_attention_heads=28,
        num_key_value_heads=4,
        vocab_size=152064,
    ),
    "qwen14b": dict(
        hidden_size=5120,
        intermediate_size=13824,
        num_hidden_layers=48,
        num_attention_heads=40,
        num_key_value_heads=8,
        vocab_size=152064,
    ),
    "qwen_tiny": dict(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=512,
    ),
}
GPT_MODELS = {"gpt1.8b": "1.8b", "gpt6.85b": "6.85b", "gpt_tiny": "tiny"}
TINY = {"gpt1.8b": "gpt_tiny", "gpt6.85b": "gpt_tiny", "qwen7b": "qwen_tiny", "qwen14b": "qwen_tiny"}


# ---- models -----------------------------------------------------------------------------------
def fast_init_(model, std: float = 0.02, seed: int = 0) -> None:
    """Fills every parameter in place, cheaply: matrices ~N(0, std) (on the CPU: a tiled random
    pool at a random offset per tensor), 1-D "bias" zeros, other 1-D (norm weights) ones."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    pools = {}
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() < 2:
                p.zero_() if name.endswith("bias") else p.fill_(1.0)
            elif p.device.type != "cpu":
                p.normal_(0.0, std)
            else:
                key = p.dtype
                if key not in pools:
                    n = (1 << 22) + 17  # not a multiple of any row length: rows do not repeat
                    pools[key] = (torch.randn(n, generator=gen) * std).to(p.dtype)
                pool = pools[key]
                flat, n, k = p.view(-1), p.numel(), pool.numel()
                off = int(torch.randint(0, k, (1,), generator=gen))
                s = 0
                while s < n:
                    m = min(k - off, n - s)
                    flat[s : s + m].copy_(pool[off : off + m])
                    s, off = s + m, 0


def build_gpt(key: str, seq: int, dev):
    import torch

    sys.path.insert(0, HERE)
    from gpt import CONFIGS as GPT_CONFIGS
    from gpt import GPT

    cfg = dict(GPT_CONFIGS[GPT_MODELS[key]], ctx=max(1024, seq))
    with torch.device("meta"):
        model = GPT(**cfg)
    model = model.to_empty(device=dev)
    fast_init_(model)
    return model, cfg["vocab"]


def build_qwen(key: str, dev, layers: int | None, ckpt: bool):
    """A Qwen2.5-shaped causal LM with random bf16 weights and LoRA r16 on q,k,v,o,gate,up,down
    (peft); the base frozen. ImportError when transformers or peft is missing."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, Qwen2Config

    try:
        from transformers.initialization import no_init_weights
    except ImportError:  # transformers 4.x
        try:
            from transformers.modeling_utils import no_init_weights
        except ImportError:
            no_init_weights = contextlib.nullcontext
    shape = dict(QWEN[key])
    if layers:
        shape["num_hidden_layers"] = layers
    cfg = Qwen2Config(**shape, tie_word_embeddings=False, use_cache=False, max_position_embeddings=32768)
    with no_init_weights(), torch.device(dev):
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16, attn_implementation="sdpa")
    fast_init_(model)
    model.train()
    if ckpt:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    lcfg = LoraConfig(
        r=16, lora_alpha=32, lora_dropout=0.0, target_modules=LORA_TARGETS, task_type="CAUSAL_LM"
    )
    model = get_peft_model(model, lcfg)
    return model, cfg.vocab_size


def h2d_gbps(dev) -> float | None:
    """GB/s of a 256 MiB pinned host -> device copy (median of 3), buffers freed after."""
    import torch

    if dev.type != "cuda":
        return None
    n = 256 << 20
    host = torch.empty(n, dtype=torch.uint8).pin_memory()
    gpu = torch.empty(n, dtype=torch.uint8, device=dev)
    gpu.copy_(host, non_blocking=True)
    torch.cuda.synchronize(dev)
    ts = []
    for _ in range(3):
        t0 = time.perf_counter()
        gpu.copy_(host, non_blocking=True)
        torch.cuda.synchronize(dev)
        ts.append(time.perf_counter() - t0)
    del host, gpu
    torch.cuda.empty_cache()
    return n / sorted(ts)[1] / 1e9


def _busy(spans) -> tuple[int, float]:
    """(bytes, seconds the union of the spans covers); spans are (start us, end us, bytes)."""
    busy_us, end = 0.0, float("-inf")
    for a, b, _ in sorted(spans):
        if b > end:
            busy_us += b - max(a, end)
            end = b
    return sum(s[2] for s in spans), busy_us / 1e6


def _rate(spans) -> dict:
    nbytes, busy = _busy(spans)
    return {
        "loads": len(spans),
        "bytes": nbytes,
        "busy_s": busy,
        "gbps": nbytes / busy / 1e9 if busy > 0 else None,
    }


def load_rate(trace_path: str) -> dict:
    """The weight loads of a ramstream.trace file: their count and bytes, the time the copy stream
    spent on them (the union of their spans, CUDA-event timed) and the rate while loading, which
    is what the issue's ">= 85 % of measured PCIe bandwidth" compares (not bytes / step time,
    which also counts the time the stream had nothing to load). "alone" and "beside_d2h" split the
    loads by whether a gradient copy (the d2h lane) ran during them: the bus then carries both
    directions, whose reference is the duplex rate, not the one-way one."""
    with open(trace_path) as f:
        events = json.load(f)["traceEvents"]

    def lane(cat, prefix=""):
        return [
            (e["ts"], e["ts"] + e["dur"], e.get("args", {}).get("bytes", 0))
            for e in events
            if e.get("cat") == cat and e.get("ph") == "X" and str(e.get("name", "")).startswith(prefix)
        ]

    loads, d2h = lane("h2d", "load "), lane("d2h")
    beside = [s for s in loads if any(a < s[1] and b > s[0] for a, b, _ in d2h)]
    alone = [s for s in loads if s not in beside]
    out = _rate(loads)
    if d2h:
        out["alone"], out["beside_d2h"] = _rate(alone), _rate(beside)
    return out


def split_utilisation(wl: dict, one_way: float | None, duplex: float | None) -> None:
    """Adds "util" to load_rate's "alone" (against the one-way rate) and "beside_d2h" (against the
    duplex rate, each way while both run) parts, and "duplex_gbps"."""
    wl["duplex_gbps"] = duplex
    for part, ref in (("alone", one_way), ("beside_d2h", duplex)):
        if wl.get(part) and wl[part]["gbps"] and ref:
            wl[part]["util"] = wl[part]["gbps"] / ref
