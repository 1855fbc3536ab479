"""Input probe cases: OffloadModel and OffloadAdamW (constructors, methods, state dicts)."""

# ruff: noqa: F403, F405
from __future__ import annotations

from _probe_inputs_common import *

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
# OM.step(x) with no targets and no grad_outputs is RamTorch's output.sum() loss since issue 26: not bad input
add("OM.step(targets=list)", "targets", lambda: om().step(torch.randn(2, 8), targets=[1, 2]))
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
