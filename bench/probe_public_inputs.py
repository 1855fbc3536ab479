"""Probe of ramstream's public functions with bad inputs (issue 25): each case's outcome classed as
clear (the expected type, the argument named), unclear (raw or unnamed error), silent (no error) or
hang (past a timeout). Run: python bench/probe_public_inputs.py [filter]."""

from __future__ import annotations

import re
import signal
import sys
import warnings

import torch
import torch.nn as nn

sys.path.insert(0, "tests")
import ramstream  # noqa: E402
from ramstream import functional as F  # noqa: E402

from _models import make_model  # noqa: E402

NAN, INF = float("nan"), float("inf")


def chunks():
    return [nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 8)) for _ in range(3)]


def om(**kw):
    return ramstream.OffloadModel(chunks(), device="cpu", **kw)


def oa(**kw):
    m = make_model(0)
    return ramstream.OffloadAdamW(m.parameters(), device="cpu", **kw), m


def wrapped():
    m = make_model(0)
    return ramstream.wrap(m, torch.optim.AdamW(m.parameters()), device="cpu")


H, W, T = torch.randn(4, 8), torch.randn(16, 8), torch.randint(0, 16, (4,))


CASES = []


def case(name, arg):
    def deco(fn):
        CASES.append((name, arg, fn))
        return fn

    return deco


def add(name, arg, fn):
    CASES.append((name, arg, fn))


# ---- OffloadModel constructor
for kw, arg in [
    ({"window": 0}, "window"), ({"window": True}, "window"), ({"window": 2.0}, "window"), ({"window": -1}, "window"),
    ({"pin": -1}, "pin"), ({"pin": True}, "pin"), ({"pin": 1.5}, "pin"), ({"pin": 99}, "pin"),
    ({"pin_layers": [5]}, "pin_layers"), ({"pin_layers": [True]}, "pin_layers"), ({"pin_layers": 1}, "pin_layers"),
    ({"pin_layers": [-1]}, "pin_layers"), ({"pin_layers": [0, 0]}, "pin_layers"),
    ({"keep_activations": "yes"}, "keep_activations"), ({"keep_activations": 1}, "keep_activations"),
    ({"activation_offload": "yes"}, "activation_offload"), ({"activation_offload": 1}, "activation_offload"),
    ({"device": "cuda:x"}, "device"), ({"device": 3.0}, "device"), ({"device": "tpu"}, "device"),
]:  # fmt: skip
    add(f"OffloadModel({kw})", arg, lambda kw=kw: om(**kw))
add("OffloadModel([])", "chunks", lambda: ramstream.OffloadModel([], device="cpu"))
add("OffloadModel(Linear)", "chunks", lambda: ramstream.OffloadModel(nn.Linear(2, 2), device="cpu"))
add("OffloadModel([1,2])", "chunks", lambda: ramstream.OffloadModel([1, 2], device="cpu"))
add("OffloadModel(None)", "chunks", lambda: ramstream.OffloadModel(None, device="cpu"))

# ---- OffloadModel methods
add("OM.step(loss_fn=1)", "loss_fn", lambda: om().step(torch.randn(2, 8), torch.randn(2, 8), loss_fn=1))
add("OM.step(grad_outputs=1)", "grad_outputs", lambda: om().step(torch.randn(2, 8), grad_outputs=1))
add(
    "OM.step(grad_outputs=shape)",
    "grad_outputs",
    lambda: om().step(torch.randn(2, 8), grad_outputs=torch.randn(3)),
)
add("OM.step(targets shape)", "targets", lambda: om().step(torch.randn(2, 8), torch.randn(3, 5)))
add("OM.step(targets broadcast)", "targets", lambda: om().step(torch.randn(2, 8), torch.randn(8)))
add(
    "OM.step(grad_outputs=list)",
    "grad_outputs",
    lambda: om().step(torch.randn(2, 8), grad_outputs=[torch.randn(2, 8)]),
)
add(
    "OM.step(profile_path=1)",
    "path",
    lambda: om().step(torch.randn(2, 8), torch.randn(2, 8), profile_path=1),
)
add(
    "OM.step(profile_path=missing dir)",
    "path .*/nonexistent/dir",
    lambda: om().step(torch.randn(2, 8), torch.randn(2, 8), profile_path="/nonexistent/dir/x.json"),
)
add("OM.step() no targets no grad_outputs", "targets", lambda: om().step(torch.randn(2, 8)))
add("OM.set_pinned([9])", "indices", lambda: om().set_pinned([9]))
add("OM.set_pinned([True])", "indices", lambda: om().set_pinned([True]))
add("OM.set_pinned([-1])", "indices", lambda: om().set_pinned([-1]))
for kw, arg in [
    ({"lr": -1}, "lr"), ({"lr": NAN}, "lr"), ({"lr": "1"}, "lr"), ({"betas": (1.0, 0.9)}, "betas"),
    ({"betas": 0.9}, "betas"), ({"eps": 0}, "eps"), ({"weight_decay": -1}, "weight_decay"),
    ({"moment_dtype": "fp16"}, "moment_dtype"), ({"accumulation_steps": 0}, "accumulation_steps"),
    ({"max_grad_norm": NAN}, "max_grad_norm"), ({"eager_updates": 1}, "eager_updates"),
    ({"threads": 0}, "threads"), ({"bucket_bytes": 10}, "bucket_bytes"), ({"params": 5}, "params"),
    ({"params": [torch.zeros(2, requires_grad=True)]}, "param group"), ({"bucket_bytes": True}, "bucket_bytes"),
    ({"lr": torch.tensor(NAN)}, "lr"),
]:  # fmt: skip
    add(f"OM.optimizer({kw})", arg, lambda kw=kw: om().optimizer(**kw))

