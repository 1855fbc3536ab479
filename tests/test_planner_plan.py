"""plan_training() and `ramstream plan`: decisions checked against hand arithmetic on injected
profiles (80/24/8/4 GiB GPUs, 32/128 GiB RAM), the step-time model by hand, PlanError's numbers."""

from __future__ import annotations

import json

import pytest

import ramstream
from ramstream.cli import main
from ramstream.planner import HardwareProfile, ModelShape, PlanError, plan_training
from ramstream.planner.rules import HOST_RAM_SHARE as SHARE  # the planner plans for this share of RAM

G = 2**30
V, D = 50304, 2048
P18 = 32 * (12 * D * D + 13 * D) + 2 * V * D + 1024 * D + 2 * D  # the 1.8B GPT's parameters
QWEN14 = dict(
    model_type="qwen2", hidden_size=5120, intermediate_size=13824, num_hidden_layers=48,
    num_attention_heads=40, num_key_value_heads=8, vocab_size=152064, tie_word_embeddings=False,
)  # fmt: skip
QWEN7 = dict(QWEN14, hidden_size=3584, intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28,
             num_key_value_heads=4)  # fmt: skip


def prof(vram_gib, ram_gib, **kw):
    base = dict(device="cuda:0", vram_total=int(vram_gib * G), vram_free=int(vram_gib * G), ram_total=int(ram_gib * G),
                ram_available=int(ram_gib * G), pin_budget=int(ram_gib * G) // 2, h2d_gbps=55.0, d2h_gbps=55.0,
                duplex_gbps=50.0, adamw_gbps=115.0, matmul_tflops=790.0)  # fmt: skip
    base.update(kw)
    return HardwareProfile(**base)


def gpt18(dtype="fp32", batch=1, seq=1024):
    return ModelShape.gpt("1.8b", batch=batch, seq=seq, dtype=dtype)


def act_fp32(tokens, d=D, heads=16, layers=32):
    return layers * tokens * (4 * 16 * d + 4 * heads + 16)


def resident_bytes_fp32(tokens):
    # weights 4 + gradients 4 + two fp32 moments 8 per parameter, every activation, the logits
    return 16 * P18 + act_fp32(tokens) + tokens * V * 12 + tokens * (2 * 4 * D + 8)


