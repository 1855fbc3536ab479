"""Example: LoRA on a 7B/14B/32B/70B-shaped base (random weights), bf16 or quantized, with ramstream.

    python examples/lora_large_model.py --size 7b                    # bf16 base, planner decides the rest
    python examples/lora_large_model.py --size 70b --quantize nf4    # NF4-packed frozen base
    python examples/lora_large_model.py --size 14b --layers 8 --compare-stock
    python examples/lora_large_model.py --tiny --compare-stock       # seconds on a CPU

The base is built with ramstream.integrations.huggingface.load_model(..., random_weights=True): no
download, block by block, frozen weights packed as int8/NF4 right after they are made (--quantize),
so the full-precision base never exists in RAM at once. peft adds LoRA adapters; wrap_hf() puts
their optimizer state in host RAM and streams the base's blocks when it does not fit in VRAM.
--compare-stock first trains the same model the plain way (model on the GPU, torch.optim.AdamW):
it reports out of memory where the base does not fit.
"""

from __future__ import annotations

import argparse
import tempfile
import time

import peft
import torch
import transformers

import ramstream
from ramstream.integrations.huggingface import load_model, wrap_hf

# (config class, hidden, intermediate, layers, heads, kv heads, vocab): Llama-2-7B, Qwen2.5-14B,
# Qwen2.5-32B and Llama-3-70B shapes
SHAPES = {
    "7b": (transformers.LlamaConfig, 4096, 11008, 32, 32, 32, 32000),
    "14b": (transformers.Qwen2Config, 5120, 13824, 48, 40, 8, 152064),
    "32b": (transformers.Qwen2Config, 5120, 27648, 64, 40, 8, 152064),
    "70b": (transformers.LlamaConfig, 8192, 28672, 80, 64, 8, 128256),
    "tiny": (transformers.LlamaConfig, 64, 128, 2, 4, 2, 128),
}
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj"]


def parse(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n")[0], formatter_class=argparse.RawTextHelpFormatter
    )
    p.add_argument("--size", choices=list(SHAPES), default="7b", help="the base's shape (default 7b)")
    p.add_argument("--layers", type=int, help="keep only this many decoder layers (a quick try)")
    p.add_argument(
        "--quantize",
        choices=["auto", "none", "int8", "nf4"],
        default="auto",
        help="frozen base weights: auto packs only when bf16 does not fit in RAM (default auto)",
    )
    p.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16", help="base dtype")
    p.add_argument("--rank", type=int, default=16, help="LoRA rank (default 16)")
    p.add_argument("--seq", type=int, default=512, help="tokens per row (default 512)")
    p.add_argument("--batch", type=int, default=1, help="rows per step (default 1)")
    p.add_argument("--steps", type=int, default=5, help="optimizer steps (default 5)")
    p.add_argument("--lr", type=float, default=1e-4, help="learning rate (default 1e-4)")
    p.add_argument("--cpu", action="store_true", help="train on the CPU even when a GPU is there")
    p.add_argument("--compare-stock", action="store_true", help="also train without ramstream first")
    p.add_argument("--tiny", action="store_true", help="--size tiny, float32, 3 steps of 2x16 tokens")
    a = p.parse_args(argv)
    if a.tiny:
        a.size, a.dtype, a.seq, a.batch, a.steps, a.lr, a.rank = "tiny", "float32", 16, 2, 3, 1e-2, 4
    return a


def base_model(a, folder: str):
    cls, d, ff, layers, heads, kv, vocab = SHAPES[a.size]
    cls(
        hidden_size=d,
        intermediate_size=ff,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv,
        vocab_size=vocab,
        max_position_embeddings=max(a.seq, 4096),
    ).save_pretrained(folder)
    over = {"num_hidden_layers": a.layers} if a.layers else {}
    torch.manual_seed(0)  # the same random base for both runs
    model = load_model(
        folder, random_weights=True, quantize=a.quantize, dtype=getattr(torch, a.dtype), **over
    )
    torch.manual_seed(1)  # the same adapters
    model = peft.get_peft_model(
        model, peft.LoraConfig(r=a.rank, lora_alpha=2 * a.rank, target_modules=TARGETS)
    )
    with torch.no_grad():  # lora_B starts at zero; a small random one makes every step move the loss
        g = torch.Generator().manual_seed(2)
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.copy_(torch.randn(p.shape, generator=g) * 1e-3)
    return model, vocab


