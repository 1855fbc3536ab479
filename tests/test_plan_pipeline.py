"""The pipeline split decided in the planner (planner/pipeline_split.py): the split PipelineModel
applies is the planner's for the same numbers; balanced by time against brute force; per-device
memory respected, MemoryError with the arithmetic; a streamed stage's window and pinned chunks
against hand arithmetic and as Pipeline applies them; `ramstream plan --stages N` against the
planner's value and the schedule simulator; bad flags."""

from __future__ import annotations

import copy
import json
import random

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from ramstream import Pipeline, PipelineModel
from ramstream.cli import main
from ramstream.planner.pipeline_split import choose_streaming, split_pipeline
from ramstream.planner.shape import ModelShape
from ramstream.simulate.pipeline import simulate_schedule
from test_pipeline_balance import brute  # the brute-force reference over every contiguous split

GiB = 2**30
VOCAB, D = 40, 8


class Block(nn.Module):
    """A pre-norm MLP block with a residual (a GPT block without attention)."""

    def __init__(self) -> None:
        super().__init__()
        self.norm, self.fc, self.proj = nn.LayerNorm(D), nn.Linear(D, 4 * D), nn.Linear(4 * D, D)

    def forward(self, x):
        return x + self.proj(F.gelu(self.fc(self.norm(x))))


def gpt_like(layers=5, frozen=()):
    """Embedding, `layers` blocks, a final norm + head: a small GPT as an nn.Sequential."""
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Embedding(VOCAB, D),
        *[Block() for _ in range(layers)],
        nn.Sequential(nn.LayerNorm(D), nn.Linear(D, VOCAB)),
    )
    for i in frozen:
        model[i].requires_grad_(False)
    return model


def hand_detail(model):
    """(parameters, gradients, AdamW state) bytes per child, by hand: fp32, 4 + 4 + 8 per trained element."""
    out = []
    for m in model:
        n = sum(p.numel() for p in m.parameters())
        t = sum(p.numel() for p in m.parameters() if p.requires_grad)
        out.append((4 * n, 4 * t, 8 * t))
    return out


def cost(split, loads, dw):
    return max(sum(loads[s.start : s.stop]) / dw[s.index] for s in split.stages)


# ---- the split PipelineModel applies is the planner's ------------------------------------------------


@pytest.mark.parametrize("balance", ["params", "children", "time"])
@pytest.mark.parametrize("stages", [2, 3])
def test_pipeline_model_applies_the_planners_split(balance, stages):
    model = gpt_like(frozen=(2,))
    times = [0.5, 3.0, 1.0, 4.0, 2.0, 1.0, 6.0] if balance == "time" else None
    detail = hand_detail(model)
    budgets = [sum(map(sum, detail[:3])) + 1, None, None][:stages]
    dw = [1.0, 2.0, 1.5][:stages]
    want = split_pipeline(
        stages,
        params=[sum(p.numel() for p in m.parameters()) for m in model],
        detail=detail,
        times=times,
        balance=balance,
        budgets=budgets,
        device_weights=dw,
    )
    with PipelineModel(
        model,
        devices=["cpu"] * stages,
        balance=balance,
        piece_times=times,
        device_memory=budgets,
        device_weights=dw,
    ) as pm:
        assert pm.plan == want
        assert pm.counts == want.counts
        assert [
            sum(1 for _ in (m.parts if hasattr(m, "parts") else [m])) for m in pm.pipeline.modules
        ] == want.counts
    assert want.stages[0].resident_bytes <= budgets[0]
    assert want.stages[0].param_bytes == sum(d[0] for d in detail[: want.counts[0]])