# ---- OffloadAdamW methods
add("OA(params=[])", "params", lambda: ramstream.OffloadAdamW([], device="cpu"))
add(
    "OA(params=tensor)",
    "params",
    lambda: ramstream.OffloadAdamW(torch.zeros(2, requires_grad=True), device="cpu"),
)
add("OA(params=[1])", "params", lambda: ramstream.OffloadAdamW([1], device="cpu"))
add("OA(lr=tensor nan)", "lr", lambda: oa(lr=torch.tensor(NAN)))
add("OA(betas=(0.9,))", "betas", lambda: oa(betas=(0.9,)))
add("OA(betas='a')", "betas", lambda: oa(betas="ab"))
add("OA(seed=-1)", "seed", lambda: oa(seed=-1))
add("OA(seed=1.5)", "seed", lambda: oa(seed=1.5))
add("OA(seed=True)", "seed", lambda: oa(seed=True))
add("OA(mode='CPU')", "mode", lambda: oa(mode="CPU"))
add("OA(offload='yes')", "offload", lambda: oa(offload="yes"))
add("OA(distributed=1)", "distributed", lambda: oa(distributed=1))
add("OA(guard_params=1)", "guard_params", lambda: oa(guard_params=1))
add("OA(eager_updates=1)", "eager_updates", lambda: oa(eager_updates=1))
add("OA(vram_headroom=nan)", "vram_headroom", lambda: oa(vram_headroom=NAN))
add("OA(max_inflight_bytes=1)", "max_inflight_bytes", lambda: oa(max_inflight_bytes=1))
add("OA.clip_grad_norm_(max_norm=-1)", "max_norm", lambda: oa()[0].clip_grad_norm_(-1.0))
add("OA.clip_grad_norm_(max_norm=nan)", "max_norm", lambda: oa()[0].clip_grad_norm_(NAN))
add("OA.clip_grad_norm_(max_norm='a')", "max_norm", lambda: oa()[0].clip_grad_norm_("a"))
add("OA.clip_grad_norm_(norm_type=1)", "norm_type", lambda: oa()[0].clip_grad_norm_(1.0, norm_type=1))
add("OA.attach(1)", "model", lambda: oa()[0].attach(1))
add("OA.attach(other model)", "model", lambda: oa()[0].attach(make_model(1)))
add("OA.load_state_dict(1)", "state_dict", lambda: oa()[0].load_state_dict(1))
add("OA.load_state_dict({})", "state_dict", lambda: oa()[0].load_state_dict({}))
add("OA.load_state_dict(no groups)", "state_dict", lambda: oa()[0].load_state_dict({"state": {}}))
add(
    "OA.load_state_dict(groups=1)",
    "param_groups",
    lambda: oa()[0].load_state_dict({"state": {}, "param_groups": 1}),
)


def _sd_mut(fn):
    def run():
        opt, m = oa()
        sd = opt.state_dict()
        fn(sd)
        opt.load_state_dict(sd)

    return run


