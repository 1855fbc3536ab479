"""save_checkpoint / load_checkpoint on the CPU engine: resuming equals the uninterrupted run (bit
for bit), torch optimizers round-trip, the files are plain safetensors + JSON, the host state is
written from its own buffers (no second copy), and a save killed part-way leaves the previous
checkpoint intact and no folder that looks complete."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch

import ramstream
import ramstream._tensorfile as tf


def _model(seed: int = 0, dtype=torch.float32) -> torch.nn.Module:
    torch.manual_seed(seed)
    m = torch.nn.Sequential(
        torch.nn.Linear(16, 48),
        torch.nn.GELU(),
        torch.nn.Linear(48, 48),
        torch.nn.GELU(),
        torch.nn.Linear(48, 16),
    )
    return m.to(dtype)


def _batch(step: int, dtype=torch.float32) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 + step)
    return torch.randn(8, 16, generator=g).to(dtype)


def _wrapped(dtype=torch.float32, moment_dtype="float32", **kw):
    m = _model(dtype=dtype)
    opt = torch.optim.AdamW(m.parameters(), lr=1e-2, weight_decay=0.1)
    m, opt = ramstream.wrap(m, opt, device="cpu", moment_dtype=moment_dtype, threads=1, **kw)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 4))
    return m, opt, sched


def _train(m, opt, sched, steps, dtype=torch.float32) -> None:
    for step in steps:
        x = _batch(step, dtype)
        loss = torch.nn.functional.mse_loss(m(x).float(), x.float())
        loss.backward()
        opt.step()
        opt.zero_grad()
        sched.step()
    opt.synchronize()


def _same_state(a: dict, b: dict) -> None:
    assert a["param_groups"] == b["param_groups"]
    assert a["state"].keys() == b["state"].keys()
    for i in a["state"]:
        for k, v in a["state"][i].items():
            assert torch.equal(v, b["state"][i][k]), (i, k)


@pytest.mark.parametrize(
    "dtype, moment_dtype",
    [(torch.float32, "float32"), (torch.bfloat16, "float32"), (torch.bfloat16, "bfloat16")],
)
def test_resume_equals_the_uninterrupted_run_bit_for_bit(tmp_path, dtype, moment_dtype):
    ref, ref_opt, ref_sched = _wrapped(dtype, moment_dtype)
    _train(ref, ref_opt, ref_sched, range(8), dtype)

    m, opt, sched = _wrapped(dtype, moment_dtype)
    _train(m, opt, sched, range(4), dtype)
    ramstream.save_checkpoint(tmp_path / "ck", m, opt, step=4, scheduler=sched.state_dict())
    ramstream.unwrap(m)

    m2, opt2, sched2 = _wrapped(dtype, moment_dtype)  # fresh weights: the checkpoint must replace them
    extra = ramstream.load_checkpoint(tmp_path / "ck", m2, opt2)
    assert extra["step"] == 4
    sched2.load_state_dict(extra["scheduler"])
    _train(m2, opt2, sched2, range(extra["step"], 8), dtype)

    for p, q in zip(ref.parameters(), m2.parameters()):
        assert torch.equal(p, q)
    _same_state(ref_opt.state_dict(), opt2.state_dict())
    assert opt2.param_groups[0]["lr"] == ref_opt.param_groups[0]["lr"]


def test_torch_adamw_round_trips_and_resumes_like_torch(tmp_path):
    def make():
        m = _model()
        opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
        return m, opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)

    ref, ropt, rs = make()
    _train_plain = lambda m, o, steps: [  # noqa: E731
        (torch.nn.functional.mse_loss(m(_batch(s)), _batch(s)).backward(), o.step(), o.zero_grad())
        for s in steps
    ]
    _train_plain(ref, ropt, range(6))
    m, opt, _ = make()
    _train_plain(m, opt, range(3))
    ramstream.save_checkpoint(tmp_path / "ck", m, opt)
    m2, opt2, _ = make()
    assert ramstream.load_checkpoint(tmp_path / "ck", m2, opt2) == {}
    _train_plain(m2, opt2, range(3, 6))
    for p, q in zip(ref.parameters(), m2.parameters()):
        assert torch.equal(p, q)
    _same_state(ropt.state_dict(), opt2.state_dict())


def test_ramstream_state_loads_into_torch_adamw_and_back(tmp_path):
    m, opt, sched = _wrapped()
    _train(m, opt, sched, range(3))
    ramstream.save_checkpoint(tmp_path / "ck", m, opt)
    plain = _model(seed=5)
    topt = torch.optim.AdamW(plain.parameters(), lr=1e-2, weight_decay=0.1)
    ramstream.load_checkpoint(tmp_path / "ck", plain, topt)
    sd, ours = topt.state_dict(), opt.state_dict()
    for i in ours["state"]:
        for k in ("exp_avg", "exp_avg_sq", "step", "master"):
            assert torch.equal(sd["state"][i][k], ours["state"][i][k]), (i, k)
    for p, q in zip(plain.parameters(), m.parameters()):
        assert torch.equal(p, q)


def test_files_are_safetensors_and_json_without_pickle(tmp_path):
    st = pytest.importorskip("safetensors")
    m, opt, sched = _wrapped(torch.bfloat16)
    _train(m, opt, sched, range(2), torch.bfloat16)
    ramstream.save_checkpoint(tmp_path / "ck", m, opt, note="hi", t=torch.arange(3))
    files = sorted(os.listdir(tmp_path / "ck"))
    assert files == [
        "extra.json",
        "extra.safetensors",
        "meta.json",
        "model.safetensors",
        "optimizer.json",
        "optimizer.safetensors",
    ]
    with st.safe_open(str(tmp_path / "ck" / "model.safetensors"), framework="pt") as f:
        sd = m.state_dict()
        assert set(f.keys()) == set(sd)
        for k in f.keys():
            assert torch.equal(f.get_tensor(k), sd[k])
    masters = opt.master_weights()
    with st.safe_open(str(tmp_path / "ck" / "optimizer.safetensors"), framework="pt") as f:
        for i, mw in enumerate(masters):
            assert torch.equal(f.get_tensor(f"state.{i}.master"), mw)
    with open(tmp_path / "ck" / "meta.json") as f:
        assert json.load(f)["complete"] is True
    extra = ramstream.load_checkpoint(tmp_path / "ck", m, opt)
    assert extra["note"] == "hi" and torch.equal(extra["t"], torch.arange(3))


def test_host_state_is_written_from_its_own_buffers(tmp_path, monkeypatch):
    """No copy of the host state is made for saving: every optimizer tensor written is a view
    of the engine's flat host buffers (fp32 model, fp32 moments: the master is the weights)."""
    m, opt, sched = _wrapped()
    _train(m, opt, sched, range(2))
    spans = []
    for b in opt._engine.buckets:
        for t in (b.master, b.exp_avg, b.exp_avg_sq):
            if t is not None:
                spans.append((t.data_ptr(), t.data_ptr() + t.nbytes))
    seen = []
    real = tf._write_tensor

    def spy(f, t):
        seen.append((t.data_ptr(), t.nbytes))
        real(f, t)

    monkeypatch.setattr(tf, "_write_tensor", spy)
    ramstream.save_checkpoint(tmp_path / "ck", m, opt)
    n_model = len(m.state_dict())
    opt_writes = seen[n_model:]
    assert len(opt_writes) == 3 * len(list(m.parameters()))
    inside = [any(a <= p and p + n <= b for a, b in spans) for p, n in opt_writes]
    assert all(inside)


