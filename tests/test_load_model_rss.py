"""Peak RSS of load_model(quantize="nf4") on a ~300 MB bf16 checkpoint, measured in a fresh
process (VmHWM reset after the imports and a one-layer load that imports the model's code,
about 100 MB for transformers): below 1.3x the size of the loaded, quantized model."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

transformers = pytest.importorskip("transformers")
safetensors_torch = pytest.importorskip("safetensors.torch")

_CHILD = r"""
import json, sys, torch, transformers, ramstream
from ramstream.integrations.hf_load import load_model

def status(key):
    with open("/proc/self/status") as f:
        return next(int(l.split()[1]) * 1024 for l in f if l.startswith(key + ":"))

load_model(sys.argv[1], quantize="nf4", random_weights=True, num_hidden_layers=1)  # imports the model's code
with open("/proc/self/clear_refs", "w") as f:
    f.write("5")  # resets VmHWM to the current RSS
base = status("VmRSS")
model = load_model(sys.argv[1], quantize="nf4")
peak = status("VmHWM")
size = sum(t.nbytes for t in {id(t): t for t in list(model.parameters()) + list(model.buffers())}.values())
print(json.dumps({"base": base, "peak": peak, "size": size}))
"""


@pytest.mark.skipif(not os.path.exists("/proc/self/clear_refs"), reason="needs Linux /proc")
def test_peak_rss_of_load_model_stays_below_1_3x_the_quantized_size(tmp_path):
    from ramstream.integrations.hf_load import _skeleton

    cfg = transformers.LlamaConfig(
        vocab_size=1024,
        hidden_size=1024,
        intermediate_size=2816,
        num_hidden_layers=12,
        num_attention_heads=8,
        num_key_value_heads=8,
        tie_word_embeddings=False,
    )
    skeleton = _skeleton(cfg, torch.bfloat16, False)
    g = torch.Generator().manual_seed(0)
    tensors = {
        n: (torch.randn(p.shape, generator=g) * 0.02).to(torch.bfloat16)
        for n, p in skeleton.named_parameters()
    }
    nbytes = sum(t.nbytes for t in tensors.values())
    assert nbytes > 250 << 20
    cfg.save_pretrained(tmp_path)
    safetensors_torch.save_file(tensors, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    del tensors, skeleton
    env = dict(os.environ, OMP_NUM_THREADS="1")
    out = subprocess.run(
        [sys.executable, "-c", _CHILD, str(tmp_path)], capture_output=True, text=True, env=env, timeout=600
    )
    assert out.returncode == 0, out.stderr[-3000:]
    r = json.loads(out.stdout.strip().splitlines()[-1])
    grew = r["peak"] - r["base"]
    assert r["size"] < nbytes / 3  # NF4 blocks, bf16 embeddings and head
    assert grew < 1.3 * r["size"], (
        f"RSS grew {grew / 2**20:.1f} MiB for a {r['size'] / 2**20:.1f} MiB model (checkpoint {nbytes / 2**20:.1f} MiB)"
    )