add(
    "OA.load_state_dict(wrong group count)",
    "param groups",
    _sd_mut(lambda sd: sd["param_groups"].append(dict(sd["param_groups"][0]))),
)
add(
    "OA.load_state_dict(params count)",
    "parameters",
    _sd_mut(lambda sd: sd["param_groups"][0].__setitem__("params", sd["param_groups"][0]["params"][:-1])),
)
add("OA.load_state_dict(state=list)", "state", _sd_mut(lambda sd: sd.__setitem__("state", [])))
add(
    "OA.load_state_dict(exp_avg shape)",
    "exp_avg",
    _sd_mut(
        lambda sd: sd["state"].__setitem__(
            0, {"step": torch.tensor(1.0), "exp_avg": torch.zeros(3), "exp_avg_sq": torch.zeros(3)}
        )
    ),
)
add(
    "OA.load_state_dict(exp_avg str)",
    "exp_avg",
    _sd_mut(
        lambda sd: sd["state"].__setitem__(0, {"step": torch.tensor(1.0), "exp_avg": "x", "exp_avg_sq": "y"})
    ),
)
add(
    "OA.load_state_dict(missing exp_avg_sq)",
    "exp_avg_sq",
    _sd_mut(
        lambda sd: sd["state"].__setitem__(0, {"step": torch.tensor(1.0), "exp_avg": torch.zeros(64, 32)})
    ),
)
add(
    "OA.load_state_dict(step=-1)",
    "step",
    _sd_mut(
        lambda sd: sd["state"].__setitem__(
            0, {"step": torch.tensor(-1.0), "exp_avg": torch.zeros(64, 32), "exp_avg_sq": torch.zeros(64, 32)}
        )
    ),
)
add(
    "OA.load_state_dict(step='a')",
    "step",
    _sd_mut(
        lambda sd: sd["state"].__setitem__(
            0, {"step": "a", "exp_avg": torch.zeros(64, 32), "exp_avg_sq": torch.zeros(64, 32)}
        )
    ),
)
add(
    "OA.load_state_dict(exp_avg_sq negative)",
    "exp_avg_sq",
    _sd_mut(
        lambda sd: sd["state"].__setitem__(
            0, {"step": torch.tensor(1.0), "exp_avg": torch.zeros(64, 32), "exp_avg_sq": -torch.ones(64, 32)}
        )
    ),
)
add("OA.load_state_dict(lr=nan)", "lr", _sd_mut(lambda sd: sd["param_groups"][0].__setitem__("lr", NAN)))
add(
    "OA.load_state_dict(betas=bad)",
    "betas",
    _sd_mut(lambda sd: sd["param_groups"][0].__setitem__("betas", (2.0, 0.9))),
)
add(
    "OA.load_state_dict(master shape)",
    "master",
    _sd_mut(
        lambda sd: sd["state"].__setitem__(
            0,
            {
                "step": torch.tensor(1.0),
                "exp_avg": torch.zeros(64, 32),
                "exp_avg_sq": torch.zeros(64, 32),
                "master": torch.zeros(3),
            },
        )
    ),
)
add(
    "OA.load_state_dict(state key 999)",
    "state",
    _sd_mut(
        lambda sd: sd["state"].__setitem__(
            999, {"step": torch.tensor(1.0), "exp_avg": torch.zeros(3), "exp_avg_sq": torch.zeros(3)}
        )
    ),
)


def _group_set(key, value):
    def run():
        opt, m = oa()
        opt.param_groups[0][key] = value
        m(torch.randint(0, 64, (2, 4)), torch.randint(0, 64, (2, 4))).backward()
        opt.step()

    return run


for k, v in [
    ("lr", NAN),
    ("lr", -1.0),
    ("betas", (1.5, 0.9)),
    ("eps", 0.0),
    ("weight_decay", NAN),
    ("lr", "a"),
]:
    add(f"OA param_groups[0][{k}]={v!r} then step", k, _group_set(k, v))