def test_replacing_a_checkpoint_and_errors(tmp_path):
    m, opt, sched = _wrapped()
    _train(m, opt, sched, range(2))
    ramstream.save_checkpoint(tmp_path / "ck", m, opt, step=2)
    _train(m, opt, sched, range(2, 4))
    ramstream.save_checkpoint(tmp_path / "ck", m, opt, step=4)
    assert sorted(os.listdir(tmp_path)) == ["ck"]  # the previous one is gone, no leftovers
    assert ramstream.load_checkpoint(tmp_path / "ck", m, opt)["step"] == 4
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="not a complete ramstream checkpoint"):
        ramstream.load_checkpoint(tmp_path / "empty", m, opt)
    with pytest.raises(TypeError, match="extra bad="):
        ramstream.save_checkpoint(tmp_path / "ck2", m, opt, bad=object())
    assert not (tmp_path / "ck2").exists()
    with pytest.raises(TypeError, match="model must be"):
        ramstream.save_checkpoint(tmp_path / "ck3", "model")
    with pytest.raises(TypeError, match="optimizer must be"):
        ramstream.load_checkpoint(tmp_path / "ck", m, "opt")
    (tmp_path / "file").write_text("x")
    with pytest.raises(ValueError, match="not a folder"):
        ramstream.save_checkpoint(tmp_path / "file", m, opt)
    assert (tmp_path / "file").read_text() == "x"