def test_time_split_is_the_brute_force_optimum_with_weights_and_budgets():
    rng = random.Random(1)
    for _ in range(200):
        k = rng.randint(2, 7)
        n = rng.randint(1, min(k, 4))
        times = [rng.choice([0.0, 0.1, rng.uniform(0, 3)]) for _ in range(k)]
        detail = [(rng.randint(0, 50), rng.randint(0, 50), rng.randint(0, 100)) for _ in range(k)]
        sizes = [sum(d) for d in detail]
        caps = [rng.choice([None, 100, 250, 600]) for _ in range(n)]
        dw = [rng.choice([1.0, 2.0, 0.5]) for _ in range(n)]
        real = [float("inf") if c is None else c for c in caps]
        want = brute(times, n, dw, sizes, real)
        kw = dict(params=[1] * k, detail=detail, times=times, balance="time", budgets=caps, device_weights=dw)
        if want is None:
            with pytest.raises(MemoryError, match=r"parameters .* \+ gradients .* \+ optimizer"):
                split_pipeline(n, **kw)
            continue
        split = split_pipeline(n, **kw)
        assert cost(split, times, dw) == pytest.approx(want, rel=1e-12, abs=0)
        for s in split.stages:
            assert s.resident_bytes == sum(sizes[s.start : s.stop]) <= real[s.index]
            assert s.time == pytest.approx(sum(times[s.start : s.stop]))
        assert split.boundaries == [s.start for s in split.stages[1:]]
        assert sum(split.shares()) == pytest.approx(1.0)


def test_memory_that_cannot_hold_the_stages_resident_streams_them_or_says_why():
    detail = [(100, 100, 200)] * 4  # 400 resident, 200 a window slot
    kw = dict(params=[1] * 4, detail=detail, budgets=[700, 700])
    with pytest.raises(MemoryError) as e:
        split_pipeline(2, **kw)
    assert "0.000 GiB of 0.000 GiB (too big)" in str(e.value) and "stage 0 (pieces 0-1)" in str(e.value)
    split = split_pipeline(2, offload="auto", **kw)
    assert split.streamed and split.counts == [2, 2]
    for s in split.stages:  # pin 1 (400) + window min(2, 1) x 200 = 600 <= 700
        assert (s.streaming.window, s.streaming.pin, s.streaming.device_bytes) == (2, 1, 600)
        assert s.device_bytes == 600
    with pytest.raises(MemoryError, match=r"even streamed.*piece 0 needs"):
        split_pipeline(2, offload=True, **dict(kw, budgets=[199, 700]))
    with pytest.raises(ValueError, match="offload must be False, True or 'auto'"):
        split_pipeline(2, offload="yes", **kw)


# ---- a streamed stage's window and pinned chunks ------------------------------------------------------


def test_window_and_pin_against_hand_arithmetic():
    even = [(100, 100, 400)] * 4  # resident 600, slot 200
    # budget 1000, window 2: pin 4 = 2400; 3 ({0,1,2}) = 1800 + 1 x 200; 2 ({0,2}) = 1200 + 400;
    # 1 ({0}) = 600 + 2 x 200 = 1000: fits
    c = choose_streaming(even, 1000)
    assert (c.window, c.pin, c.pinned, c.slot_bytes, c.pinned_bytes, c.device_bytes) == (
        2,
        1,
        (0,),
        200,
        600,
        1000,
    )
    assert c.chosen == ("window", "pin")
    assert (choose_streaming(even, 999).pin, choose_streaming(even, 999).device_bytes) == (0, 400)
    # 399: window 2 never fits (400 at least); window 1, pin 0: 200
    c = choose_streaming(even, 399)
    assert (c.window, c.pin, c.device_bytes) == (1, 0, 200)
    c = choose_streaming(even, 10**9)  # everything resident: 4 x 600
    assert (c.pin, c.pinned, c.device_bytes, c.slot_bytes) == (4, (0, 1, 2, 3), 2400, 0)
    assert choose_streaming(even, None) == choose_streaming(even, None, window="auto", pin="auto")
    assert (choose_streaming(even, None).window, choose_streaming(even, None).pin) == (2, 0)
    # given values win: window 3 -> pin 1 needs 600 + 3 x 200 = 1200 > 1000, so pin 0 (600)
    c = choose_streaming(even, 1000, window=3)
    assert (c.window, c.pin, c.device_bytes, c.chosen) == (3, 0, 600, ("pin",))
    c = choose_streaming(even, 1600, pin=2)
    assert (c.window, c.pin, c.device_bytes, c.chosen) == (2, 2, 1600, ("window",))
    # the slot is the largest streamed chunk: pinning the big one shrinks it
    mixed = [(500, 500, 1000), (10, 10, 20), (10, 10, 20), (10, 10, 20)]
    c = choose_streaming(mixed, 2100)  # pin 3 = {0, 1, 2}: 2000 + 2 x 40 + 1 x 20 = 2100
    assert (c.pinned, c.slot_bytes, c.device_bytes) == ((0, 1, 2), 20, 2100)
    c = choose_streaming(mixed, 2099)  # pin 2 = {0, 2}: 2000 + 40 + 2 x 20 = 2080
    assert (c.pinned, c.slot_bytes, c.device_bytes) == ((0, 2), 20, 2080)
    c = choose_streaming(mixed, 2079)  # pin 1 = {0}: 2000 + 2 x 20 = 2040
    assert (c.pinned, c.slot_bytes, c.device_bytes) == ((0,), 20, 2040)
    c = choose_streaming(mixed, 2039)  # pin 0: 2 x 1000 = 2000
    assert (c.pin, c.slot_bytes, c.device_bytes) == (0, 1000, 2000)


