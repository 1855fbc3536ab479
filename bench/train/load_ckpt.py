"""A smaller stand-in for bench_quant's LOAD checkpoint: the Qwen2.5-7B layer shape with fewer
layers (and optionally a smaller vocabulary), bf16 random weights, sharded like the real one, so
that load_model and from_pretrained + quantize_model can be timed on a machine with little RAM.

    python bench/train/load_ckpt.py /tmp/ckpt --layers 4 --vocab 32000 --shard 1GB
    python bench/train/bench_quant.py --device cpu --ckpt /tmp/ckpt \
        --config '{"name": "LOAD_ramstream", "row": "LOAD", "kind": "load", "cap_gib": 0, "batch": 0,
                   "seq": 0, "options": {}, "layers": null}'      # kind "hf_load": the baseline
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from stream_models import QWEN, fast_init_  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("folder")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=QWEN["qwen7b"]["vocab_size"])
    ap.add_argument("--shard", default="1GB", help="max_shard_size for save_pretrained")
    args = ap.parse_args()
    import torch
    from transformers import AutoModelForCausalLM, Qwen2Config
    from transformers.initialization import no_init_weights

    shape = dict(QWEN["qwen7b"], num_hidden_layers=args.layers, vocab_size=args.vocab)
    conf = Qwen2Config(**shape, tie_word_embeddings=False, use_cache=False)
    with no_init_weights():
        model = AutoModelForCausalLM.from_config(conf, dtype=torch.bfloat16)
    fast_init_(model)
    shutil.rmtree(args.folder, ignore_errors=True)
    model.save_pretrained(args.folder, max_shard_size=args.shard)
    files = [f for f in os.listdir(args.folder) if f.endswith(".safetensors")]
    gib = sum(os.path.getsize(os.path.join(args.folder, f)) for f in files) / 2**30
    print(f"{args.folder}: {len(files)} shards, {gib:.2f} GiB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
