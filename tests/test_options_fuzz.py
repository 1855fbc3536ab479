"""Hypothesis fuzz of ramstream.wrap() options and OffloadAdamW arguments: any value either works
(and a training step then runs) or raises ValueError/TypeError naming the argument."""

from __future__ import annotations

import faulthandler
import math

import pytest
import torch

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, assume, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

import ramstream  # noqa: E402
from ramstream._native import lib  # noqa: E402
from ramstream.options import WrapOptions, parse_device  # noqa: E402

SETTINGS = settings(
    max_examples=60,
    deadline=20000,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
HANG_S = 120  # one example taking this long is a hang: dump every thread's stack and exit

# Values of every kind, for every argument: wrong types, huge and special numbers, strings.
WEIRD = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(10**30), max_value=10**30),
    st.sampled_from([0, 1, -1, 2, 3, 4096, 4097, 1 << 20, (1 << 20) - 1, 2**31, 2**63, 2**64]),
    st.floats(allow_nan=True, allow_infinity=True),
    st.sampled_from([math.nan, math.inf, -math.inf, 0.0, -0.0, 1e-320, 1e308, 0.5, 0.999999]),
    st.text(max_size=8),
    st.sampled_from(["auto", "cpu", "gpu", "cuda", "meta", "float32", "bf16", "fp16", "True", ""]),
    st.sampled_from(
        [
            torch.float32,
            torch.bfloat16,
            torch.float16,
            torch.device("cpu"),
            b"cpu",
            1 + 2j,
            [],
            [1, 2],
            (0.9, 0.999),
            (0.9,),
            (0.9, 0.99, 0.9),
            {},
            {"a": 1},
            object(),
            torch.tensor(1.0),
            torch.tensor([0.5, 0.5]),
            torch.tensor(3),
            float("nan"),
            ...,
        ]
    ),
)

# Values wrap() should accept, so that the fuzz also reaches the training step with them.
VALID = {
    "optimizer_mode": st.sampled_from(["cpu", "auto"]),
    "offload": st.sampled_from(["auto", True]),
    "device": st.sampled_from([None, "cpu", torch.device("cpu")]),
    "distributed": st.sampled_from([None, False]),
    "guard_params": st.booleans(),
    "max_grad_norm": st.one_of(st.none(), st.floats(1e-6, 1e6), st.just(float("inf"))),
    "accumulation_steps": st.integers(1, 3),
    "moment_dtype": st.sampled_from(
        ["auto", "float32", "fp32", "bfloat16", "bf16", torch.float32, torch.bfloat16]
    ),
    "threads": st.one_of(st.none(), st.integers(1, 3)),
    "lr": st.floats(0, 1),
    "verbose": st.booleans(),
    "bucket_bytes": st.integers(4096, 1 << 40),
    "vram_headroom": st.floats(0, 0.99),
    "max_inflight_bytes": st.one_of(st.none(), st.integers(1 << 20, 1 << 40)),
    "eager_updates": st.booleans(),
    "skip_nonfinite": st.booleans(),
    "delayed_update": st.one_of(st.booleans(), st.integers(0, 3)),
    "nvme_dir": st.none(),
    "nvme_offload": st.one_of(st.just("auto"), st.just(False)),
    "nvme_weights": st.one_of(st.just("auto"), st.just(False), st.just(0), st.just([])),
    "activation_offload": st.one_of(st.booleans(), st.just("auto"), st.floats(0, 1)),
    "prefetch_depth": st.integers(1, 8),
    "min_offload_bytes": st.integers(0, 1 << 30),
    "max_activation_slowdown": st.floats(0, 10),
    "blocks": st.just(None),
    "param_offload": st.one_of(
        st.booleans(), st.just("auto"), st.floats(0, 1), st.lists(st.integers(0, 1), max_size=2)
    ),
    "weight_window": st.integers(1, 4),
    "activation_checkpointing": st.one_of(
        st.booleans(), st.just("auto"), st.floats(0, 1), st.lists(st.integers(0, 1), max_size=2)
    ),
    "check_memory": st.booleans(),
    "profile": st.booleans(),
    "quantize": st.sampled_from(["auto", "none", None, False, "int8", "nf4"]),
    "quant_block_size": st.sampled_from([2, 64, 128]),
    "prefer": st.sampled_from(["exact", "speed"]),
    "watchdog": st.booleans(),
    "plan": st.just(None),
    "batch": st.one_of(st.none(), st.integers(1, 64)),
    "seq": st.one_of(st.none(), st.integers(1, 8192)),
    "loss": st.sampled_from([None, "dense", "chunked"]),
}