def test_a_window_that_cannot_fit_raises_memory_error_with_the_arithmetic():
    with pytest.raises(MemoryError) as e:
        choose_streaming([(100, 100, 400)] * 4, 199, stage=3)
    msg = str(e.value)
    assert "streamed stage 3" in msg and "window 1 x 0.000 GiB" in msg and "> 0.000 GiB" in msg
    with pytest.raises(MemoryError, match=r"window 3 x"):
        choose_streaming([(100, 100, 400)] * 4, 500, window=3, pin=0)
    with pytest.raises(ValueError, match=r"offload_pin must be an int in \[0, 4\] or 'auto'"):
        choose_streaming([(1, 1, 1)] * 4, None, pin=5)
    with pytest.raises(ValueError, match=r"offload_window must be an int >= 1 or 'auto'"):
        choose_streaming([(1, 1, 1)] * 4, None, window=0)


def _chunks(k=6):
    torch.manual_seed(0)
    return [nn.Sequential(nn.Linear(12, 12), nn.Tanh()) for _ in range(k)]


def test_pipeline_applies_the_planners_window_and_pin_and_trains_as_the_unsplit_model():
    chunks = _chunks()
    ref = nn.Sequential(*copy.deepcopy(chunks))
    each = (12 * 12 + 12) * 4  # parameters (= gradients) per chunk; AdamW state twice that
    # four pinned chunks need 16 x each; three pinned ones and the last in a window slot 14 x each
    budget = [16 * each - 1, None]
    with Pipeline(stage_modules=[chunks[:4], nn.Sequential(*chunks[4:])], devices=["cpu"] * 2,
                  device_memory=budget) as pipe:  # fmt: skip
        [plan] = pipe.offload_plan
        assert plan == choose_streaming([(each, each, 2 * each)] * 4, budget[0])
        assert (plan.window, plan.pin, plan.pinned) == (2, 3, (0, 1, 2))
        stage = pipe.modules[0]
        assert stage.pinned == [0, 1, 2] and stage.streamer.ahead == 1
        x, y = torch.randn(8, 12), torch.randn(8, 12)
        opt, opt_ref = (
            torch.optim.AdamW(pipe.parameters(), lr=1e-2),
            torch.optim.AdamW(ref.parameters(), lr=1e-2),
        )
        for _ in range(2):
            pipe.step(x, targets=y, loss_fn=F.mse_loss, n_microbatches=2)
            for xm, ym in zip(x.tensor_split(2), y.tensor_split(2)):
                (F.mse_loss(ref(xm), ym) / 2).backward()
            opt.step(), opt_ref.step(), opt.zero_grad(), opt_ref.zero_grad()
        for p, q in zip([p for c in chunks for p in c.parameters()], ref.parameters()):
            assert torch.equal(p, q)
    # given ints win over the budget's choice; no budget: window 2, nothing pinned (the old defaults)
    with Pipeline(stage_modules=[_chunks(4), _chunks(2)], devices=["cpu"] * 2, device_memory=budget,
                  offload_window=1, offload_pin=0) as pipe:  # fmt: skip
        assert [(c.window, c.pin, c.chosen) for c in pipe.offload_plan] == [(1, 0, ()), (1, 0, ())]
    with Pipeline(stage_modules=[_chunks(4), _chunks(2)], devices=["cpu"] * 2) as pipe:
        assert [(c.window, c.pin) for c in pipe.offload_plan] == [(2, 0), (2, 0)]
    with pytest.raises(MemoryError, match="streamed stage 1 does not fit"):
        Pipeline(stage_modules=[_chunks(2), _chunks(2)], devices=["cpu"] * 2, device_memory=[None, each])
    with pytest.raises(ValueError, match="device_memory has 1 entries for 2 stages"):
        Pipeline(stage_modules=[_chunks(2), _chunks(2)], devices=["cpu"] * 2, device_memory=[None])
    with pytest.raises(ValueError, match="offload_pin must be an int >= 0 or 'auto'"):
        Pipeline(stage_modules=[_chunks(2), _chunks(2)], devices=["cpu"] * 2, offload_pin="all")


