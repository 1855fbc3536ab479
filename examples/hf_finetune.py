"""Example: fine-tune a Hugging Face causal LM with ramstream's OffloadTrainer beside the stock Trainer.

    python examples/hf_finetune.py                      # a random-weight Llama-shaped model (~0.2B)
    python examples/hf_finetune.py --model Qwen/Qwen2-0.5B --seq 512
    python examples/hf_finetune.py --tiny               # seconds on a CPU

Both trainers start from the same weights, see the same batches and use the same TrainingArguments
(warm-up, gradient accumulation, clipping); the only change is the class name and ramstream={...}.
The script prints both loss curves, their largest difference, seconds per step and peak VRAM.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time

import torch
import transformers

from ramstream.integrations.huggingface import OffloadTrainer


def parse(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n")[0], formatter_class=argparse.RawTextHelpFormatter
    )
    p.add_argument("--model", help="a local folder or Hub name (default: a random-weight Llama built here)")
    p.add_argument("--hidden", type=int, default=1024, help="hidden size of the built model (default 1024)")
    p.add_argument("--layers", type=int, default=8, help="decoder layers of the built model (default 8)")
    p.add_argument("--vocab", type=int, default=32000, help="vocabulary of the built model (default 32000)")
    p.add_argument("--seq", type=int, default=256, help="tokens per row (default 256)")
    p.add_argument("--batch", type=int, default=4, help="rows per micro-batch (default 4)")
    p.add_argument("--accum", type=int, default=2, help="gradient_accumulation_steps (default 2)")
    p.add_argument("--steps", type=int, default=10, help="optimizer steps (default 10)")
    p.add_argument("--lr", type=float, default=1e-4, help="peak learning rate (default 1e-4)")
    p.add_argument("--cpu", action="store_true", help="train on the CPU even when a GPU is there")
    p.add_argument("--no-stock", action="store_true", help="skip the stock Trainer")
    p.add_argument("--tiny", action="store_true", help="a 2-layer, 64-wide model, 3 steps: seconds on a CPU")
    a = p.parse_args(argv)
    if a.tiny:
        a.hidden, a.layers, a.vocab, a.seq, a.batch, a.accum, a.steps, a.lr = 64, 2, 128, 16, 2, 2, 3, 3e-3
    return a


def build(a, folder: str) -> str:
    """The model's folder: --model, or a random-weight Llama saved with save_pretrained."""
    if a.model:
        return a.model
    torch.manual_seed(0)
    heads = max(1, a.hidden // 64)
    cfg = transformers.LlamaConfig(
        vocab_size=a.vocab,
        hidden_size=a.hidden,
        intermediate_size=a.hidden * 8 // 3 // 64 * 64 or 64,
        num_hidden_layers=a.layers,
        num_attention_heads=heads,
        num_key_value_heads=max(1, heads // 4),
        max_position_embeddings=max(a.seq, 64),
    )
    path = os.path.join(folder, "model")
    transformers.LlamaForCausalLM(cfg).save_pretrained(path)
    print(f"built a random-weight Llama: {a.layers} layers x {a.hidden} wide, vocab {a.vocab} -> {path}")
    return path


def data(n: int, seq: int, vocab: int) -> list[dict]:
    g = torch.Generator().manual_seed(1)
    rows = []
    for _ in range(n):
        ids = torch.randint(0, vocab, (seq,), generator=g)
        rows.append({"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids.clone()})
    return rows


def train(cls, path: str, a, out: str, gpu: bool, **kw) -> dict:
    # fp32 weights, bf16 autocast on a GPU (bf16=True): the stock AdamW then updates fp32 weights, as
    # ramstream's fp32 masters do, so the two loss curves stay comparable
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    vocab = model.config.vocab_size
    args = transformers.TrainingArguments(
        output_dir=out,
        per_device_train_batch_size=a.batch,
        gradient_accumulation_steps=a.accum,
        max_steps=a.steps,
        learning_rate=a.lr,
        warmup_steps=max(1, a.steps // 5),
        max_grad_norm=1.0,
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        use_cpu=not gpu,
        bf16=gpu,
        seed=0,
        disable_tqdm=True,
        optim="adamw_torch",
    )
    trainer = cls(model=model, args=args, train_dataset=data(a.steps * a.batch * a.accum, a.seq, vocab), **kw)
    if gpu:
        torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    trainer.train()
    wall = time.perf_counter() - t0
    losses = [e["loss"] for e in trainer.state.log_history if "loss" in e]
    peak = torch.cuda.max_memory_allocated() / 2**30 if gpu else 0.0
    del trainer, model
    if gpu:
        torch.cuda.empty_cache()
    return {"losses": losses, "s_per_step": wall / a.steps, "peak_gib": peak}


def main(argv=None) -> int:
    a = parse(argv)
    gpu = torch.cuda.is_available() and not a.cpu
    print(
        f"device: {'cuda' if gpu else 'cpu'}; {a.steps} steps of {a.batch}x{a.seq} tokens, accumulation {a.accum}"
    )
    with tempfile.TemporaryDirectory() as tmp:
        path = build(a, tmp)
        runs = {}
        if not a.no_stock:
            print("training with the stock transformers.Trainer ...")
            runs["stock"] = train(transformers.Trainer, path, a, os.path.join(tmp, "stock"), gpu)
        print("training with ramstream's OffloadTrainer (optimizer state and gradients in host RAM) ...")
        opts = {} if gpu else {"device": "cpu"}
        runs["ramstream"] = train(OffloadTrainer, path, a, os.path.join(tmp, "ours"), gpu, ramstream=opts)
    names = list(runs)
    print("step  " + "  ".join(f"{n:>10}" for n in names))
    for i in range(a.steps):
        print(f"{i + 1:>4}  " + "  ".join(f"{runs[n]['losses'][i]:>10.5f}" for n in names))
    for n in names:
        print(f"{n}: {runs[n]['s_per_step']:.3f} s/step, peak VRAM {runs[n]['peak_gib']:.2f} GiB")
    if "stock" in runs:
        diff = max(abs(x - y) for x, y in zip(runs["stock"]["losses"], runs["ramstream"]["losses"]))
        print(f"max |loss difference| = {diff:.3g}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