def test_every_option_has_a_valid_strategy():
    assert sorted(VALID) == WrapOptions.names()


class Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = torch.nn.ModuleList(torch.nn.Linear(8, 8) for _ in range(2))
        self.head = torch.nn.Linear(8, 1)

    def forward(self, x):
        for b in self.blocks:
            x = x + torch.tanh(b(x))
        return self.head(x).square().mean()


@pytest.fixture(autouse=True)
def _guard():
    """A hang fails the run with every thread's stack; a fuzzed `threads` is undone."""
    threads = lib().num_threads()
    faulthandler.dump_traceback_later(HANG_S, exit=True)
    yield
    faulthandler.cancel_dump_traceback_later()
    if lib().num_threads() != threads:
        lib().set_num_threads(threads)


def _train_step(model, opt) -> None:
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(0))
    for _ in range(2):
        loss = model(x)
        loss.backward()
        opt.step()
        opt.zero_grad()
    opt.synchronize()
    assert all(
        torch.isfinite(p).all() or not math.isfinite(opt.param_groups[0]["lr"]) for p in model.parameters()
    )


def _expect_clean(fn, names) -> bool:
    """Runs fn; True if it succeeded, False on a ValueError/TypeError that names one of `names`
    (or, on a machine without a GPU, the RuntimeError for a CUDA device); any other exception
    fails the test."""
    try:
        fn()
    except (ValueError, TypeError) as e:
        msg = str(e)
        assert any(n in msg for n in names), f"error names none of {names}: {msg}"
        return False
    except RuntimeError as e:
        if torch.cuda.is_available() or "torch sees no CUDA GPU" not in str(e):
            raise
        assert "device" in names
        return False
    return True


def _skip_real_cuda(kwargs) -> None:
    """This fuzz trains on the CPU: on a GPU machine a device value that names a usable CUDA
    device is left to the CUDA tests (the CPU batch would not match it)."""
    if "device" not in kwargs or not torch.cuda.is_available():
        return
    try:
        dev = parse_device(kwargs["device"])
    except (ValueError, TypeError, RuntimeError):
        return
    assume(dev is None or dev.type != "cuda")


def _option_values():
    names = st.sampled_from(WrapOptions.names())
    return st.dictionaries(names, st.just(None), min_size=1, max_size=3).flatmap(
        lambda d: st.fixed_dictionaries({k: st.one_of(VALID[k], WEIRD) for k in d})
    )


@SETTINGS
@given(options=_option_values())
def test_wrap_options_fuzz(options):
    _skip_real_cuda(options)
    torch.manual_seed(0)
    model = Net()
    state = {}

    def run():
        m, opt = ramstream.wrap(model, torch.optim.AdamW(model.parameters(), lr=1e-3), **options)
        state["opt"] = opt
        _train_step(m, opt)

    try:
        ok = _expect_clean(run, list(options))
    finally:
        wrapped = getattr(model, "_ramstream", None) is not None
        if wrapped:
            ramstream.unwrap(model)
    if ok:
        # an accepted value is one the option table accepts too
        WrapOptions.parse(**options)
    else:
        assert not wrapped or "opt" in state  # a refused wrap() leaves the model as it was


def test_wrap_unknown_option_names_it():
    model = Net()
    with pytest.raises(ValueError, match="bucket_byte"):
        ramstream.wrap(model, bucket_byte=1 << 20)


