"""Atomic checkpoint-N folders for the Hugging Face Trainer: written in a hidden staging folder,
published with one rename when complete (a TrainerCallback; no private Trainer method overridden).

The Trainer writes a checkpoint in place: `<output_dir>/checkpoint-N` exists from its first file
on, and `get_last_checkpoint` (what `resume_from_checkpoint=True` uses) takes any folder of that
name, so a save killed part-way leaves a folder that looks complete and resumes from half of it.
AtomicCheckpoints changes one public value around the save: when the Trainer's control says a
checkpoint is due (on_step_end / on_epoch_end, after DefaultFlowCallback decided), it points
`args.output_dir` at `<output_dir>/.ramstream-tmp-checkpoint-N`, so the Trainer's own save
(model, optimizer, scheduler, RNG, trainer state: every file as the stock Trainer writes it)
lands in `<staging>/checkpoint-N`; on_save, called right after, restores `args.output_dir`,
fsyncs every file, renames the folder to `<output_dir>/checkpoint-N` (exchanging it with an
existing one in one renameat2 where the kernel offers it), then applies `save_total_limit` in
the real folder. Killed at any point, the previous checkpoints are as they were and the only new
thing is a hidden staging folder (no `checkpoint-N` name), removed when training starts again.
Not applied with `push_to_hub` (the hub push reads `args.output_dir` during the save).
"""

from __future__ import annotations

import logging
import os
import shutil

import transformers

from .._tensorfile import fsync_dir
from ..checkpoint import _publish

logger = logging.getLogger("ramstream")

STAGE_PREFIX = ".ramstream-tmp-"
_STATE_NAME = "trainer_state.json"


