"""Bad inputs to the public functions (issue 25, the audit of the public surface): each case is
(function and bad input, the exception expected, a pattern its message must match that names the
argument). The cases marked "fixed" raised a raw error from deep inside, or none, before the audit;
the rest held already and stay as regression tests. bench/probe_public_inputs.py is the wider
probe these came from."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn as nn

import ramstream
from ramstream import HardwareProfile, ModelShape

from _models import make_model

NAN = math.nan
RATES = dict(h2d_gbps=50.0, d2h_gbps=50.0, duplex_gbps=40.0, adamw_gbps=80.0, matmul_tflops=500.0)


def _om():
    chunks = [nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 8)) for _ in range(3)]
    return ramstream.OffloadModel(chunks, device="cpu")


def _opt():
    model = make_model(0)
    return ramstream.OffloadAdamW(model.parameters(), device="cpu"), model


def _load_sd(edit):
    def run():
        opt, _ = _opt()
        sd = opt.state_dict()
        edit(sd)
        opt.load_state_dict(sd)

    return run


def _state0(**entries):
    """state_dict edit: parameter 0's state replaced by these entries (the embedding: 64 x 32)."""
    base = {"step": torch.tensor(1.0), "exp_avg": torch.zeros(64, 32), "exp_avg_sq": torch.zeros(64, 32)}
    return lambda sd: sd["state"].__setitem__(0, {**base, **entries})


def _plan(**profile):
    shape = ModelShape.gpt("125m", batch=1, seq=8)
    base = dict(vram_total=2**34, vram_free=2**34, ram_total=2**36, ram_available=2**36, **RATES)
    return ramstream.plan_training(shape, HardwareProfile(**{**base, **profile}))


def _frozen():
    return make_model(0).requires_grad_(False)


def _quantize_twice():
    model = _frozen()
    ramstream.quantize_model(model, "nf4")
    ramstream.quantize_model(model, "int8")


H, W, T = torch.randn(4, 8), torch.randn(16, 8), torch.randint(0, 16, (4,))
FOREIGN = [nn.Linear(2, 2), nn.Linear(2, 2)]