# ---- wrap / unwrap / memory_report / plan_for
add("wrap(model=1)", "model", lambda: ramstream.wrap(1))
add("wrap(optimizer=1)", "optimizer", lambda: ramstream.wrap(make_model(0), 1, device="cpu"))
add(
    "wrap(optimizer=SGD)",
    "optimizer",
    lambda: ramstream.wrap((m := make_model(0)), torch.optim.SGD(m.parameters(), lr=0.1), device="cpu"),
)
add(
    "wrap(optimizer=list)",
    "optimizer",
    lambda: ramstream.wrap((m := make_model(0)), list(m.parameters()), device="cpu"),
)
add(
    "wrap(optimizer AdamW amsgrad)",
    "amsgrad",
    lambda: ramstream.wrap(
        (m := make_model(0)), torch.optim.AdamW(m.parameters(), amsgrad=True), device="cpu"
    ),
)
add(
    "wrap(optimizer AdamW maximize)",
    "maximize",
    lambda: ramstream.wrap(
        (m := make_model(0)), torch.optim.AdamW(m.parameters(), maximize=True), device="cpu"
    ),
)
add("wrap(lr=tensor)", "lr", lambda: ramstream.wrap(make_model(0), device="cpu", lr=torch.tensor(0.1)))
add(
    "wrap(vram_headroom=tensor)",
    "vram_headroom",
    lambda: ramstream.wrap(make_model(0), device="cpu", vram_headroom=torch.tensor(0.1)),
)
add("wrap(loss='Dense')", "loss", lambda: ramstream.wrap(make_model(0), device="cpu", loss="Dense"))
add("wrap(loss=[])", "loss", lambda: ramstream.wrap(make_model(0), device="cpu", loss=[]))
add(
    "wrap(blocks=[Linear])",
    "blocks",
    lambda: ramstream.wrap(make_model(0), device="cpu", blocks=[nn.Linear(2, 2)], param_offload=True),
)
add(
    "wrap(param_offload=[9])",
    "param_offload",
    lambda: ramstream.wrap(make_model(0), device="cpu", param_offload=[9]),
)
add(
    "wrap(activation_checkpointing=[9])",
    "activation_checkpointing",
    lambda: ramstream.wrap(make_model(0), device="cpu", activation_checkpointing=[9]),
)
add(
    "wrap(param_offload=[-1])",
    "param_offload",
    lambda: ramstream.wrap(make_model(0), device="cpu", param_offload=[-1]),
)
add(
    "wrap(activation_offload=nan)",
    "activation_offload",
    lambda: ramstream.wrap(make_model(0), device="cpu", activation_offload=NAN),
)
add(
    "wrap(optimizer_mode='CPU')",
    "optimizer_mode",
    lambda: ramstream.wrap(make_model(0), device="cpu", optimizer_mode="CPU"),
)
add("unwrap(1)", "model", lambda: ramstream.unwrap(1))
add("unwrap(plain)", "model", lambda: ramstream.unwrap(make_model(0)))
add("memory_report(1)", "model", lambda: ramstream.memory_report(1))
add("memory_report(plain)", "model", lambda: ramstream.memory_report(make_model(0)))
add(
    "plan_for(blocks=[foreign])",
    "blocks",
    lambda: ramstream.plan_for(make_model(0), device="cpu", blocks=[nn.Linear(2, 2), nn.Linear(2, 2)]),
)
add(
    "ModelShape.from_model(blocks=[foreign])",
    "blocks",
    lambda: ramstream.ModelShape.from_model(make_model(0), [nn.Linear(2, 2)], batch=1, seq=8),
)
add("plan_for(no params, no device)", "parameters", lambda: ramstream.plan_for(nn.Module()))
add("plan_for(1)", "model", lambda: ramstream.plan_for(1))
add("plan_for(batch=0)", "batch", lambda: ramstream.plan_for(make_model(0), batch=0, device="cpu"))
add("plan_for(batch=True)", "batch", lambda: ramstream.plan_for(make_model(0), batch=True, device="cpu"))
add("plan_for(seq=-1)", "seq", lambda: ramstream.plan_for(make_model(0), seq=-1, device="cpu"))
add("plan_for(seq=2.5)", "seq", lambda: ramstream.plan_for(make_model(0), seq=2.5, device="cpu"))
add("plan_for(loss='x')", "loss", lambda: ramstream.plan_for(make_model(0), loss="x", device="cpu"))
add("plan_for(device='tpu')", "device", lambda: ramstream.plan_for(make_model(0), device="tpu"))
add("plan_for(profile=1)", "profile", lambda: ramstream.plan_for(make_model(0), device="cpu", profile=1))
add("plan_for(blocks=1)", "blocks", lambda: ramstream.plan_for(make_model(0), device="cpu", blocks=1))
add("plan_for(blocks=[])", "blocks", lambda: ramstream.plan_for(make_model(0), device="cpu", blocks=[]))
add("plan_for(foo=1)", "foo", lambda: ramstream.plan_for(make_model(0), device="cpu", foo=1))
add("plan_for(threads=2)", "threads", lambda: ramstream.plan_for(make_model(0), device="cpu", threads=2))
add(
    "plan_for(vram_headroom=nan)",
    "vram_headroom",
    lambda: ramstream.plan_for(make_model(0), device="cpu", vram_headroom=NAN),
)
add(
    "plan_for(moment_dtype='fp16')",
    "moment_dtype",
    lambda: ramstream.plan_for(make_model(0), device="cpu", moment_dtype="fp16"),
)
add("plan_for(optimizer=1)", "optimizer", lambda: ramstream.plan_for(make_model(0), 1, device="cpu"))
add(
    "plan_for(param_offload=[9])",
    "param_offload",
    lambda: ramstream.plan_for(make_model(0), device="cpu", param_offload=[9]),
)
add("plan_for(no params)", "parameters", lambda: ramstream.plan_for(nn.Module(), device="cpu"))