def _fsync_tree(root: str) -> None:
    for dirpath, _, files in os.walk(root):
        for name in files:
            fd = os.open(os.path.join(dirpath, name), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        fsync_dir(dirpath)


def _barrier() -> None:
    import torch.distributed as dist  # noqa: PLC0415

    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()


def _rotate(trainer, run_dir: str, args, state) -> None:
    """save_total_limit applied to the real folder (the Trainer's own rotation ran in staging)."""
    fn = getattr(transformers.trainer_utils, "rotate_checkpoints", None)
    if fn is not None:
        fn(
            output_dir=run_dir,
            save_total_limit=args.save_total_limit,
            best_model_checkpoint=state.best_model_checkpoint,
            use_mtime=True,
        )
    elif hasattr(trainer, "_rotate_checkpoints"):  # transformers before trainer_utils.rotate_checkpoints
        trainer._rotate_checkpoints(use_mtime=True, output_dir=run_dir)


class AtomicCheckpoints(transformers.TrainerCallback):
    """Stages the Trainer's checkpoint-N folder in a hidden folder and publishes it by rename.
    OffloadTrainer installs it right after DefaultFlowCallback, so that it sees the decision to
    save and publishes before later callbacks' on_save read the folder. Works on every rank
    under data parallel (all write into the same staging folder; process zero publishes between
    two barriers)."""

    def __init__(self, trainer) -> None:
        self.trainer = trainer
        self.real: str | None = None  # args.output_dir while it points at the staging folder
        self.stage: str | None = None

    # -- staging ------------------------------------------------------------------------------
    def _begin(self, args, state) -> None:
        if self.real is not None or args.push_to_hub:
            return
        self.real = args.output_dir
        self.stage = os.path.join(self.real, f"{STAGE_PREFIX}checkpoint-{state.global_step}")
        args.output_dir = self.stage

    def _end(self, args) -> str | None:
        """Restores args.output_dir; returns the staging folder (None when not staged)."""
        if self.real is None:
            return None
        args.output_dir, stage = self.real, self.stage
        self.real = self.stage = None
        return stage

    def restore(self, args) -> None:
        """args.output_dir as the user set it (OffloadTrainer.train calls it when train() raised
        mid-save; the staging folder stays, hidden, until training starts again)."""
        self._end(args)

    def _abandon(self, args) -> None:
        """Staged, but the Trainer did not save (save_strategy="best" without a new best)."""
        stage, real = self.stage, self.real
        if self._end(args) is not None and args.should_save and os.path.isdir(stage):
            self._move_rest(stage, real)

    @staticmethod
    def _move_rest(stage: str, real: str) -> None:
        """Anything else written into args.output_dir while it was redirected goes where it was meant to."""
        for name in os.listdir(stage):
            dst = os.path.join(real, name)
            if not os.path.lexists(dst):
                os.rename(os.path.join(stage, name), dst)
        shutil.rmtree(stage, ignore_errors=True)

    # -- the Trainer's events -------------------------------------------------------------------
    def on_train_begin(self, args, state, control, **kwargs):
        self._abandon(args)
        out = args.output_dir
        if args.should_save and os.path.isdir(out):
            for name in os.listdir(out):  # what a killed save left
                if name.startswith(STAGE_PREFIX):
                    shutil.rmtree(os.path.join(out, name), ignore_errors=True)

    def on_step_end(self, args, state, control, **kwargs):
        best = args.save_strategy == transformers.trainer_utils.SaveStrategy.BEST
        if control.should_save or (best and control.should_evaluate):
            self._begin(args, state)

    on_epoch_end = on_step_end

    def on_step_begin(self, args, state, control, **kwargs):
        self._abandon(args)

    on_epoch_begin = on_train_end = on_step_begin

    def on_save(self, args, state, control, **kwargs):
        real = self.real
        stage = self._end(args)
        if stage is None:
            return
        want = f"{transformers.trainer_utils.PREFIX_CHECKPOINT_DIR}-{state.global_step}"
        best = state.best_model_checkpoint
        if best is not None and os.path.commonpath([os.path.abspath(best), os.path.abspath(stage)]) == (
            os.path.abspath(stage)
        ):
            state.best_model_checkpoint = os.path.join(real, os.path.relpath(best, stage))
        _barrier()  # every rank has written its part (RNG state, shards)
        if args.should_save and os.path.isdir(stage):
            found = [
                os.path.relpath(dirpath, stage)
                for dirpath, dirnames, _ in os.walk(stage)
                if os.path.basename(dirpath) == want
            ]
            for rel in found:
                src, dst = os.path.join(stage, rel), os.path.join(real, rel)
                if state.best_model_checkpoint != best and os.path.isfile(os.path.join(src, _STATE_NAME)):
                    state.save_to_json(os.path.join(src, _STATE_NAME))  # the best path, as published
                _fsync_tree(src)
                os.makedirs(os.path.dirname(dst), exist_ok=True)
                _publish(src, dst)
            self._move_rest(stage, real)
            for run_dir in sorted({os.path.dirname(os.path.join(real, rel)) for rel in found}):
                _rotate(self.trainer, run_dir, args, state)
        _barrier()


def check_resume(trainer, resume_from_checkpoint) -> None:
    """Before Trainer.train(resume_from_checkpoint=...) loads anything: the checkpoint folder's files
    are checked as far as it costs no read of their data, so that a damaged checkpoint is refused
    before the model's weights are replaced (the Trainer loads the model first, the optimizer much
    later). Every safetensors header (validated as load_checkpoint does), every torch file (.pt,
    .pth, .bin in torch's zip format: its zip directory, which a truncated file lacks) and
    trainer_state.json (parsed).
    ValueError naming the file; FileNotFoundError when the folder is missing. A folder without a
    checkpoint is left to the Trainer's own error."""
    import json
    import zipfile

    from .._tensorfile import read_header

    if resume_from_checkpoint is None or resume_from_checkpoint is False:
        return
    if resume_from_checkpoint is True:
        from transformers.trainer_utils import get_last_checkpoint

        folder = (
            get_last_checkpoint(trainer.args.output_dir) if os.path.isdir(trainer.args.output_dir) else None
        )
        if folder is None:
            return  # the Trainer says there is none
    else:
        folder = os.fspath(resume_from_checkpoint)
    if not os.path.isdir(folder):
        raise FileNotFoundError(f"OffloadTrainer.train: resume_from_checkpoint={folder!r} is not a folder")
    for name in sorted(os.listdir(folder)):
        path = os.path.join(folder, name)
        if not os.path.isfile(path):
            continue
        if name.endswith(".safetensors"):
            read_header(path, "OffloadTrainer.train(resume_from_checkpoint=...)")
        elif name.endswith((".pt", ".pth", ".bin")):
            with open(path, "rb") as f:
                if f.read(2) != b"PK":
                    continue  # not torch's zip format (a legacy file): left to the Trainer
            try:
                with zipfile.ZipFile(path):
                    pass
            except (zipfile.BadZipFile, OSError) as e:
                raise ValueError(
                    f"OffloadTrainer.train: checkpoint file {path} is damaged or truncated ({e}); "
                    "nothing was loaded: resume from an earlier checkpoint"
                ) from None
        elif name == _STATE_NAME:
            try:
                with open(path) as f:
                    state = json.load(f)
            except (OSError, ValueError) as e:
                raise ValueError(
                    f"OffloadTrainer.train: {path} is not valid JSON ({e}); nothing was loaded"
                ) from None
            if not isinstance(state, dict):
                raise ValueError(
                    f"OffloadTrainer.train: {path} holds a {type(state).__name__}, not an object"
                )
