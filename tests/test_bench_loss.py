"""bench/train/bench_loss.py --tiny (CPU): both losses run and agree, as the GPU run relies on."""

import importlib.util
import pathlib

SCRIPT = pathlib.Path(__file__).resolve().parents[1] / "bench" / "train" / "bench_loss.py"


def test_bench_loss_tiny_agrees_with_the_dense_loss(tmp_path):
    spec = importlib.util.spec_from_file_location("bench_loss", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    rows = mod.main(["--tiny", "--out", str(tmp_path / "loss.json")])
    assert [r["config"] for r in rows] == ["hf_dense", "chunked_16", "chunked_64"]
    for r in rows[1:]:  # fp32 on the CPU: the chunked loss and its gradients equal the dense ones
        assert r["loss"] <= 1e-6 and r["dh"] <= 1e-6 and r["dw"] <= 1e-6, r
        assert r["ms"] > 0
    assert (tmp_path / "loss.json").exists()
