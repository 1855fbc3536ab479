"""Input probe cases: wrap/unwrap/memory_report/plan_for and the planner."""

# ruff: noqa: F403, F405
from __future__ import annotations

from _probe_inputs_common import *

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