def batches(a, vocab: int, device) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    return [torch.randint(0, vocab, (a.batch, a.seq), generator=g).to(device) for _ in range(a.steps)]


def loop(model, opt, loss_fn, data, gpu: bool) -> tuple[list[float], float]:
    losses, t0 = [], None
    for i, ids in enumerate(data):
        if i == 1:  # the first step includes warm-up (allocations, the plan's measurements)
            if gpu:
                torch.cuda.synchronize()
            t0 = time.perf_counter()
        loss = loss_fn(ids)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
        print(f"  step {i + 1}: loss {losses[-1]:.5f}")
    if gpu:
        torch.cuda.synchronize()
    spent = (time.perf_counter() - t0) / (len(data) - 1) if t0 is not None else float("nan")
    return losses, spent


def trainable(model) -> list[torch.nn.Parameter]:
    return [p for p in model.parameters() if p.requires_grad]


def stock(a, folder, gpu):
    box = [base_model(a, folder)[0]]  # dropped in `finally` so that its memory is gone before ramstream's run
    vocab = SHAPES[a.size][-1]
    dev = torch.device("cuda" if gpu else "cpu")
    try:
        box[0].to(dev)
        opt = torch.optim.AdamW(trainable(box[0]), lr=a.lr)
        loss_fn = lambda ids: box[0](input_ids=ids, labels=ids).loss
        return loop(box[0], opt, loss_fn, batches(a, vocab, dev), gpu)
    except torch.OutOfMemoryError as e:
        print(f"  stock: out of memory ({str(e).splitlines()[0][:100]})")
        return None, None
    finally:
        box.clear()
        if gpu:
            torch.cuda.empty_cache()


def main(argv=None) -> int:
    a = parse(argv)
    gpu = torch.cuda.is_available() and not a.cpu
    cls, d, ff, layers, *_ = SHAPES[a.size]
    print(
        f"LoRA r={a.rank} on q/k/v/o of a {a.size}-shaped {cls.__name__[:-6]} base "
        f"({a.layers or layers} layers x {d} wide), {a.dtype}, quantize={a.quantize}, on {'cuda' if gpu else 'cpu'}"
    )
    ref = None
    with tempfile.TemporaryDirectory() as folder:
        if a.compare_stock:
            print("stock: the model on the device, torch.optim.AdamW over the adapters")
            ref = stock(a, folder, gpu)
            if gpu:
                print(f"  stock peak VRAM {torch.cuda.max_memory_allocated() / 2**30:.2f} GiB")
                torch.cuda.reset_peak_memory_stats()
        model, vocab = base_model(a, folder)
    packed = sum(1 for m in model.modules() if ramstream.quant.is_quantized(m))
    print(f"base built: {sum(p.numel() for p in model.parameters()):,} parameters, {packed} packed Linear(s)")
    opts = {"device": "cuda" if gpu else "cpu"}  # the base was built in host RAM
    model, opt, loss_fn = wrap_hf(
        model, torch.optim.AdamW(trainable(model), lr=a.lr), return_loss=True, **opts
    )
    rep = ramstream.memory_report(model)
    n_train = sum(p.numel() for p in trainable(model))
    streamed = rep["params"]["streamed_blocks"]
    print(f"ramstream: {n_train:,} trainable (adapter) elements; streamed blocks: {streamed or 'none'}")
    dev = torch.device("cuda" if gpu else "cpu")  # where the batches go (wrap() placed the model)
    losses, spent = loop(
        model, opt, lambda ids: loss_fn(input_ids=ids, labels=ids), batches(a, vocab, dev), gpu
    )
    opt.synchronize()
    rep = ramstream.memory_report(model)["optimizer"]
    print(
        f"ramstream: {spent:.3f} s/step; host optimizer state {rep['host_state_bytes']:,} bytes "
        f"for {n_train:,} adapter elements; peak VRAM "
        f"{torch.cuda.max_memory_allocated() / 2**30 if gpu else 0.0:.2f} GiB"
    )
    if ref is not None and ref[0] is not None:
        print(f"stock: {ref[1]:.3f} s/step")
        print(f"max |loss difference| = {max(abs(x - y) for x, y in zip(ref[0], losses)):.3g}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