OPT_VALID = {
    "lr": st.floats(0, 1),
    "betas": st.tuples(st.floats(0, 0.999), st.floats(0, 0.999)),
    "eps": st.floats(1e-12, 1),
    "weight_decay": st.floats(0, 1),
    "mode": st.sampled_from(["cpu", "auto"]),
    "max_grad_norm": st.one_of(st.none(), st.floats(1e-6, 1e6), st.just(float("inf"))),
    "accumulation_steps": st.integers(1, 3),
    "moment_dtype": st.sampled_from(["float32", "bf16", torch.bfloat16]),
    "threads": st.one_of(st.none(), st.integers(1, 3)),
    "device": st.sampled_from([None, "cpu"]),
    "offload": st.sampled_from([True, "auto"]),
    "vram_headroom": st.floats(0, 0.99),
    "guard_params": st.booleans(),
    "bucket_bytes": st.integers(4096, 1 << 40),
    "max_inflight_bytes": st.one_of(st.none(), st.integers(1 << 20, 1 << 40)),
    "distributed": st.just(False),
    "seed": st.integers(0, 2**64 - 1),
    "eager_updates": st.booleans(),
}
GROUP_KEYS = ("lr", "betas", "eps", "weight_decay")


def _adamw_values():
    names = st.sampled_from(sorted(OPT_VALID))
    return st.dictionaries(names, st.just(None), min_size=1, max_size=3).flatmap(
        lambda d: st.fixed_dictionaries({k: st.one_of(OPT_VALID[k], WEIRD) for k in d})
    )


@SETTINGS
@given(kwargs=_adamw_values(), in_group=st.booleans())
def test_offload_adamw_arguments_fuzz(kwargs, in_group):
    """Arguments to the constructor, or (lr, betas, eps, weight_decay) set in a param group."""
    _skip_real_cuda(kwargs)
    torch.manual_seed(0)
    model = Net()
    group_kw = {k: v for k, v in kwargs.items() if in_group and k in GROUP_KEYS}
    ctor_kw = {k: v for k, v in kwargs.items() if k not in group_kw}
    holder = {}

    def run():
        opt = ramstream.OffloadAdamW([{"params": list(model.parameters()), **group_kw}], **ctor_kw)
        holder["opt"] = opt
        _train_step(model, opt)

    try:
        _expect_clean(run, list(kwargs))
    finally:
        if "opt" in holder:
            holder["opt"].close()


# Found by the fuzz above (each raised something else, or was accepted, before the fix).
@pytest.mark.parametrize(
    "options, name",
    [
        (dict(threads=2**40), "threads"),  # TypeError from the binding, no option named
        (dict(threads=10**6), "threads"),  # would start a million host threads
        (dict(device=10**30), "device"),  # OverflowError-like ValueError from torch
        (dict(device=-1), "device"),
        (dict(distributed=1), "distributed"),  # 1 == True slipped through
        (dict(distributed=0.0), "distributed"),
    ],
)
def test_wrap_regressions(options, name):
    with pytest.raises(ValueError, match=name):
        ramstream.wrap(Net(), **options)


@pytest.mark.parametrize(
    "kwargs, group, name",
    [
        (dict(distributed=1), {}, "distributed"),  # RuntimeError from the engine
        (dict(distributed=True), {}, "distributed"),
        (dict(device=10**30), {}, "device"),
        (dict(eps=True), {}, "eps"),  # a bool was taken as 1.0
        (dict(weight_decay=False), {}, "weight_decay"),
        (dict(threads=10**6), {}, "threads"),
        ({}, dict(lr="0.1"), r"param_groups\[0\]\['lr'\]"),  # group values were never checked
        ({}, dict(betas=(0.9, 1.5)), r"param_groups\[0\]\['betas'\]\[1\]"),
        ({}, dict(eps=math.nan), r"param_groups\[0\]\['eps'\]"),
        ({}, dict(weight_decay=-1.0), r"param_groups\[0\]\['weight_decay'\]"),
    ],
)
def test_offload_adamw_regressions(kwargs, group, name):
    params = list(Net().parameters())
    with pytest.raises(ValueError, match=name):
        ramstream.OffloadAdamW([{"params": params, **group}], **kwargs)


def test_offload_adamw_tensor_hyper_parameters_still_accepted():
    params = list(Net().parameters())
    opt = ramstream.OffloadAdamW(
        [{"params": params, "lr": torch.tensor(3e-3), "betas": (torch.tensor(0.9), 0.99)}]
    )
    opt.close()