# (id, call, exception, message pattern, fixed by the audit)
CASES = [
    # OffloadModel.step / optimizer
    ("OffloadModel.step loss_fn=1", lambda: _om().step(torch.randn(2, 8), torch.randn(2, 8), loss_fn=1),
     TypeError, r"loss_fn must be None .* or a callable", True),
    ("OffloadModel.step grad_outputs=1", lambda: _om().step(torch.randn(2, 8), grad_outputs=1),
     TypeError, r"grad_outputs must be None, a tensor", True),
    ("OffloadModel.step grad_outputs=[tensor]", lambda: _om().step(torch.randn(2, 8), grad_outputs=[torch.randn(2, 8)]),
     TypeError, r"grad_outputs must be None, a tensor", True),
    ("OffloadModel.step grad_outputs shape", lambda: _om().step(torch.randn(2, 8), grad_outputs=torch.randn(3)),
     ValueError, r"grad_outputs\[0\] has shape \(3,\), the output \(2, 8\)", True),
    ("OffloadModel.step targets shape", lambda: _om().step(torch.randn(2, 8), torch.randn(3, 5)),
     ValueError, r"targets must be a tensor of the output's shape \(2, 8\)", True),
    ("OffloadModel.step targets broadcast", lambda: _om().step(torch.randn(2, 8), torch.randn(8)),
     ValueError, r"targets must be a tensor of the output's shape \(2, 8\).*got \(8,\)", True),
    ("OffloadModel.optimizer params=5", lambda: _om().optimizer(params=5),
     TypeError, r"params must be None or an iterable of parameters", True),
    ("OffloadModel window=0", lambda: ramstream.OffloadModel([nn.Linear(2, 2)], device="cpu", window=0),
     ValueError, r"window must be an int >= 1", False),
    ("OffloadModel pin_layers=[5]", lambda: ramstream.OffloadModel([nn.Linear(2, 2)], device="cpu", pin_layers=[5]),
     ValueError, r"pin_layers must be chunk indices in \[0, 1\)", False),
    # OffloadAdamW
    ("OffloadAdamW params=[]", lambda: ramstream.OffloadAdamW([], device="cpu"),
     ValueError, r"OffloadAdamW: params is empty", True),
    ("OffloadAdamW seed=-1", lambda: ramstream.OffloadAdamW(make_model(0).parameters(), device="cpu", seed=-1),
     ValueError, r"seed=-1; accepted: an integer >= 0", False),
    ("OffloadAdamW.clip_grad_norm_ nan", lambda: _opt()[0].clip_grad_norm_(NAN),
     ValueError, r"max_norm", False),
    ("load_state_dict 1", lambda: _opt()[0].load_state_dict(1),
     ValueError, r"dict with 'state' and 'param_groups'", False),
    ("load_state_dict param_groups=1", lambda: _opt()[0].load_state_dict({"state": {}, "param_groups": 1}),
     ValueError, r"state_dict\['param_groups'\] must be a list of dicts", True),
    ("load_state_dict state=[]", _load_sd(lambda sd: sd.__setitem__("state", [])),
     ValueError, r"state_dict\['state'\] must be a dict", True),
    ("load_state_dict step=-1", _load_sd(_state0(step=torch.tensor(-1.0))),
     ValueError, r"state_dict\['state'\]\[0\]\['step'\] must be an integer >= 0", True),
    ("load_state_dict step='a'", _load_sd(_state0(step="a")),
     ValueError, r"\['step'\] must be an integer >= 0", True),
    ("load_state_dict step=1.5", _load_sd(_state0(step=1.5)),
     ValueError, r"\['step'\] must be an integer >= 0", True),
    ("load_state_dict exp_avg_sq < 0", _load_sd(_state0(exp_avg_sq=-torch.ones(64, 32))),
     ValueError, r"\['exp_avg_sq'\] has negative values", True),
    ("load_state_dict lr=nan", _load_sd(lambda sd: sd["param_groups"][0].__setitem__("lr", NAN)),
     ValueError, r"param_groups\[0\]\['lr'\] must be a finite float >= 0", True),
    ("load_state_dict betas=(2, 0.9)", _load_sd(lambda sd: sd["param_groups"][0].__setitem__("betas", (2.0, 0.9))),
     ValueError, r"param_groups\[0\]\['betas'\]\[0\] must be a finite float in \[0, 1\)", True),
    ("load_state_dict exp_avg shape", _load_sd(_state0(exp_avg=torch.zeros(3))),
     ValueError, r"'exp_avg' of parameter 0 has 3 elements", False),
    # wrap / plan_for / the planner
    ("wrap blocks=[foreign]", lambda: ramstream.wrap(make_model(0), device="cpu", blocks=FOREIGN, param_offload=True),
     ValueError, r"wrap\(\): blocks \[0, 1\] are not submodules of the model", True),
    ("wrap loss='Dense'", lambda: ramstream.wrap(make_model(0), device="cpu", loss="Dense"),
     ValueError, r"loss='Dense' is not accepted; accepted: None \(dense\), 'dense', 'chunked'", False),
    ("wrap lr=tensor", lambda: ramstream.wrap(make_model(0), device="cpu", lr=torch.tensor(0.1)),
     ValueError, r"lr=tensor\(0.1000\) is not accepted; accepted: a finite number >= 0", False),
    ("plan_for device='tpu'", lambda: ramstream.plan_for(make_model(0), device="tpu"),
     ValueError, r"plan_for\(\): device='tpu' is not accepted; accepted: None, 'cpu'", True),
    ("plan_for blocks=1", lambda: ramstream.plan_for(make_model(0), device="cpu", blocks=1),
     ValueError, r"plan_for\(\): blocks must be a non-empty list of nn.Module", True),
    ("plan_for blocks=[foreign]", lambda: ramstream.plan_for(make_model(0), device="cpu", blocks=FOREIGN),
     ValueError, r"plan_for\(\): blocks \[0, 1\] are not submodules", True),
    ("plan_for optimizer=1", lambda: ramstream.plan_for(make_model(0), 1, device="cpu"),
     TypeError, r"plan_for\(\): optimizer must be None or a torch optimizer", True),
    ("plan_for no parameters", lambda: ramstream.plan_for(nn.Module()),
     ValueError, r"find_blocks: no repeated layer stack", True),
    ("plan_for batch=0", lambda: ramstream.plan_for(make_model(0), device="cpu", batch=0),
     ValueError, r"batch=0 is not accepted", False),
    ("ModelShape.from_model blocks=1", lambda: ModelShape.from_model(make_model(0), 1, batch=1, seq=8),
     ValueError, r"ModelShape.from_model: blocks must be a non-empty list of nn.Module", True),
    ("ModelShape.from_model blocks=[foreign]", lambda: ModelShape.from_model(make_model(0), FOREIGN, batch=1, seq=8),
     ValueError, r"ModelShape.from_model: blocks \[0, 1\] are not submodules", True),
    ("plan_training vram_free=nan", lambda: _plan(vram_free=NAN),
     ValueError, r"profile.vram_free=nan is not accepted; accepted: a finite number of bytes >= 0", True),
    ("plan_training vram_total=-1", lambda: _plan(vram_total=-1),
     ValueError, r"profile.vram_total=-1 is not accepted", True),
    ("plan_training local_world_size=0", lambda: _plan(local_world_size=0),
     ValueError, r"profile.local_world_size=0 is not accepted; accepted: an int >= 1", True),
    ("plan_training matmul_tflops=-1", lambda: _plan(matmul_tflops=-1.0),
     ValueError, r"profile.matmul_tflops=-1.0 is not accepted", True),
    ("plan_training h2d_gbps=nan", lambda: _plan(h2d_gbps=NAN),
     ValueError, r"profile.h2d_gbps=nan is not accepted", False),
    # quantize_model
    ("quantize_model twice, another format", _quantize_twice,
     ValueError, r"already quantized as nf4 \(block_size 64\).*dequantize_model", True),
    ("quantize_model blocks=[foreign]", lambda: ramstream.quantize_model(_frozen(), blocks=FOREIGN),
     ValueError, r"quantize_model\(\): blocks \[0, 1\] are not submodules", True),
    ("quantize_model quantize='NF4'", lambda: ramstream.quantize_model(_frozen(), "NF4"),
     ValueError, r"quantize='NF4' is not accepted; accepted: 'int8', 'nf4'", False),
    # losses
    ("chunked_cross_entropy targets=99", lambda: ramstream.chunked_cross_entropy(H, W, torch.full((4,), 99)),
     ValueError, r"targets must be class indices in \[0, 16\).*e\.g\. 99", True),
    ("chunked_cross_entropy targets=-5", lambda: ramstream.chunked_cross_entropy(H, W, torch.full((4,), -5)),
     ValueError, r"targets must be class indices in \[0, 16\) .* or ignore_index=-100", True),
    ("causal_lm_loss labels=99", lambda: ramstream.causal_lm_loss(H, W, torch.full((4,), 99)),
     ValueError, r"causal_lm_loss: labels must be class indices in \[0, 16\)", True),
    ("causal_lm_loss labels float", lambda: ramstream.causal_lm_loss(H, W, T.float()),
     TypeError, r"causal_lm_loss: labels must be an integer tensor", True),
    ("chunked_cross_entropy chunk_size=0", lambda: ramstream.chunked_cross_entropy(H, W, T, chunk_size=0),
     ValueError, r"chunk_size must be an int >= 1", False),
    # pinned memory
    ("pinned_empty own_pages='no'", lambda: ramstream.pinned_empty(4, own_pages="no"),
     TypeError, r"own_pages must be True or False", True),
    ("pinned_empty own_pages=1", lambda: ramstream.pinned_empty(4, own_pages=1),
     TypeError, r"own_pages must be True or False", True),
    ("set_pin_budget None", lambda: ramstream.set_pin_budget(None),
     TypeError, r"bytes_or_fraction must be an int \(bytes\), a float fraction", True),
    ("set_pin_budget nan", lambda: ramstream.set_pin_budget(NAN),
     ValueError, r"fraction of physical RAM in \[0, 1\]", False),
]  # fmt: skip