# ---- planner
add("plan_training(shape=1)", "shape", lambda: ramstream.plan_training(1, ramstream.HardwareProfile()))
add(
    "plan_training(profile=1)",
    "profile",
    lambda: ramstream.plan_training(ramstream.ModelShape.gpt("125m", batch=1, seq=8), 1),
)
add(
    "plan_training(param_offload='x')",
    "param_offload",
    lambda: ramstream.plan_training(
        ramstream.ModelShape.gpt("125m", batch=1, seq=8),
        ramstream.HardwareProfile(vram_total=2**34, vram_free=2**34, ram_total=2**36, ram_available=2**36),
        param_offload="x",
    ),
)
add(
    "plan_training(vram_headroom=nan)",
    "vram_headroom",
    lambda: ramstream.plan_training(
        ramstream.ModelShape.gpt("125m", batch=1, seq=8),
        ramstream.HardwareProfile(vram_total=2**34, vram_free=2**34, ram_total=2**36, ram_available=2**36),
        vram_headroom=NAN,
    ),
)
add(
    "plan_training(quantize='x')",
    "quantize",
    lambda: ramstream.plan_training(
        ramstream.ModelShape.gpt("125m", batch=1, seq=8),
        ramstream.HardwareProfile(vram_total=2**34, vram_free=2**34, ram_total=2**36, ram_available=2**36),
        quantize="x",
    ),
)
add(
    "plan_training(optimizer_mode='x')",
    "optimizer_mode",
    lambda: ramstream.plan_training(
        ramstream.ModelShape.gpt("125m", batch=1, seq=8),
        ramstream.HardwareProfile(vram_total=2**34, vram_free=2**34, ram_total=2**36, ram_available=2**36),
        optimizer_mode="x",
    ),
)
add(
    "plan_training(moment_dtype='x')",
    "moment_dtype",
    lambda: ramstream.plan_training(
        ramstream.ModelShape.gpt("125m", batch=1, seq=8),
        ramstream.HardwareProfile(vram_total=2**34, vram_free=2**34, ram_total=2**36, ram_available=2**36),
        moment_dtype="x",
    ),
)
add(
    "plan_training(max_activation_slowdown=-1)",
    "max_activation_slowdown",
    lambda: ramstream.plan_training(
        ramstream.ModelShape.gpt("125m", batch=1, seq=8),
        ramstream.HardwareProfile(vram_total=2**34, vram_free=2**34, ram_total=2**36, ram_available=2**36),
        max_activation_slowdown=-1,
    ),
)
RATES = dict(h2d_gbps=50, d2h_gbps=50, duplex_gbps=40, adamw_gbps=80, matmul_tflops=500)
add(
    "plan_training(profile vram_free=nan)",
    "vram_free",
    lambda: ramstream.plan_training(
        ramstream.ModelShape.gpt("125m", batch=1, seq=8),
        ramstream.HardwareProfile(
            vram_total=2**34, vram_free=NAN, ram_total=2**36, ram_available=2**36, **RATES
        ),
    ),
)
add(
    "plan_training(profile local_world_size=0)",
    "local_world_size",
    lambda: ramstream.plan_training(
        ramstream.ModelShape.gpt("125m", batch=1, seq=8),
        ramstream.HardwareProfile(
            vram_total=2**34,
            vram_free=2**34,
            ram_total=2**36,
            ram_available=2**36,
            local_world_size=0,
            **RATES,
        ),
    ),
)
add(
    "plan_training(profile matmul_tflops=-1)",
    "matmul_tflops",
    lambda: ramstream.plan_training(
        ramstream.ModelShape.gpt("125m", batch=1, seq=8),
        ramstream.HardwareProfile(
            vram_total=2**34,
            vram_free=2**34,
            ram_total=2**36,
            ram_available=2**36,
            **{**RATES, "matmul_tflops": -1},
        ),
    ),
)
add(
    "plan_training(profile vram_total=-1 with rates)",
    "vram_total",
    lambda: ramstream.plan_training(
        ramstream.ModelShape.gpt("125m", batch=1, seq=8),
        ramstream.HardwareProfile(
            vram_total=-1, vram_free=2**34, ram_total=2**36, ram_available=2**36, **RATES
        ),
    ),
)
add(
    "plan_training(profile vram_total=-1)",
    "vram_total",
    lambda: ramstream.plan_training(
        ramstream.ModelShape.gpt("125m", batch=1, seq=8),
        ramstream.HardwareProfile(vram_total=-1, vram_free=2**34, ram_total=2**36, ram_available=2**36),
    ),
)
add(
    "plan_training(profile zero)",
    "RAM: needs",
    lambda: ramstream.plan_training(
        ramstream.ModelShape.gpt("125m", batch=1, seq=8), ramstream.HardwareProfile()
    ),
)
add("ModelShape.gpt('7x')", "size", lambda: ramstream.ModelShape.gpt("7x", batch=1, seq=8))
add("ModelShape.gpt(batch=0)", "batch", lambda: ramstream.ModelShape.gpt("125m", batch=0, seq=8))
add("ModelShape.gpt(seq=-1)", "seq", lambda: ramstream.ModelShape.gpt("125m", batch=1, seq=-1))
add(
    "ModelShape.gpt(dtype='fp8')",
    "dtype",
    lambda: ramstream.ModelShape.gpt("125m", batch=1, seq=8, dtype="fp8"),
)
add("ModelShape.from_hf_config(1)", "config", lambda: ramstream.ModelShape.from_hf_config(1, batch=1, seq=8))
add(
    "ModelShape.from_hf_config({})", "config", lambda: ramstream.ModelShape.from_hf_config({}, batch=1, seq=8)
)
add(
    "ModelShape.from_model(blocks=1)",
    "blocks",
    lambda: ramstream.ModelShape.from_model(make_model(0), 1, batch=1, seq=8),
)
add(
    "ModelShape.from_model(batch=0)",
    "batch",
    lambda: ramstream.ModelShape.from_model((m := make_model(0)), list(m.blocks), batch=0, seq=8),
)
add("HardwareProfile.from_dict(1)", "d", lambda: ramstream.HardwareProfile.from_dict(1))
add("HardwareProfile.from_dict({'x':1})", "x", lambda: ramstream.HardwareProfile.from_dict({"x": 1}))
add("profile_hardware(device='tpu')", "device", lambda: ramstream.profile_hardware(device="tpu"))
add("profile_hardware(device=1.5)", "device", lambda: ramstream.profile_hardware(device=1.5))
add("profile_hardware(quick='yes')", "quick", lambda: ramstream.profile_hardware(device="cpu", quick="yes"))
add("profile_hardware(force=1)", "force", lambda: ramstream.profile_hardware(device="cpu", force=1))

