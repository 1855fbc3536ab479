"""OffloadTrainer's checkpoint-N folders appear only when complete: a save killed at any point (a
subprocess killed mid-file, before the trainer state, before the rename) leaves the previous
checkpoint byte for byte and nothing get_last_checkpoint picks; resuming from what is left equals
the uninterrupted run bit for bit. Rotation, the best checkpoint and the folders themselves are
the stock Trainer's."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")

from transformers.trainer_utils import get_last_checkpoint

from ramstream.integrations.hf_checkpoints import STAGE_PREFIX
from ramstream.integrations.huggingface import OffloadTrainer
from test_hf_trainer import _args, _data, _llama_dir, _losses, _params

pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning", "ignore::UserWarning")
CKPT = dict(eval_strategy="no", save_strategy="steps", save_steps=5)
OURS = {"device": "cpu"}

_CRASH = textwrap.dedent(
    """
    import io, os, shutil, sys, torch, transformers
    sys.path.insert(0, {tests!r})
    import ramstream.integrations.hf_checkpoints as hc
    from ramstream.integrations.huggingface import OffloadTrainer
    from test_hf_trainer import _args, _data, _llama_dir
    torch.set_num_threads(1)
    where, root, out = sys.argv[1:4]
    target = "checkpoint-5" if where == "first" else "checkpoint-10"

    def cut(path, data):  # a file half written, then the process dies
        with open(path, "wb") as f:
            f.write(data[: len(data) // 2])
            f.flush()
        os._exit(3)

    real_save, real_pretrained, real_json = torch.save, transformers.PreTrainedModel.save_pretrained, (
        transformers.TrainerState.save_to_json)
    def save(obj, f, *a, **k):
        if where == "optimizer" and str(f).endswith("optimizer.pt") and target in str(f):
            buf = io.BytesIO(); real_save(obj, buf); cut(f, buf.getvalue())
        return real_save(obj, f, *a, **k)
    def pretrained(self, folder, *a, **k):
        out_ = real_pretrained(self, folder, *a, **k)
        if where in ("model", "first") and target in str(folder):
            path = os.path.join(folder, "model.safetensors")
            cut(path, open(path, "rb").read())
        return out_
    def state_json(self, path):
        if where == "state" and target in path:
            cut(path, b'{{"global_step": 10, "log_history": []}}')
        return real_json(self, path)
    def publish(src, dst):
        if where == "publish" and dst.endswith(target):
            os._exit(3)  # every file written and fsynced, the rename not done
        return real_publish(src, dst)
    torch.save, transformers.PreTrainedModel.save_pretrained = save, pretrained
    transformers.TrainerState.save_to_json = state_json
    real_publish, hc._publish = hc._publish, publish

    class Copy(transformers.TrainerCallback):  # the previous checkpoint, as published
        def on_save(self, args, state, control, **kw):
            if state.global_step == 5:
                shutil.copytree(os.path.join(out, "checkpoint-5"), os.path.join(root, "copy"))

    model = transformers.AutoModelForCausalLM.from_pretrained(_llama_dir(root))
    t = OffloadTrainer(model=model, args=_args(out, eval_strategy="no", save_strategy="steps", save_steps=5),
                       train_dataset=_data(40), ramstream={{"device": "cpu"}}, callbacks=[Copy()])
    t.train()
    os._exit(0)
    """
)


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return str(tmp_path_factory.mktemp("hfck"))


@pytest.fixture
def one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)  # as the killed subprocess ran: the same float summation order
    yield
    torch.set_num_threads(n)


def _train(root, out, resume=None, cls=OffloadTrainer, **kw):
    model = transformers.AutoModelForCausalLM.from_pretrained(_llama_dir(root))
    extra = {} if cls is transformers.Trainer else {"ramstream": dict(OURS)}
    t = cls(model=model, args=_args(out, **{**CKPT, **kw}), train_dataset=_data(40), **extra)
    t.train(resume_from_checkpoint=resume)
    return t


@pytest.fixture(scope="module")
def uninterrupted(root):
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        t = _train(root, os.path.join(root, "full"))
    finally:
        torch.set_num_threads(n)
    return _losses(t)[0], _params(t.model)


@pytest.mark.parametrize("where", ["first", "model", "optimizer", "state", "publish"])
def test_a_trainer_save_killed_part_way_leaves_the_previous_checkpoint(
    root, uninterrupted, tmp_path, where, one_thread
):
    script = tmp_path / "crash.py"
    script.write_text(_CRASH.format(tests=os.path.dirname(os.path.abspath(__file__))))
    out = tmp_path / "out"
    _llama_dir(root)  # made here, read by the subprocess
    env = dict(os.environ, OMP_NUM_THREADS="1")
    r = subprocess.run(
        [sys.executable, str(script), where, root, str(out)], env=env, capture_output=True, text=True
    )
    assert r.returncode == 3, r.stdout[-2000:] + r.stderr[-3000:]
    names = os.listdir(out)
    staged = [n for n in names if n.startswith(STAGE_PREFIX)]
    assert staged == [f"{STAGE_PREFIX}checkpoint-{5 if where == 'first' else 10}"]  # what the dead save left
    if where == "first":
        assert get_last_checkpoint(str(out)) is None
        assert sorted(n for n in names if not n.startswith(".")) == []
        return
    assert get_last_checkpoint(str(out)) == str(out / "checkpoint-5")
    assert sorted(n for n in names if not n.startswith(".")) == ["checkpoint-5"]
    copy = os.path.join(root, "copy")
    try:
        assert sorted(os.listdir(out / "checkpoint-5")) == sorted(os.listdir(copy))
        for name in os.listdir(copy):
            with open(os.path.join(copy, name), "rb") as a, open(out / "checkpoint-5" / name, "rb") as b:
                assert a.read() == b.read(), name
    finally:
        import shutil

        shutil.rmtree(copy, ignore_errors=True)
    # resume=True takes get_last_checkpoint: checkpoint-5; the rest equals the uninterrupted run
    t = _train(root, str(out), resume=True)
    losses, params = uninterrupted
    assert _losses(t)[0] == losses
    got = _params(t.model)
    assert all(torch.equal(got[k], params[k]) for k in params)
    assert sorted(os.listdir(out)) == ["checkpoint-10", "checkpoint-5"]  # the staging leftover removed


@pytest.mark.parametrize("strategy", ["steps", "best", "epoch"])
def test_rotation_and_the_best_checkpoint_are_the_stock_trainers(root, tmp_path, strategy):
    epoch = strategy == "epoch"  # 3 epochs of 6 steps, a save and an evaluation after each
    kw = dict(
        max_steps=-1 if epoch else 6,
        num_train_epochs=3,
        save_strategy=strategy,
        save_steps=2,
        save_total_limit=1,
        eval_strategy="epoch" if epoch else "steps",
        eval_steps=2,
        load_best_model_at_end=True,
        metric_for_best_model="eval_loss",
        greater_is_better=strategy == "best",  # "best": the first evaluation is the best one
    )

    def run(cls, out):
        model = transformers.AutoModelForCausalLM.from_pretrained(_llama_dir(root))
        extra = {} if cls is transformers.Trainer else {"ramstream": dict(OURS)}
        t = cls(
            model=model,
            args=_args(out, **kw),
            train_dataset=_data(24),
            eval_dataset=_data(8, seed=9),
            **extra,
        )
        t.train()
        return t

    stock, ours = run(transformers.Trainer, tmp_path / "stock"), run(OffloadTrainer, tmp_path / "ours")
    assert ours.args.output_dir == str(tmp_path / "ours")  # restored after each save
    assert sorted(os.listdir(tmp_path / "ours")) == sorted(os.listdir(tmp_path / "stock"))
    assert not [n for n in os.listdir(tmp_path / "ours") if n.startswith(".")]
    for t, out in ((stock, tmp_path / "stock"), (ours, tmp_path / "ours")):
        best = t.state.best_model_checkpoint
        assert best is not None and os.path.dirname(best) == str(out) and os.path.isdir(best)
        saved = transformers.TrainerState.load_from_json(os.path.join(best, "trainer_state.json"))
        assert saved.best_model_checkpoint == best
    assert os.path.basename(ours.state.best_model_checkpoint) == os.path.basename(
        stock.state.best_model_checkpoint
    )
    for ck in os.listdir(tmp_path / "stock"):
        assert sorted(os.listdir(tmp_path / "ours" / ck)) == sorted(os.listdir(tmp_path / "stock" / ck))


def test_atomic_checkpoints_can_be_turned_off(root, tmp_path):
    model = transformers.AutoModelForCausalLM.from_pretrained(_llama_dir(root))
    t = OffloadTrainer(
        model=model,
        args=_args(tmp_path, **CKPT),
        train_dataset=_data(4),
        ramstream={"atomic_checkpoints": False},
    )
    assert t.checkpoint_callback is None
    assert not any(type(cb).__name__ == "AtomicCheckpoints" for cb in t.callback_handler.callbacks)
    with pytest.raises(ValueError, match="atomic_checkpoints"):
        OffloadTrainer(
            model=model, args=_args(tmp_path), train_dataset=_data(4), ramstream={"atomic_checkpoints": 1}
        )
    t = OffloadTrainer(model=model, args=_args(tmp_path, **CKPT), train_dataset=_data(4))
    names = [type(cb).__name__ for cb in t.callback_handler.callbacks]
    assert names.index("AtomicCheckpoints") == names.index("DefaultFlowCallback") + 1


def test_a_save_that_raises_restores_output_dir_and_publishes_nothing(root, tmp_path, monkeypatch):
    real = torch.save

    def full_disk(obj, f, *a, **k):
        if str(f).endswith("optimizer.pt"):
            raise OSError(28, "No space left on device")
        return real(obj, f, *a, **k)

    monkeypatch.setattr(torch, "save", full_disk)
    model = transformers.AutoModelForCausalLM.from_pretrained(_llama_dir(root))
    t = OffloadTrainer(
        model=model, args=_args(tmp_path, **CKPT), train_dataset=_data(40), ramstream=dict(OURS)
    )
    with pytest.raises(OSError, match="No space left"):
        t.train()
    assert t.args.output_dir == str(tmp_path)  # no longer the staging folder
    monkeypatch.setattr(torch, "save", real)
    assert get_last_checkpoint(str(tmp_path)) is None
    assert os.listdir(tmp_path) == [f"{STAGE_PREFIX}checkpoint-5"]
    t = _train(root, str(tmp_path))  # the next run removes the leftover and saves as usual
    assert t.args.output_dir == str(tmp_path)
    assert sorted(os.listdir(tmp_path)) == ["checkpoint-10", "checkpoint-5"]


def test_trainer_resume_with_bf16_moments(root, tmp_path):
    """bf16 moments travel through optimizer.pt as fp32 (torch's format) and back to bf16 without
    loss; the stochastic rounding of the updates after the resume matches too: bit for bit."""
    opts = {"device": "cpu", "moment_dtype": "bfloat16"}

    def run(out, resume=None):
        model = transformers.AutoModelForCausalLM.from_pretrained(_llama_dir(root))
        t = OffloadTrainer(
            model=model, args=_args(out, **CKPT), train_dataset=_data(40), ramstream=dict(opts)
        )
        t.train(resume_from_checkpoint=resume)
        return t

    full = run(tmp_path / "full")
    assert full.optimizer.optimizer._engine.moment_dtype == torch.bfloat16
    resumed = run(tmp_path / "resumed", resume=str(tmp_path / "full" / "checkpoint-5"))
    a, b = _params(full.model), _params(resumed.model)
    assert all(torch.equal(a[k], b[k]) for k in a)