@pytest.mark.parametrize(
    "call, exc, pattern", [pytest.param(c, e, p, id=i + (" (fixed)" if f else "")) for i, c, e, p, f in CASES]
)
def test_bad_input_raises_naming_the_argument(call, exc, pattern):
    with pytest.raises(exc, match=pattern):
        call()


def test_a_refused_state_dict_changes_nothing():
    opt, model = _opt()
    model(torch.randint(0, 64, (2, 4)), torch.randint(0, 64, (2, 4))).backward()
    opt.step()
    opt.synchronize()
    before = opt.state_dict()
    bad = opt.state_dict()
    bad["state"][0] = {**bad["state"][0], "exp_avg": torch.ones(64, 32)}
    bad["state"][1] = {**bad["state"][1], "step": "a"}  # the second entry is bad: the first must not load
    with pytest.raises(ValueError, match=r"\['step'\] must be an integer"):
        opt.load_state_dict(bad)
    after = opt.state_dict()
    assert torch.equal(after["state"][0]["exp_avg"], before["state"][0]["exp_avg"])


def test_valid_inputs_still_work():
    """The checks refuse only what they name: the values next to each bad one still work."""
    om = _om()
    x = torch.randn(2, 8)
    om.step(x, torch.randn(2, 8))
    om.step(x, grad_outputs=torch.randn(2, 8))
    om.step(x, grad_outputs=lambda out: torch.ones_like(out))
    om.step(x, torch.randn(2, 3), loss_fn=lambda out, t: out.sum() * 0 + t.sum())  # any shape with a loss_fn
    om.close()
    opt, model = _opt()
    sd = opt.state_dict()
    sd["state"][0] = {"step": 3, "exp_avg": torch.zeros(64, 32), "exp_avg_sq": torch.zeros(64, 32)}
    opt.load_state_dict(sd)  # an int step, as some tools save it
    m = make_model(0)
    ramstream.plan_for(m, device="cpu", blocks=m.blocks)  # a ModuleList of the model's own
    ModelShape.from_model(m, list(m.blocks), batch=1, seq=8)
    frozen = _frozen()
    assert ramstream.quantize_model(frozen, "nf4")["tensors"] > 0
    assert ramstream.quantize_model(frozen, "nf4")["tensors"] == 0  # the same format again: nothing to do
    labels = torch.tensor([1, -100, 3, 4])
    assert torch.isfinite(ramstream.causal_lm_loss(H, W, labels))
    ramstream.pinned_empty(4, own_pages=True)