# ---- quantize_model / dequantize_model
add("quantize_model(1)", "model", lambda: ramstream.quantize_model(1))
add(
    "quantize_model(quantize='NF4')",
    "quantize",
    lambda: ramstream.quantize_model(make_model(0).requires_grad_(False), "NF4"),
)
add(
    "quantize_model(quantize=None)",
    "quantize",
    lambda: ramstream.quantize_model(make_model(0).requires_grad_(False), None),
)
add(
    "quantize_model(quantize='none')",
    "quantize",
    lambda: ramstream.quantize_model(make_model(0).requires_grad_(False), "none"),
)
add(
    "quantize_model(quantize='auto')",
    "quantize",
    lambda: ramstream.quantize_model(make_model(0).requires_grad_(False), "auto"),
)
add(
    "quantize_model(block_size=3)",
    "block_size",
    lambda: ramstream.quantize_model(make_model(0).requires_grad_(False), block_size=3),
)
add(
    "quantize_model(block_size=64.0)",
    "block_size",
    lambda: ramstream.quantize_model(make_model(0).requires_grad_(False), block_size=64.0),
)
add(
    "quantize_model(blocks=1)",
    "blocks",
    lambda: ramstream.quantize_model(make_model(0).requires_grad_(False), blocks=1),
)
add(
    "quantize_model(blocks=[])",
    "blocks",
    lambda: ramstream.quantize_model(make_model(0).requires_grad_(False), blocks=[]),
)
add(
    "quantize_model(blocks=[1])",
    "blocks",
    lambda: ramstream.quantize_model(make_model(0).requires_grad_(False), blocks=[1]),
)
add(
    "quantize_model(blocks=[foreign])",
    "blocks",
    lambda: ramstream.quantize_model(
        make_model(0).requires_grad_(False), blocks=[nn.Sequential(nn.Linear(64, 64))]
    ),
)
add(
    "quantize_model(pin_budget=-1)",
    "pin_budget",
    lambda: ramstream.quantize_model(make_model(0).requires_grad_(False), pin_budget=-1),
)
add(
    "quantize_model(pin_budget='x')",
    "pin_budget",
    lambda: ramstream.quantize_model(make_model(0).requires_grad_(False), pin_budget="x"),
)
add(
    "quantize_model(pin_budget=nan)",
    "pin_budget",
    lambda: ramstream.quantize_model(make_model(0).requires_grad_(False), pin_budget=NAN),
)
add(
    "quantize_model(twice)",
    "quantize",
    lambda: [
        ramstream.quantize_model(m := make_model(0).requires_grad_(False)),
        ramstream.quantize_model(m, "int8"),
    ],
)
add("dequantize_model(1)", "model", lambda: ramstream.dequantize_model(1))

# ---- find_blocks, offload_checkpoint
add("find_blocks(1)", "model", lambda: __import__("ramstream.blocks").blocks.find_blocks(1))
add(
    "find_blocks(Linear)",
    "blocks",
    lambda: __import__("ramstream.blocks").blocks.find_blocks(nn.Linear(2, 2)),
)
add("offload_checkpoint(1)", "module", lambda: ramstream.offload_checkpoint(1, torch.randn(2)))

# ---- losses
for fn_name in ("chunked_cross_entropy", "causal_lm_loss"):
    fn = getattr(ramstream, fn_name)
    for kw, arg in [
        ({"chunk_size": 0}, "chunk_size"), ({"chunk_size": True}, "chunk_size"), ({"chunk_size": 2.0}, "chunk_size"),
        ({"reduction": "MEAN"}, "reduction"), ({"reduction": None}, "reduction"), ({"ignore_index": 1.5}, "ignore_index"),
        ({"ignore_index": True}, "ignore_index"), ({"num_items": 0}, "num_items"), ({"num_items": -1}, "num_items"),
        ({"num_items": NAN}, "num_items"), ({"num_items": "x"}, "num_items"), ({"num_items": torch.tensor([1, 2])}, "num_items"),
        ({"num_items": True}, "num_items"),
    ]:  # fmt: skip
        add(f"{fn_name}({kw})", arg, lambda fn=fn, kw=kw: fn(H, W, T, **kw))
    add(f"{fn_name}(hidden=list)", "hidden", lambda fn=fn: fn([1.0], W, T))
    add(f"{fn_name}(weight shape)", "weight", lambda fn=fn: fn(H, torch.randn(16, 7), T))
    add(f"{fn_name}(weight 1d)", "weight", lambda fn=fn: fn(H, torch.randn(16), T))
    add(f"{fn_name}(targets float)", "targets|labels", lambda fn=fn: fn(H, W, T.float()))
    add(f"{fn_name}(targets shape)", "targets|labels", lambda fn=fn: fn(H, W, torch.randint(0, 16, (5,))))
    add(f"{fn_name}(targets out of range)", "targets|labels", lambda fn=fn: fn(H, W, torch.full((4,), 99)))
    add(f"{fn_name}(targets negative)", "targets|labels", lambda fn=fn: fn(H, W, torch.full((4,), -5)))
    add(f"{fn_name}(bias shape)", "bias", lambda fn=fn: fn(H, W, T, torch.randn(3)))
    add(f"{fn_name}(bias list)", "bias", lambda fn=fn: fn(H, W, T, [1.0]))
    add(f"{fn_name}(hidden int)", "hidden", lambda fn=fn: fn(H.long(), W, T))

