"""OffloadTrainer on the GPU (-m cuda): losses beside the stock Trainer's in fp32, with weight
streaming, and an atomic checkpoint that resumes bit for bit with the host update."""

from __future__ import annotations

import os

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")

from transformers.trainer_utils import get_last_checkpoint

from ramstream.integrations.huggingface import OffloadTrainer
from test_hf_trainer import TOL, _args, _data, _llama_dir, _losses, _params

pytestmark = [pytest.mark.cuda, pytest.mark.filterwarnings("ignore::FutureWarning", "ignore::UserWarning")]


def _train(cls, root, out, resume=None, ramstream=None, **kw):
    model = transformers.AutoModelForCausalLM.from_pretrained(_llama_dir(root))
    extra = {} if ramstream is None else {"ramstream": ramstream}
    args = _args(out, use_cpu=False, eval_strategy="no", **kw)
    t = cls(model=model, args=args, train_dataset=_data(40), **extra)
    t.train(resume_from_checkpoint=resume)
    return t


@pytest.mark.parametrize("opts", [{}, {"param_offload": True}], ids=["defaults", "param_offload"])
def test_losses_equal_the_stock_trainer_cuda(tmp_path, opts):
    torch.backends.cuda.matmul.allow_tf32 = False
    stock = _train(transformers.Trainer, str(tmp_path), tmp_path / "stock")
    ours = _train(OffloadTrainer, str(tmp_path), tmp_path / "ours", ramstream=dict(opts))
    a, b = _losses(stock)[0], _losses(ours)[0]
    assert len(a) == len(b) == 10
    assert max(abs(x - y) for x, y in zip(a, b)) < TOL
    assert next(ours.model.parameters()).device.type == "cuda"


def test_checkpoint_resumes_bit_for_bit_cuda(tmp_path):
    opts = {"offload": True, "optimizer_mode": "cpu"}  # the host update on both sides of the resume
    ck = dict(save_strategy="steps", save_steps=5)
    full = _train(OffloadTrainer, str(tmp_path), tmp_path / "full", ramstream=dict(opts), **ck)
    assert get_last_checkpoint(str(tmp_path / "full")) == str(tmp_path / "full" / "checkpoint-10")
    assert not [n for n in os.listdir(tmp_path / "full") if n.startswith(".")]
    res = _train(
        OffloadTrainer,
        str(tmp_path),
        tmp_path / "res",
        resume=str(tmp_path / "full" / "checkpoint-5"),
        ramstream=dict(opts),
        **ck,
    )
    a, b = _params(full.model), _params(res.model)
    assert all(torch.equal(a[k], b[k]) for k in a)