def resident_peak_fp32(n, tokens, d=D, heads=16, vram=80):
    """engine/resident.py's estimate from the offloaded run's peak: weights 4 B/param between steps,
    moments 8, gradients 4 as large as the transient (kept activations, the final norm's, and the
    larger of the forward's logits and the backward's gradients in flight) or quartered."""
    fwd_extra, bwd_extra = tokens * V * 12, min(G, vram * G // 10)
    transient = act_fp32(tokens, d=d, heads=heads) + tokens * (2 * 4 * d + 8) + max(fwd_extra, bwd_extra)
    grads = 4 * n
    return 4 * n + 8 * n + max(transient, grads) + min(transient, grads) // 4


def test_gpt_parameter_count():
    assert gpt18().numel == P18 and 1.8e9 < P18 < 1.85e9


@pytest.mark.parametrize("ram", [32, 128])
def test_1_8b_fp32_on_80_gib_is_resident(ram):
    need = resident_peak_fp32(P18, 1024)
    assert need < resident_bytes_fp32(1024) < 0.9 * 80 * G  # stock training fits
    p = plan_training(gpt18(), prof(80, ram))
    assert p.mode == "resident" and p.optimizer["placement"] == "device"
    assert p.weights["streamed"] == [] and set(p.activations) == {"keep"}
    assert p.memory["vram"]["total"] == need  # the resident peak wrap() estimates


@pytest.mark.parametrize("ram", [32, 128])
def test_1_8b_fp32_on_24_gib_keeps_weights_and_moves_the_optimizer(ram):
    assert resident_bytes_fp32(1024) > 0.9 * 24 * G  # not resident
    # host optimizer: weights 4 B/param + 1 GiB of gradients in flight + activations + logits fit
    assert 4 * P18 + G + act_fp32(1024) + 1024 * V * 12 < 0.9 * 24 * G
    p = plan_training(gpt18(), prof(24, ram))
    assert p.mode == "offload" and p.optimizer["placement"] == "host"
    # wrap()'s activation_checkpointing="auto": weights 4 + moments and gradients 12 B/param
    # exceed 90 % of the GPU while the weights take less than half: every block recomputes
    assert 16 * P18 > 0.9 * 24 * G and 4 * P18 < 12 * G
    assert p.weights["streamed"] == [] and set(p.activations) == {"recompute"}
    assert 0 < p.optimizer["vram_share"] < 1 and p.optimizer["moment_dtype"] == "float32"
    sp = p.optimizer["split"]
    assert sum(sp.values()) == pytest.approx(1.0) and sp["device"] == p.optimizer["vram_share"]
    # the state of the first params fits in usable VRAM - the offloaded peak - 512 MiB, 8 B each
    room = 0.9 * 24 * G - (p.memory["vram"]["total"] - p.memory["vram"]["optimizer_share"]) - 512 * 2**20
    assert p.optimizer["numel"]["device"] == int(room // 8)


@pytest.mark.parametrize("vram", [8, 4])
def test_1_8b_fp32_on_small_gpus_streams_blocks_from_the_front(vram):
    # fp32 weights + gradients in flight (min(1 GiB, VRAM / 10)) + the logits do not fit
    assert 4 * P18 + min(G, vram * G // 10) + 1024 * V * 12 > 0.9 * vram * G
    p = plan_training(gpt18(), prof(vram, 128))
    st = p.weights["streamed"]
    assert st and st == list(range(len(st)))  # from the front, as wrap()
    assert p.memory["vram"]["total"] <= 0.9 * vram * G
    assert p.memory["ram"]["streamed_weights"] == len(st) * 4 * (12 * D * D + 13 * D)


def test_ram_forces_bf16_moments():
    # fp32 state 16 B/param (master 4, moments 8, landing 4) exceeds 26 GiB; a streamed fp32
    # block's pinned home is its master (engine/updater.py), so streaming adds no second copy;
    # bf16 moments (12 B/param) fit
    assert 16 * P18 > 26 * G > 12 * P18 + 0.3 * G
    p = plan_training(gpt18(), prof(4, 26), optimizer_mode="cpu")
    assert p.optimizer["moment_dtype"] == "bfloat16"
    assert plan_training(gpt18(), prof(4, 128), optimizer_mode="cpu").optimizer["moment_dtype"] == "float32"


def test_bf16_moments_by_hand_and_the_error_without_them():
    # optimizer_mode="cpu": no VRAM share, so host RAM is exactly the state of every parameter
    assert 16 * P18 > SHARE * 24 * G > 12 * P18
    with pytest.raises(PlanError) as e:
        plan_training(gpt18(), prof(24, 24), optimizer_mode="cpu", moment_dtype="float32")
    msg = str(e.value)
    assert (
        f"needs {16 * P18 / G:.2f} GiB" in msg
        and f"{int(SHARE * 24 * G) / G:.2f} GiB available per rank" in msg
    )
    assert "moment_dtype='bfloat16'" in msg and isinstance(e.value, MemoryError)
    assert e.value.arithmetic["ram"]["optimizer_state"] == 12 * P18
    p = plan_training(gpt18(), prof(24, 24), optimizer_mode="cpu")
    assert p.optimizer["moment_dtype"] == "bfloat16"
    assert p.memory["ram"]["total"] == 12 * P18  # master 4 + bf16 moments 4 + fp32 landing 4


def test_local_world_size_divides_ram():
    ok = plan_training(gpt18(), prof(24, 48), optimizer_mode="cpu")
    assert ok.optimizer["moment_dtype"] == "float32"  # 16 P < 48 GiB
    two = plan_training(gpt18(), prof(24, 48, local_world_size=2), optimizer_mode="cpu")
    assert (
        two.optimizer["moment_dtype"] == "bfloat16"
        and two.memory["ram"]["budget"] == int(SHARE * 48 * G) // 2
    )


def test_6_85b_fp32_on_an_uncapped_h200_is_resident():
    d, L = 4096, 32
    n = L * (12 * d * d + 13 * d) + 2 * V * d + 1024 * d + 2 * d
    need = resident_peak_fp32(n, 1024, d=d, heads=32, vram=141)
    assert need < 0.9 * 141 * G
    p = plan_training(ModelShape.gpt("6.85b", batch=1, seq=1024, dtype="fp32"), prof(141, 512))
    assert p.mode == "resident" and p.memory["vram"]["total"] == need


def qwen(cfg, lora=16):
    return ModelShape.from_hf_config(cfg, batch=1, seq=1024, dtype="bf16", lora=lora)


@pytest.mark.parametrize("ram", [32, 128])
def test_14b_lora_on_24_gib_streams_some_blocks_and_recomputes(ram):
    s = qwen(QWEN14)
    assert 2 * s.frozen_numel > 0.9 * 24 * G  # the bf16 base does not fit
    p = plan_training(s, prof(24, ram))
    st = p.weights["streamed"]
    assert 0 < len(st) < 48 and st == list(range(len(st)))
    assert "recompute" in p.activations and "page" not in p.activations  # PCIe carries the weights
    assert p.predicted["bound"] == "h2d"


def test_7b_lora_by_gpu_size():
    s = qwen(QWEN7)
    assert plan_training(s, prof(80, 128)).mode == "resident"
    assert 2 * s.frozen_numel > 0.9 * 8 * G
    p = plan_training(s, prof(8, 32))
    assert p.weights["streamed"] and p.optimizer["placement"] == "host"


def test_plan_error_shows_the_arithmetic_per_component():
    s = qwen(QWEN14)
    with pytest.raises(PlanError) as e:
        plan_training(s, prof(4, 32))
    msg = str(e.value)
    # the least-VRAM plan still holds the bf16 embedding and head (2 x 152064 x 5120 x 2 bytes)
    # and the dense logits (1024 tokens x vocab x (2 + 8) bytes)
    assert f"weights {2 * 152064 * 5120 * 2 / G:.2f}" in msg
    assert f"logits {1024 * 152064 * 10 / G:.2f}" in msg
    assert f"vs {0.9 * 4:.2f} GiB usable (free 4.00 GiB less 10%)" in msg
    v = e.value.arithmetic["vram"]
    assert f"needs {sum(x for k, x in v.items() if k != 'budget') / G:.2f} GiB" in msg
    assert "RAM (least-RAM plan)" in msg and f"{int(SHARE * 32 * G) / G:.2f} GiB available per rank" in msg


def test_step_time_model_by_hand_resident_and_host():
    from ramstream.planner import timing as tm

    tok, mm, R = 1024, 12 * D * D, 790e12 * tm.MATMUL_EFFICIENCY
    act = -(-tok * (4 * 16 * D + 4 * 16 + 16) // 1)  # one block's saved bytes (fp32)
    f, b = tok * (2 * mm + 2 * 1024 * D), tok * (4 * mm + 4 * 1024 * D)
    t_f = max(f / R + act / (tm.HBM_EW_GBPS * 1e9), 20 * tm.EAGER_OP_S)
    t_b = max(b / R + 2 * act / (tm.HBM_EW_GBPS * 1e9), 40 * tm.EAGER_OP_S)
    outside = tok * 6 * V * D / R + 3 * tok * V * 12 / (tm.HBM_EW_GBPS * 1e9)
    compute = 32 * (t_f + t_b) + outside
    p = plan_training(gpt18(), prof(80, 128))
    want = compute + P18 * 28 / (tm.DEVICE_ADAMW_GBPS * 1e9)
    assert p.predicted["step_s"] == pytest.approx(want, rel=1e-9) and p.predicted["bound"] == "gpu_compute"
    h = plan_training(gpt18(), prof(24, 128), optimizer_mode="cpu")
    b = h.bounds
    assert set(h.activations) == {"keep"}  # optimizer_mode='cpu': no recompute rule
    assert b["gpu_compute_s"] == pytest.approx(compute, rel=1e-9)
    # gradients down and weights up (4 B each) at the duplex rate; host AdamW 28 B under DMA
    assert b["h2d_s"] == pytest.approx(4 * P18 / 50e9) and b["d2h_s"] == pytest.approx(4 * P18 / 50e9)
    host = 28 * P18 / (115e9 * tm.HOST_UNDER_DMA)
    assert b["host_adamw_s"] == pytest.approx(host)
    # the host lane: the forward, then the host AdamW beside the backward (nothing mapped: no
    # mapped update, the eager ops hide under the GPU time as in the resident run)
    fwd = 32 * t_f + tok * 2 * V * D / R
    assert b["mapped_update_s"] == 0 and b["issue_exposed_s"] == 0
    assert b["host_lane_s"] == pytest.approx(fwd + host, rel=1e-9)
    assert h.predicted["step_s"] == pytest.approx(fwd + host, rel=1e-9)
    assert h.predicted["bound"] == "host_adamw"


def test_step_time_model_by_hand_mapped():
    """optimizer_mode='gpu' on the 6.85B GPT in bf16 at 24 GiB: the state that fits in VRAM is
    updated there ("device"), the rest by the GPU over mapped memory. The mapped kernel holds the
    SMs, so the gpu lane is compute + the mapped update + the eager time of each pass."""
    from ramstream.planner import timing as tm

    m = plan_training(
        ModelShape.gpt("6.85b", batch=1, seq=1024, dtype="bf16"), prof(24, 256), optimizer_mode="gpu"
    )
    b, num = m.bounds, m.optimizer["numel"]
    n = num["mapped"]
    assert num["host"] == 0 and num["device"] > 0 and n > 0.5 * (n + num["device"])
    assert b["host_adamw_s"] == 0 and b["host_lane_s"] == 0
    # bf16 weights: the fp32 master and two fp32 moments read and written, 12 B each way
    mapped = 12 * n / (55e9 * tm.MAPPED_EFFICIENCY)
    assert b["mapped_update_s"] == pytest.approx(mapped, rel=1e-9)
    assert b["h2d_s"] == pytest.approx(12 * n / 50e9) and b["d2h_s"] == pytest.approx(12 * n / 50e9)
    # a GPT block's 20 eager ops per pass are shorter than its GPU time in every pass
    passes = sum(2 + (a == "recompute") for a in m.activations) + 32
    assert b["issue_exposed_s"] == pytest.approx(tm.ISSUE_EXPOSED * passes * 20 * tm.EAGER_OP_S, rel=1e-9)
    lane = b["gpu_compute_s"] + mapped + b["issue_exposed_s"]
    assert b["gpu_lane_s"] == pytest.approx(lane, rel=1e-9)
    assert m.predicted["step_s"] == pytest.approx(lane, rel=1e-9) and m.predicted["bound"] == "mapped_update"


def test_large_batch_pages_or_recomputes_from_the_front():
    s = gpt18(batch=8)
    assert act_fp32(8192) > 0.9 * 24 * G - 4 * P18  # the activations cannot all stay
    p = plan_training(s, prof(24, 256), optimizer_mode="cpu")
    acts = p.activations
    assert "keep" in acts and set(acts) - {"keep"}
    first_keep = acts.index("keep")
    assert all(a != "keep" for a in acts[:first_keep]) and all(a == "keep" for a in acts[first_keep:])
    assert p.memory["vram"]["total"] <= 0.9 * 24 * G
    assert p.memory["ram"]["paged_activations"] == acts.count("page") * s.act_bytes(0)


def test_explicit_options_constrain_the_plan():
    s, pr = gpt18(), prof(80, 256)
    assert plan_training(s, pr, param_offload=True).weights["streamed"] == list(range(32))
    assert plan_training(s, pr, param_offload=[0, 5]).weights["streamed"] == [0, 5]
    assert plan_training(s, pr, param_offload=0.25).weights["streamed"] == list(range(8))  # as wrap()
    assert plan_training(s, pr, activation_offload=True).activations == ["page"] * 32
    o = plan_training(s, pr, optimizer_mode="cpu").optimizer
    assert {k: o[k] for k in ("placement", "vram_share", "moment_dtype")} == {
        "placement": "host", "vram_share": 0.0, "moment_dtype": "float32"
    }  # fmt: skip
    assert o["split"] == {"device": 0.0, "mapped": 0.0, "host": 1.0} and o["numel"]["host"] == s.trained_numel
    with pytest.raises(PlanError, match="param_offload='auto'"):
        plan_training(s, prof(4, 256), param_offload=False)
    m = plan_training(s, prof(24, 256), optimizer_mode="gpu")
    assert m.optimizer["placement"] == "mapped" and m.bounds["host_adamw_s"] == 0


@pytest.mark.parametrize(
    "kw,match",
    [
        (dict(param_offload="some"), "param_offload='some' is not accepted"),
        (dict(param_offload=[40]), "param_offload"),
        (dict(activation_offload=2), "activation_offload"),
        (dict(optimizer_mode="tpu"), "optimizer_mode"),
        (dict(moment_dtype="fp8"), "moment_dtype"),
        (dict(quantize="fp4"), "quantize='fp4'.*'none', 'int8', 'nf4'"),
        (dict(vram_headroom=1.0), "vram_headroom"),
        (dict(max_activation_slowdown=-1), "max_activation_slowdown"),
    ],
)
def test_argument_errors(kw, match):
    with pytest.raises(ValueError, match=match):
        plan_training(gpt18(), prof(80, 128), **kw)
    with pytest.raises(TypeError, match="ModelShape"):
        plan_training("1.8b", prof(80, 128))
    with pytest.raises(ValueError, match="profile.h2d_gbps=0.0"):
        plan_training(gpt18(), prof(80, 128, h2d_gbps=0.0))


def test_quantized_frozen_weights_take_fewer_bytes():
    s = qwen(QWEN14)
    n = s.blocks[0].frozen_matrix_numel
    p = plan_training(s, prof(24, 128), quantize="nf4")
    per_block = s.blocks[0].weight_bytes - 2 * n + int(-(-n * (0.5 + 4 / 64) // 1))
    assert (
        p.memory["vram"]["weights"]
        == 2 * 2 * 152064 * 5120 + 2 * 5120 + len(p.weights["resident"]) * per_block
    )
    assert len(p.weights["streamed"]) < len(plan_training(s, prof(24, 128)).weights["streamed"])


def test_plan_json_and_explain():
    p = plan_training(qwen(QWEN14), prof(24, 128))
    d = json.loads(json.dumps(p.to_dict()))
    assert set(d) >= {"weights", "activations", "optimizer", "predicted", "bounds", "reasons"}
    assert (
        set(d["weights"]) == {"resident", "streamed", "disk"}
        and d["weights"]["disk"] == []
        and len(d["activations"]) == 48
    )
    text = p.explain()
    assert "streamed: " in text and "step:" in text and "bound by h2d" in text


def test_cpu_profile_plans_everything_in_ram():
    p = plan_training(gpt18(), HardwareProfile(ram_available=256 * G, ram_total=256 * G, adamw_gbps=10.0))
    assert p.mode == "cpu" and p.memory["ram"]["total"] == resident_bytes_fp32(1024)
    # the CPU engine computes and updates on the same cores: the step is their sum
    b = p.bounds
    assert b["host_adamw_s"] == pytest.approx(28 * P18 / 10e9)
    assert p.predicted["step_s"] == pytest.approx(b["gpu_compute_s"] + b["host_adamw_s"], rel=1e-9)


# ---- ramstream plan ----------------------------------------------------------------------------


@pytest.fixture
def no_cache(monkeypatch, tmp_path):
    monkeypatch.setenv("RAMSTREAM_CACHE_DIR", str(tmp_path / "empty-cache"))


def test_cli_plan_config_lora_json(tmp_path, capsys, no_cache):
    (tmp_path / "config.json").write_text(json.dumps(QWEN14))
    rc = main(["plan", "--config", str(tmp_path / "config.json"), "--lora", "16", "--vram-gb", "24",
               "--ram-gb", "128", "--json"])  # fmt: skip
    out = json.loads(capsys.readouterr().out)
    assert rc == 0 and out["fits"] and out["sources"]["rates"].startswith("H200-machine defaults")
    assert out["profile"]["h2d_gbps"] == 54.9 and out["profile"]["adamw_gbps"] == pytest.approx(4.56 * 28)
    # the plan printed is the one wrap() applies: plan_for on the module the config builds
    from ramstream.runtime.inspect import config_model

    model = config_model(str(tmp_path / "config.json"), lora=16)
    want = ramstream.plan_for(model, profile=HardwareProfile.from_dict(out["profile"]), batch=1, seq=1024)
    assert out["plan"] == json.loads(json.dumps(want.to_dict()))
    assert out["plan"]["weights"]["streamed"]  # the bf16 base does not fit in 24 GiB


def test_cli_plan_text_given_rates(capsys, no_cache):
    rc = main(["plan", "--gpt", "1.8b", "--dtype", "fp32", "--vram-gb", "80", "--ram-gb", "64", "--tflops", "100",
               "--h2d-gbps", "20", "--d2h-gbps", "20", "--adamw-gbps", "40"])  # fmt: skip
    out = capsys.readouterr().out
    assert (
        rc == 0
        and ": resident" in out
        and "matmul 100 TFLOP/s" in out
        and "tflops" not in out.split("numbers:")[0]
    )
    assert "matmul_tflops: given" in out


def test_cli_plan_exit_2_when_it_does_not_fit(tmp_path, capsys, no_cache):
    (tmp_path / "config.json").write_text(json.dumps(QWEN14))
    rc = main(["plan", "--config", str(tmp_path), "--lora", "16", "--vram-gb", "4", "--ram-gb", "32"])
    err = capsys.readouterr().err
    assert rc == 2 and "does not fit" in err and "VRAM (least-VRAM plan)" in err
    assert main(["plan", "--config", str(tmp_path / "missing.json")]) == 2
    assert main(["plan", "--gpt", "1.8b", "--batch", "0"]) == 2


def test_the_step_is_timed_at_the_refined_split(monkeypatch):
    """optimizer_mode="auto": the plan times the split engine/refine.py settles on (its rounds in
    optimizer["refinements"]); a first move predicted more than MIN_GAIN slower is undone, as the
    refiner undoes it, and then the step-2 split is timed."""
    from ramstream.planner import policy

    sh = ModelShape.gpt("6.85b", batch=8, seq=512, dtype="bf16", loss="chunked")
    p = plan_training(sh, prof(24, 120))
    o = p.optimizer
    assert o["refinements"] and o["split"] == o["refinements"][-1]["split"]
    assert o["split"]["device"] == o["initial_split"]["device"]  # the VRAM share stays
    step2 = plan_training(sh, prof(24, 120), _refine=False)
    assert step2.optimizer["split"] == step2.optimizer["initial_split"] == o["initial_split"]
    assert step2.optimizer["refinements"] == []
    assert p.predicted["step_s"] < step2.predicted["step_s"]
    # cpu / gpu modes do not refine
    assert plan_training(sh, prof(24, 120), optimizer_mode="gpu").optimizer["refinements"] == []

    def bad(split, **kw):  # every movable parameter mapped: PCIe-bound, slower
        moved = split["mapped"] + split["host"] - kw["streamed_trained"]
        return [{**split, "mapped": moved, "host": kw["streamed_trained"]}]

    monkeypatch.setattr(policy, "refinement_rounds", bad)
    r = plan_training(sh, prof(24, 120))
    assert r.optimizer["refinements"][0]["reverted"]
    assert r.optimizer["split"] == r.optimizer["initial_split"]
    assert r.predicted["step_s"] == pytest.approx(step2.predicted["step_s"])


def test_a_long_step_that_fits_only_with_paging_says_so_and_the_suggestion_is_a_real_plan():
    """The 6.85B GPT, 16 x 2048 tokens, chunked loss, 16 GiB (issue 24's R5 at 16 GiB, refused at
    step 0 on the GPU): every block recomputing and any number streaming keeps 8 GiB of checkpointed
    inputs, which only paging frees; the refusal names activation_offload=True, and that plan fits."""
    s = ModelShape.gpt("6.85b", batch=16, seq=2048, dtype="bfloat16", loss="chunked")
    p16 = prof(16, 120)
    with pytest.raises(PlanError) as e:
        plan_training(s, p16)
    hint = [o for o in e.value.options if o.startswith("activation_offload=True")]
    assert len(hint) == 1 and "step ~" in hint[0]
    paged = plan_training(s, p16, activation_offload=True)
    assert paged.memory["vram"]["total"] <= paged.memory["vram"]["budget"]
    assert f"step ~{paged.predicted['step_s'] * 1e3:.0f} ms" in hint[0]
    assert paged.memory["ram"].get("paged_activations", 0) > 0
    # asked for already: not suggested again
    with pytest.raises(PlanError) as again:
        plan_training(s, prof(6, 120), activation_offload=True)
    assert not any(o.startswith("activation_offload=True") for o in again.value.options)