# ---- memory ops
add("pinned_empty(-1)", "shape", lambda: ramstream.pinned_empty(-1))
add("pinned_empty('a')", "shape", lambda: ramstream.pinned_empty("a"))
add("pinned_empty(2.5)", "shape", lambda: ramstream.pinned_empty(2.5))
add("pinned_empty(True)", "shape", lambda: ramstream.pinned_empty(True))
add("pinned_empty(dtype=str)", "dtype", lambda: ramstream.pinned_empty(4, "float32"))
add("pinned_empty(own_pages=1)", "own_pages", lambda: ramstream.pinned_empty(4, own_pages=1))
add("pinned_empty(own_pages='no')", "own_pages", lambda: ramstream.pinned_empty(4, own_pages="no"))
add("pinned_empty(2**62)", "shape", lambda: ramstream.pinned_empty(2**62))
add("set_pin_budget(-1)", "bytes", lambda: ramstream.set_pin_budget(-1))
add("set_pin_budget(nan)", "fraction", lambda: ramstream.set_pin_budget(NAN))
add("set_pin_budget(1.5)", "fraction", lambda: ramstream.set_pin_budget(1.5))
add("set_pin_budget(-0.5)", "fraction", lambda: ramstream.set_pin_budget(-0.5))
add("set_pin_budget('abc')", "bytes_or_fraction", lambda: ramstream.set_pin_budget("abc"))
add("set_pin_budget(None)", "bytes_or_fraction must", lambda: ramstream.set_pin_budget(None))
add("set_pin_budget(tensor)", "bytes_or_fraction must", lambda: ramstream.set_pin_budget(torch.tensor(5)))
add("register_host_memory(1)", "t", lambda: ramstream.register_host_memory(1))
add("register_host_memory(empty)", "t", lambda: ramstream.register_host_memory(torch.empty(0)))

# ---- functional
Z = lambda *s, d=torch.float32: torch.zeros(*s, dtype=d)  # noqa: E731
add("adamw_(lr=nan)", "lr", lambda: F.adamw_(Z(4), Z(4), Z(4), Z(4), step=1, lr=NAN))
add("adamw_(step=0)", "step", lambda: F.adamw_(Z(4), Z(4), Z(4), Z(4), step=0, lr=1e-3))
add("adamw_(step=1.0)", "step", lambda: F.adamw_(Z(4), Z(4), Z(4), Z(4), step=1.0, lr=1e-3))
add("adamw_(grad shape)", "grad", lambda: F.adamw_(Z(4), Z(5), Z(4), Z(4), step=1, lr=1e-3))
add("adamw_(out shape)", "out", lambda: F.adamw_(Z(4), Z(4), Z(4), Z(4), step=1, lr=1e-3, out=Z(3)))
add(
    "adamw_(param bf16)", "param", lambda: F.adamw_(Z(4, d=torch.bfloat16), Z(4), Z(4), Z(4), step=1, lr=1e-3)
)
add("sq_norm(list)", "tensor", lambda: F.sq_norm([1.0]))
add("sq_norm(int tensor)", "tensor", lambda: F.sq_norm(torch.ones(4, dtype=torch.int32)))
add("accumulate_(shape)", "src", lambda: F.accumulate_(Z(4), Z(5)))
add("accumulate_(dst bf16)", "dst", lambda: F.accumulate_(Z(4, d=torch.bfloat16), Z(4)))
add("accumulate_(dst int)", "dst", lambda: F.accumulate_(Z(4, d=torch.int32), Z(4)))
add("quantize_nf4(block_size=3)", "block_size", lambda: F.quantize_nf4(Z(64), 3))
add("quantize_nf4(list)", "x", lambda: F.quantize_nf4([1.0]))
add("quantize_nf4(int)", "x", lambda: F.quantize_nf4(Z(64, d=torch.int32)))
add("dequantize_nf4(shape mismatch)", "shape", lambda: F.dequantize_nf4(*F.quantize_nf4(Z(64)), (65,)))
add("dequantize_nf4(shape=-1)", "shape", lambda: F.dequantize_nf4(*F.quantize_nf4(Z(64)), (-64,)))
add("dequantize_nf4(shape='a')", "shape", lambda: F.dequantize_nf4(*F.quantize_nf4(Z(64)), "ab"))
add(
    "dequantize_nf4(dtype=int)", "dtype", lambda: F.dequantize_nf4(*F.quantize_nf4(Z(64)), (64,), torch.int32)
)
add("dequantize_nf4(dtype=str)", "dtype", lambda: F.dequantize_nf4(*F.quantize_nf4(Z(64)), (64,), "bfloat16"))
add(
    "dequantize_int8(block mismatch)",
    "block_size",
    lambda: F.dequantize_int8(*F.quantize_int8(Z(64)), (64,), block_size=32),
)
add("quantize_int8(block_size=True)", "block_size", lambda: F.quantize_int8(Z(64), True))