# ---- ramstream plan --stages N -------------------------------------------------------------------------


def _plan(capsys, *argv):
    code = main(["plan", *argv])
    out = capsys.readouterr()
    return code, out.out, out.err


def _reference(stages, budgets, balance="params", offload="auto", batch=1):
    from ramstream.planner.cli_pipeline import piece_numbers
    from ramstream.planner.rules import DEFAULT_RATES

    shape = ModelShape.gpt("125m", batch=batch, seq=1024, dtype="bfloat16", loss="dense")
    nums = piece_numbers(shape, DEFAULT_RATES["matmul_tflops"])
    assert len(nums["names"]) == 14 and nums["names"][0] == "embedding" and nums["names"][-1] == "head"
    times = [f + b for f, b in zip(nums["fwd"], nums["bwd"])]
    split = split_pipeline(stages, params=nums["params"], detail=nums["detail"], times=times, balance=balance,
                           budgets=budgets, offload=offload)  # fmt: skip
    tf = [sum(nums["fwd"][s.start : s.stop]) / 4 for s in split.stages]
    tb = [sum(nums["bwd"][s.start : s.stop]) / 4 for s in split.stages]
    return split, simulate_schedule("1f1b", stages=stages, microbatches=4, tf=tf, tb=tb)


@pytest.mark.parametrize("stages", [2, 4])
def test_cli_prints_the_planners_split_and_the_simulated_bubble(capsys, stages):
    code, out, err = _plan(capsys, "--gpt", "125m", "--stages", str(stages), "--vram-gb", "24", "--json")
    assert code == 0, err
    got = json.loads(out)["pipeline"]
    split, pred = _reference(stages, [24 * GiB] * stages)
    assert got["counts"] == split.counts and not got["streamed"]
    assert got["stage_pieces"][0][0] == "embedding" and got["stage_pieces"][-1][-1] == "head"
    assert [s["param_bytes"] for s in got["stages"]] == [s.param_bytes for s in split.stages]
    assert [s["device_bytes"] for s in got["stages"]] == [s.resident_bytes for s in split.stages]
    assert got["shares"] == pytest.approx(split.shares())
    assert got["bubble"]["bubble"] == pytest.approx(pred.bubble) and 0 < pred.bubble < 1
    assert got["bubble"]["schedule"] == "1f1b" and got["bubble"]["microbatches"] == 4
    code, out, _ = _plan(capsys, "--gpt", "125m", "--stages", str(stages), "--vram-gb", "24")
    assert code == 0
    rows = [line for line in out.splitlines() if line.startswith("  stage ") and ", time " in line]
    assert len(rows) == stages
    for row, s, share in zip(rows, split.stages, split.shares()):
        assert f"parameters {s.param_bytes / GiB:.3f} GiB" in row and f"time {share:.1%}" in row
        assert f"device memory {s.device_bytes / GiB:.3f} GiB of 24.00 GiB" in row
    assert f"bubble of the default schedule (1f1b, 4 microbatches): {pred.bubble:.1%}" in out