# ---- the Hugging Face entry points (need transformers) ------------------------------------------


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory):
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(
        vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=2,
    )  # fmt: skip
    folder = tmp_path_factory.mktemp("tiny_llama")
    transformers.LlamaForCausalLM(cfg).save_pretrained(folder)
    return str(folder)


@pytest.mark.parametrize(
    "kw, exc, pattern",
    [
        (
            {"trust_remote_code": "yes"},
            ValueError,
            r"trust_remote_code='yes' is not accepted; accepted: True, False",
        ),
        ({"num_hidden_layer": 1}, ValueError, r"num_hidden_layer is not an attribute of LlamaConfig"),
        ({"quantize": "NF4"}, ValueError, r"quantize='NF4' is not accepted"),
        (
            {"ram_fraction": NAN},
            ValueError,
            r"ram_fraction=nan is not accepted; accepted: a number in \(0, 1\]",
        ),
        ({"dtype": "bf16"}, ValueError, r"dtype='bf16' is not accepted"),
    ],
    ids=["trust_remote_code (fixed)", "config typo (fixed)", "quantize", "ram_fraction", "dtype"],
)
def test_load_model_arguments(tiny_folder, kw, exc, pattern):
    from ramstream.integrations.hf_load import load_model

    with pytest.raises(exc, match=pattern):
        load_model(tiny_folder, random_weights=True, **kw)


def test_load_model_config_override_still_applies(tiny_folder):
    from ramstream.integrations.hf_load import load_model

    model = load_model(tiny_folder, quantize="none", random_weights=True, num_hidden_layers=1)
    assert model.config.num_hidden_layers == 1


def test_trainstream_trainer_names_its_argument():
    pytest.importorskip("transformers")
    from ramstream.integrations.huggingface import TrainStreamTrainer

    with pytest.raises(
        TypeError, match=r"TrainStreamTrainer: trainstream= must be a dict of wrap\(\) options"
    ):
        TrainStreamTrainer(trainstream=1)