_CRASH = textwrap.dedent(
    """
    import os, sys, torch, ramstream, ramstream._tensorfile as tf
    sys.path.insert(0, {tests!r})
    from test_checkpoint import _wrapped, _train
    where, root = sys.argv[1], sys.argv[2]
    m, opt, sched = _wrapped()
    _train(m, opt, sched, range(2))
    if where != "first":
        ramstream.save_checkpoint(os.path.join(root, "ck"), m, opt, step=2)
        ramstream.save_checkpoint(os.path.join(root, "copy"), m, opt, step=2)
    _train(m, opt, sched, range(2, 4))
    calls = [0]
    real_tensor, real_json = tf._write_tensor, tf.write_json
    def tensor(f, t):
        calls[0] += 1
        if where in ("model", "first") or (where == "optimizer" and calls[0] > len(m.state_dict()) + 2):
            f.write(t.reshape(-1).view(torch.uint8).numpy()[: t.nbytes // 2].tobytes())
            f.flush()
            os._exit(3)
        real_tensor(f, t)
    def json_(path, obj):
        if where == "meta" and path.endswith("meta.json"):
            open(path + ".tmp", "w").write("{{")
            os._exit(3)
        real_json(path, obj)
    tf._write_tensor, tf.write_json = tensor, json_
    import ramstream.checkpoint as ck
    ck.write_json = json_
    ramstream.save_checkpoint(os.path.join(root, "ck"), m, opt, step=4)
    os._exit(0)
    """
)


def _complete_looking(root) -> list[str]:
    out = []
    for dirpath, _, files in os.walk(root):
        if "meta.json" in files:
            out.append(os.path.relpath(dirpath, root))
    return sorted(out)


@pytest.mark.parametrize("where", ["first", "model", "optimizer", "meta"])
def test_a_save_killed_part_way_leaves_the_previous_checkpoint(tmp_path, where):
    script = tmp_path / "crash.py"
    script.write_text(_CRASH.format(tests=os.path.dirname(__file__)))
    root = tmp_path / "run"
    root.mkdir()
    env = dict(os.environ, OMP_NUM_THREADS="1")
    r = subprocess.run(
        [sys.executable, str(script), where, str(root)], env=env, capture_output=True, text=True
    )
    assert r.returncode == 3, r.stderr
    if where == "first":
        assert _complete_looking(root) == []  # nothing that looks like a checkpoint appeared
        assert not (root / "ck").exists()
    else:
        assert _complete_looking(root) == ["ck", "copy"]
        for name in os.listdir(root / "copy"):  # the previous checkpoint, byte for byte
            assert (root / "ck" / name).read_bytes() == (root / "copy" / name).read_bytes(), name
        m, opt, _ = _wrapped()
        assert ramstream.load_checkpoint(root / "ck", m, opt)["step"] == 2
    leftovers = [n for n in os.listdir(root) if n not in ("ck", "copy")]
    assert leftovers and all(n.startswith(".ck.tmp-") for n in leftovers)
    m, opt, sched = _wrapped()  # the next save removes what the dead process left
    ramstream.save_checkpoint(root / "ck", m, opt, step=0)
    assert sorted(os.listdir(root)) == (["ck"] if where == "first" else ["ck", "copy"])


def test_tied_embeddings_with_streamed_weights_resume_exactly(tmp_path):
    transformers = pytest.importorskip("transformers")

    def gpt2():
        torch.manual_seed(0)
        cfg = transformers.GPT2Config(vocab_size=64, n_embd=32, n_layer=2, n_head=4, n_positions=32)
        cfg.resid_pdrop = cfg.embd_pdrop = cfg.attn_pdrop = 0.0
        m = transformers.GPT2LMHeadModel(cfg)
        opt = torch.optim.AdamW(m.parameters(), lr=3e-3)
        return ramstream.wrap(m, opt, device="cpu", param_offload=True, threads=1)

    def steps(m, opt, rng):
        for s in rng:
            ids = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(s))
            m(input_ids=ids, labels=ids).loss.backward()
            opt.step()
            opt.zero_grad()
        opt.synchronize()

    ref, ropt = gpt2()
    steps(ref, ropt, range(6))
    m, opt = gpt2()
    steps(m, opt, range(3))
    ramstream.save_checkpoint(tmp_path / "ck", m, opt)
    _, meta = tf.read_safetensors(str(tmp_path / "ck" / "model.safetensors"))
    assert json.loads(meta["ramstream_ties"]) == {"lm_head.weight": "transformer.wte.weight"}
    m2, opt2 = gpt2()
    ramstream.load_checkpoint(tmp_path / "ck", m2, opt2)
    assert m2.lm_head.weight is m2.transformer.wte.weight
    assert ramstream.memory_report(m2)["params"]["streamed_blocks"] == [0, 1]
    steps(m2, opt2, range(3, 6))
    for (n, p), q in zip(ref.named_parameters(), m2.parameters()):
        assert torch.equal(p, q), n