def test_cli_streams_stages_that_do_not_fit_and_shows_window_and_pin(capsys):
    args = ["--gpt", "125m", "--stages", "4", "--stage-vram-gb", "0.5,0.25,0.25,0.5", "--balance", "time"]
    code, out, err = _plan(capsys, *args, "--json")
    assert code == 0, err
    got = json.loads(out)["pipeline"]
    budgets = [int(g * GiB) for g in (0.5, 0.25, 0.25, 0.5)]
    split, pred = _reference(4, budgets, balance="time")
    assert split.streamed and got["streamed"] and got["counts"] == split.counts
    for g, s in zip(got["stages"], split.stages):
        assert (g["streaming"]["window"], g["streaming"]["pin"]) == (s.streaming.window, s.streaming.pin)
        assert s.device_bytes <= s.budget
    from ramstream.planner.cli_pipeline import piece_numbers

    params = piece_numbers(ModelShape.gpt("125m", batch=1, seq=1024, dtype="bfloat16", loss="dense"), 1.0)[
        "params"
    ]
    reads = got["streamed_reads_per_step"]
    for r, s in zip(reads, split.stages):  # the unpinned pieces' bf16 weights, read 2 x 4 times or twice
        mine = range(s.start, s.stop)
        streamed = sum(params[i] for i in mine if i - s.start not in s.streaming.pinned) * 2
        assert (r or {"chunk_major_gpipe": 0})["chunk_major_gpipe"] == 2 * streamed
        assert r is None or r["microbatch_major"] == 2 * 4 * streamed
    assert any(r is not None for r in reads)
    code, out, _ = _plan(capsys, *args)
    for s in split.stages:
        assert (
            f"streamed: window {s.streaming.window}, pin {s.streaming.pin} {list(s.streaming.pinned)}" in out
        )
    assert "chunk-major under gpipe" in out
    code, out, err = _plan(capsys, *args, "--offload", "false")
    assert code == 2 and "(too big)" in err


@pytest.mark.parametrize(
    "argv, says",
    [
        (
            ["--stages", "2", "--stage-vram-gb", "a,b"],
            "--stage-vram-gb 'a,b' is not accepted; accepted: 2 comma",
        ),
        (["--stages", "2", "--stage-vram-gb", "8"], "--stage-vram-gb '8' is not accepted; accepted: 2 comma"),
        (["--stages", "2", "--stage-vram-gb", "8,-1"], "finite and > 0, one per stage (--stages 2)"),
        (["--stages", "0", "--vram-gb", "8"], "--stages must be an int >= 1, got 0"),
        (["--stages", "15", "--vram-gb", "8"], "--stages 15: the model has 14 pieces"),
        (["--stages", "2", "--vram-gb", "8", "--microbatches", "0"], "--microbatches must be an int >= 1"),
    ],
)
def test_cli_bad_pipeline_values_exit_2_naming_the_flag(capsys, argv, says):
    code, _, err = _plan(capsys, "--gpt", "125m", *argv)
    assert code == 2 and says in err and "Traceback" not in err, err


@pytest.mark.parametrize("flag, value", [("--balance", "flops"), ("--offload", "yes")])
def test_cli_bad_choices_are_argparse_errors_listing_the_accepted_values(capsys, flag, value):
    with pytest.raises(SystemExit) as e:
        main(["plan", "--gpt", "125m", "--stages", "2", "--vram-gb", "8", flag, value])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert f"argument {flag}: invalid choice: '{value}'" in err and "choose from" in err