# ---- OffloadTrainer
try:
    from ramstream.integrations import huggingface as hf
    from ramstream.integrations.hf_load import load_model

    def _tr(**kw):
        import tempfile

        from transformers import TrainingArguments

        tiny = _tiny_llama()
        args = TrainingArguments(tempfile.mkdtemp(), report_to=[], use_cpu=True, max_steps=1)
        return hf.OffloadTrainer(
            model=tiny,
            args=args,
            train_dataset=[
                {"input_ids": torch.ones(4, dtype=torch.long), "labels": torch.ones(4, dtype=torch.long)}
            ],
            **kw,
        )

    def _tiny_llama():
        from transformers import LlamaConfig, LlamaForCausalLM

        cfg = LlamaConfig(
            vocab_size=32,
            hidden_size=16,
            intermediate_size=32,
            num_hidden_layers=2,
            num_attention_heads=2,
            num_key_value_heads=2,
        )
        return LlamaForCausalLM(cfg)

    for kw, arg in [
        ({"ramstream": 1}, "ramstream"), ({"ramstream": {"foo": 1}}, "foo"), ({"ramstream": {"chunked_loss": 1}}, "chunked_loss"),
        ({"ramstream": {"loss_chunk_size": 0}}, "loss_chunk_size"), ({"ramstream": {"loss_chunk_size": "a"}}, "loss_chunk_size"),
        ({"ramstream": {"atomic_checkpoints": "no"}}, "atomic_checkpoints"), ({"ramstream": {"lr": NAN}}, "lr"),
        ({"ramstream": {"threads": 0}}, "threads"),
    ]:  # fmt: skip
        add(f"OffloadTrainer({kw})", arg, lambda kw=kw: _tr(**kw))
    add(
        "TrainStreamTrainer(trainstream=1)",
        "trainstream",
        lambda: hf.TrainStreamTrainer(trainstream=1, model=_tiny_llama()),
    )
    add(
        "TrainStreamTrainer(both)",
        "trainstream",
        lambda: hf.TrainStreamTrainer(trainstream={}, ramstream={}, model=_tiny_llama()),
    )
    add(
        "wrap_hf(loss_chunk_size=0)",
        "loss_chunk_size",
        lambda: hf.wrap_hf(_tiny_llama(), device="cpu", loss_chunk_size=0),
    )
    add("wrap_hf(1)", "model", lambda: hf.wrap_hf(1))
    add("find_decoder_layers(1)", "model", lambda: hf.find_decoder_layers(1))
    add("find_decoder_layers(Linear)", "layers", lambda: hf.find_decoder_layers(nn.Linear(2, 2)))
    import tempfile

    def _folder():
        d = tempfile.mkdtemp()
        _tiny_llama().save_pretrained(d)
        return d

    FOLDER = None

    def _lm(**kw):
        global FOLDER
        FOLDER = FOLDER or _folder()
        return load_model(FOLDER, **kw)

    for kw, arg in [
        ({"quantize": "NF4"}, "quantize"), ({"quantize": 1}, "quantize"), ({"dtype": "bf16"}, "dtype"),
        ({"dtype": torch.int8}, "dtype"), ({"dtype": 1}, "dtype"), ({"quant_block_size": 3}, "quant_block_size"),
        ({"ram_fraction": 0}, "ram_fraction"), ({"ram_fraction": 1.5}, "ram_fraction"), ({"ram_fraction": NAN}, "ram_fraction"),
        ({"ram_fraction": "a"}, "ram_fraction"), ({"ram_fraction": True}, "ram_fraction"), ({"random_weights": "no"}, "random_weights"),
        ({"random_weights": 1}, "random_weights"), ({"trust_remote_code": "yes"}, "trust_remote_code"),
        ({"disable_mmap": 1}, "disable_mmap"),
        ({"not_a_config_key": 3}, "not_a_config_key"), ({"quant_block_size": 64.0}, "quant_block_size"),
    ]:  # fmt: skip
        add(f"load_model({kw})", arg, lambda kw=kw: _lm(**kw))
    add("load_model(name=1)", "name_or_path", lambda: load_model(1))
    add("load_model(name=None)", "name_or_path", lambda: load_model(None))
except ImportError as e:
    print("no transformers:", e)


class Timeout(Exception):
    pass


def _alarm(*_):
    raise Timeout()


def run(filter_=""):
    signal.signal(signal.SIGALRM, _alarm)
    counts = {}
    for name, arg, fn in CASES:
        if filter_ and filter_ not in name:
            continue
        signal.alarm(30)
        with warnings.catch_warnings(record=True) as w:
            warnings.simplefilter("always")
            try:
                fn()
                outcome, msg = "silent", "; ".join(str(x.message)[:100] for x in w)
            except Timeout:
                outcome, msg = "hang", ""
            except (ValueError, TypeError, MemoryError, OSError) as e:
                text = str(e)
                named = re.search(arg, text) is not None
                outcome = "clear" if named else "unclear"
                msg = f"{type(e).__name__}: {text[:300]}"
            except Exception as e:  # noqa: BLE001
                outcome, msg = "unclear", f"{type(e).__name__}: {str(e)[:300]}"
            finally:
                signal.alarm(0)
        counts[outcome] = counts.get(outcome, 0) + 1
        print(f"[{outcome:7s}] {name}: {msg}")
    print(counts)


if __name__ == "__main__":
    run(sys.argv[1] if len(sys.argv) > 1 else "")
