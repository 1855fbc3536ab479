"""Hugging Face: OffloadTrainer (alias TrainStreamTrainer), a transformers.Trainer whose optimizer is
ramstream's, and wrap_hf() for a hand-written loop.

OffloadTrainer uses the Trainer's public extension points only: create_optimizer (the stock
AdamW param groups, then wrap()), compute_loss (causal_lm_loss, so the [tokens, vocab] logits never
exist), log (ramstream's memory figures on each training log) and TrainerCallbacks (the plan once
at the start; checkpoint-N folders staged and published by rename: hf_checkpoints.py). The LR
schedule, gradient accumulation (with num_items_in_batch), max_grad_norm, evaluation, save_steps
and resume_from_checkpoint are the Trainer's own.
"""

from __future__ import annotations

import inspect
import logging

import torch

try:
    import transformers
except ImportError as exc:  # pragma: no cover - transformers is optional
    raise ImportError(
        "ramstream.integrations.huggingface needs transformers (pip install transformers accelerate)"
    ) from exc

from .. import loss as _loss
from ..wrap import memory_report, wrap
from .hf_checkpoints import AtomicCheckpoints
from .hf_load import load_model
from .hf_metrics import TrainStreamCallback, TrainStreamMetrics, ramstream_figures

__all__ = [
    "OffloadTrainer",
    "TrainStreamTrainer",
    "RamstreamCallback",
    "wrap_hf",
    "find_decoder_layers",
    "load_model",
    # TrainStream's names
    "decoder_layers",
    "lm_head_of",
    "TrainStreamMetrics",
    "TrainStreamCallback",
]

logger = logging.getLogger("ramstream")

# where the decoder layers sit: Llama, Qwen2, Mistral, Gemma, Phi (model.layers), GPT-2
# (transformer.h), GPT-NeoX (gpt_neox.layers), multimodal wrappers (model.language_model.layers)
_LAYER_PATHS = (
    "model.layers",
    "model.language_model.layers",
    "model.decoder.layers",
    "transformer.h",
    "gpt_neox.layers",
    "transformer.layers",
    "layers",
    "h",
)
_TRAINER_OPTS = ("chunked_loss", "loss_chunk_size", "atomic_checkpoints")
_ADAMW_OPTIMS = ("adamw_torch", "adamw_torch_fused")


def _unpeft(model: torch.nn.Module) -> torch.nn.Module:
    """A peft model's underlying transformers model (LoRA layers injected), else the model."""
    get = getattr(model, "get_base_model", None)
    return get() if callable(get) else model


def _attr(obj, dotted: str):
    for name in dotted.split("."):
        obj = getattr(obj, name, None)
        if obj is None:
            return None
    return obj


def find_decoder_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The decoder layers of a Hugging Face causal LM (also inside a peft model), in order:
    model.layers (Llama, Qwen2, Mistral, Gemma, Phi), transformer.h (GPT-2), gpt_neox.layers
    (GPT-NeoX), ...; otherwise the largest stack of same-class modules (ramstream's find_blocks).
    ValueError when there is none."""
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"find_decoder_layers: model must be a torch.nn.Module, got {type(model).__name__}")
    base = _unpeft(model)
    for path in _LAYER_PATHS:
        layers = _attr(base, path)
        if isinstance(layers, torch.nn.ModuleList) and len(layers) > 0:
            return list(layers)
    from ..activations.blocks import find_blocks

    return find_blocks(base)


decoder_layers = find_decoder_layers  # TrainStream's name


def lm_head_of(model: torch.nn.Module):
    """The model's nn.Linear output layer when its logits are plain hidden @ weight.T (+ bias), so
    the chunked loss applies; None otherwise (TrainStream's name)."""
    lm = _unpeft(model)
    return None if _chunkable(lm) else lm.get_output_embeddings()


def _chunkable(lm) -> str | None:
    """Why the model's logits are not plain hidden @ head.weight.T (+ bias), or None."""
    cfg = getattr(lm, "config", None)
    head = lm.get_output_embeddings() if hasattr(lm, "get_output_embeddings") else None
    if head is None or not isinstance(getattr(head, "weight", None), torch.Tensor) or head.weight.dim() != 2:
        return "it has no linear output head"
    if not isinstance(head, torch.nn.Linear):
        return f"its output head is a {type(head).__name__}, not an nn.Linear"
    for name in ("final_logit_softcapping", "logit_scale", "logits_scaling", "output_multiplier_scale"):
        if getattr(cfg, name, None) not in (None, 1, 1.0):
            return f"its config sets {name} (the logits are not plain hidden @ weight.T)"
    body = getattr(lm, "base_model", None)
    if body is None or body is lm:
        return "its decoder body (base_model) could not be found"
    return None


class CausalLMLoss:
    """loss_fn(input_ids=..., attention_mask=..., labels=..., num_items_in_batch=None, **kwargs):
    Hugging Face's causal-LM loss computed by ramstream.causal_lm_loss from the decoder body's last
    hidden state and the head's weight, so the full logits never exist. Equal to
    model(..., labels=labels).loss (and to it with num_items_in_batch) up to float rounding."""

    def __init__(self, model: torch.nn.Module, chunk_size: int = 1024) -> None:
        if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1:
            raise ValueError(f"loss_chunk_size={chunk_size!r}; accepted: an integer >= 1")
        self.model, self.chunk_size = model, chunk_size
        lm = _unpeft(model)
        self.reason = _chunkable(lm)
        self.lm = lm

    def __call__(self, labels: torch.Tensor, num_items_in_batch=None, **inputs) -> torch.Tensor:
        if self.reason is not None:
            raise ValueError(
                f"wrap_hf's loss: {type(self.lm).__name__} cannot use the chunked loss: {self.reason}"
            )
        body, head = self.lm.base_model, self.lm.get_output_embeddings()
        inputs.pop("return_dict", None)
        if "use_cache" in inspect.signature(body.forward).parameters:
            inputs.setdefault("use_cache", False)
        out = body(**inputs, return_dict=True)
        return _loss.causal_lm_loss(
            out.last_hidden_state,
            head.weight,
            labels,
            head.bias,
            chunk_size=self.chunk_size,
            num_items=num_items_in_batch,
        )


def wrap_hf(model: torch.nn.Module, optimizer=None, *, return_loss: bool = False, **options):
    """ramstream.wrap() for a Hugging Face causal LM (or a peft model of one): the decoder layers
    become wrap()'s blocks (unless blocks= is given), tied input/output embeddings stay one
    parameter, and "loss_chunk_size" (default 1024) sizes the loss helper.
    Returns (model, optimizer), as wrap() and TrainStream's wrap_hf do; with return_loss=True,
    (model, optimizer, loss_fn) with loss_fn a CausalLMLoss (chunked, HF's semantics). The helper
    is also ``model.ramstream_loss`` either way."""
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"wrap_hf: model must be a torch.nn.Module, got {type(model).__name__}")
    if not isinstance(return_loss, bool):
        raise ValueError(f"wrap_hf: return_loss={return_loss!r}; accepted: True, False")
    chunk = options.pop("loss_chunk_size", 1024)
    loss_fn = CausalLMLoss(model, chunk)  # checks the chunk size before anything changes
    lm = _unpeft(model)
    cfg = getattr(lm, "config", None)
    tie = getattr(cfg, "tie_word_embeddings", False) or getattr(
        getattr(cfg, "text_config", None), "tie_word_embeddings", False
    )
    if tie and hasattr(lm, "get_input_embeddings") and lm.get_output_embeddings() is not None:
        inp, out = lm.get_input_embeddings(), lm.get_output_embeddings()
        if inp is not None and out.weight is not inp.weight:
            lm.tie_weights()  # the config asks for one tensor; wrap() then holds it once
    if options.get("blocks") is None:
        options["blocks"] = find_decoder_layers(model)
    model, opt = wrap(model, optimizer, **options)
    model.__dict__["ramstream_loss"] = loss_fn  # not a submodule: state_dict() and .to() skip it
    return (model, opt, loss_fn) if return_loss else (model, opt)


# ---- the Trainer ---------------------------------------------------------------------------------
class RamstreamCallback(transformers.TrainerCallback):
    """Logs ramstream's plan and decisions once when training starts, and gives the per-log
    memory figures (log_figures(): metrics() and TrainStream's ts_ keys) that OffloadTrainer adds
    to each training log."""

    def __init__(self) -> None:
        self.report: dict | None = None
        self._ts: TrainStreamMetrics | None = None

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        if self.report is not None or model is None or getattr(_unpeft(model), "_ramstream", None) is None:
            return
        target = model if getattr(model, "_ramstream", None) is not None else _unpeft(model)
        self.report = memory_report(target)
        for line in self.report["events"]:
            logger.info("ramstream: %s", line)
        logger.info("ramstream: plan %s", self.report["plan"])

    @staticmethod
    def metrics(model, optimizer) -> dict[str, float]:
        """ramstream's figures (hf_metrics.ramstream_figures): ramstream_vram_alloc_gb,
        ramstream_vram_peak_gb, ramstream_pinned_gb, ramstream_host_state_gb, ramstream_d2h_gb,
        ramstream_h2d_gb, ramstream_skipped_steps."""
        return ramstream_figures(model, optimizer)

    def log_figures(self, model, optimizer) -> dict[str, float]:
        """metrics() and TrainStream's ts_ figures (TrainStreamMetrics: GiB, traffic since the
        previous log), as OffloadTrainer adds them to each training log."""
        if self._ts is None or self._ts.opt is not optimizer:
            self._ts = TrainStreamMetrics(optimizer)
        return {**self.metrics(model, optimizer), **self._ts.collect()}


class _PlacedByWrap:
    """While the Trainer's __init__ runs, the TrainingArguments answer place_model_on_device=False
    (the property TrainingArguments documents for integrations to override): wrap() places the
    model when training starts, keeping streamed blocks in host RAM, so the Trainer must not move
    a model larger than the GPU there first. The arguments' class is restored afterwards (the
    Trainer pickles them into training_args.bin)."""

    def __init__(self, args) -> None:
        self.args, self.cls = args, type(args) if args is not None else None

    def __enter__(self):
        if self.cls is not None:
            self.args.__class__ = type(self.cls.__name__, (self.cls,), {"place_model_on_device": False})

    def __exit__(self, *exc) -> None:
        if self.cls is not None:
            self.args.__class__ = self.cls


class OffloadTrainer(transformers.Trainer):
    """transformers.Trainer with ramstream's optimizer. ramstream={...} takes any wrap() option
    plus "chunked_loss" (default True: causal_lm_loss, so the full logits never exist; False:
    the model's own loss), "loss_chunk_size" (default 1024) and "atomic_checkpoints" (default
    True: each checkpoint-N folder appears only when complete). chunked_loss_used counts the
    losses computed chunked. TrainingArguments' learning rate,
    weight decay, betas, eps, warm-up/schedule, gradient_accumulation_steps and max_grad_norm
    apply as with the stock Trainer (max_grad_norm and accumulation become wrap()'s
    max_grad_norm and accumulation_steps). fp16=True is refused (bf16 or fp32)."""

    def __init__(self, *args, ramstream: dict | None = None, **kwargs) -> None:
        if ramstream is not None and not isinstance(ramstream, dict):
            raise TypeError(
                f"OffloadTrainer: ramstream= must be a dict of wrap() options, got {type(ramstream).__name__}"
            )
        opts = dict(ramstream or {})
        targs = kwargs.get("args") if "args" in kwargs else (args[1] if len(args) > 1 else None)
        if targs is not None and (getattr(targs, "fp16", False) or getattr(targs, "fp16_full_eval", False)):
            raise ValueError(
                "OffloadTrainer: fp16=True (fp16 mixed precision with a GradScaler) is not supported: "
                "ramstream keeps fp32 master weights and does not unscale gradients; use bf16=True or fp32"
            )
        if targs is not None and str(getattr(targs.optim, "value", targs.optim)) not in _ADAMW_OPTIMS:
            raise ValueError(
                f"OffloadTrainer: optim={getattr(targs.optim, 'value', targs.optim)!r} is not accepted; "
                f"accepted: {', '.join(repr(o) for o in _ADAMW_OPTIMS)} (ramstream's AdamW replaces it)"
            )
        chunked = opts.pop("chunked_loss", True)
        if not isinstance(chunked, bool):
            raise ValueError(f"OffloadTrainer: ramstream['chunked_loss']={chunked!r}; accepted: True, False")
        chunk = opts.pop("loss_chunk_size", 1024)
        if isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 1:
            raise ValueError(
                f"OffloadTrainer: ramstream['loss_chunk_size']={chunk!r}; accepted: an integer >= 1"
            )
        atomic = opts.pop("atomic_checkpoints", True)
        if not isinstance(atomic, bool):
            raise ValueError(
                f"OffloadTrainer: ramstream['atomic_checkpoints']={atomic!r}; accepted: True, False"
            )
        for name in ("max_grad_norm", "accumulation_steps"):
            if name in opts:
                raise ValueError(
                    f"OffloadTrainer: ramstream['{name}'] comes from TrainingArguments "
                    f"({'max_grad_norm' if name == 'max_grad_norm' else 'gradient_accumulation_steps'}); "
                    "set it there"
                )
        from ..options import WrapOptions

        WrapOptions.parse(**opts)  # an unknown option or value fails here, not at train()
        self.ramstream_options = opts
        self.chunked_loss, self.loss_chunk_size = chunked, chunk
        self.chunked_loss_used = 0  # training steps' micro-batches whose loss was chunked
        self.ramstream_callback = RamstreamCallback()
        self._ramstream_loss = None
        callbacks = list(kwargs.pop("callbacks", None) or []) + [self.ramstream_callback]
        with _PlacedByWrap(targs):
            super().__init__(*args, callbacks=callbacks, **kwargs)
        self.checkpoint_callback = AtomicCheckpoints(self) if atomic else None
        if atomic:  # right after DefaultFlowCallback: it sees the save decided, publishes before others read
            cbs = self.callback_handler.callbacks
            at = next(
                (i + 1 for i, cb in enumerate(cbs) if isinstance(cb, transformers.DefaultFlowCallback)), 0
            )
            cbs.insert(at, self.checkpoint_callback)

    def train(self, resume_from_checkpoint=None, *args, **kwargs):
        """transformers.Trainer.train; a checkpoint to resume from is checked before anything
        loads (hf_checkpoints.check_resume: a damaged file is refused with the model untouched);
        if it raises during a checkpoint save, args.output_dir is restored (it pointed at the
        staging folder for the save)."""
        from .hf_checkpoints import check_resume

        check_resume(self, resume_from_checkpoint)
        try:
            return super().train(resume_from_checkpoint, *args, **kwargs)
        finally:
            if self.checkpoint_callback is not None:
                self.checkpoint_callback.restore(self.args)

    # -- the optimizer: the stock AdamW groups, wrapped ---------------------------------------
    def create_optimizer(self, model=None):
        from ..optim import OffloadAdamW

        if isinstance(self.optimizer, OffloadAdamW):
            return self.optimizer
        opt_model = self.model if model is None else model
        base = super().create_optimizer(model)
        a = self.args
        opts = dict(self.ramstream_options)
        opts["accumulation_steps"] = int(a.gradient_accumulation_steps)
        opts.setdefault("skip_nonfinite", True)  # a NaN batch skips its step with a warning
        if a.max_grad_norm is not None and a.max_grad_norm > 0:
            opts["max_grad_norm"] = float(a.max_grad_norm)
        else:  # the Trainer still measures the norm (clip_grad_norm_ with inf): updates wait for step()
            opts.setdefault("eager_updates", False)
        # the plan counts the step the Trainer runs: its batch, and the loss compute_loss uses
        opts.setdefault("batch", int(a.per_device_train_batch_size))
        opts.setdefault("loss", "chunked" if self.chunked_loss else "dense")
        if opts.get("device") is None:  # the Trainer's device: a model still on the CPU is placed there
            opts["device"] = "cpu" if a.use_cpu else str(a.device)
        target = opt_model if getattr(opt_model, "_ramstream", None) is None else None
        if target is None:
            raise ValueError("OffloadTrainer: the model is already wrapped; pass the unwrapped model")
        _, self.optimizer = wrap(opt_model, base, **opts)
        return self.optimizer

    # -- the loss: chunked unless turned off or the model's logits are not plain ------------------
    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        if (
            not self.chunked_loss
            or return_outputs  # evaluation wants the logits
            or "labels" not in inputs
            or self.label_smoother is not None
            or self.compute_loss_func is not None
        ):
            return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
        if self._ramstream_loss is None:
            self._ramstream_loss = CausalLMLoss(self.accelerator.unwrap_model(model), self.loss_chunk_size)
            if self._ramstream_loss.reason:
                logger.info("ramstream: the model's own loss is used: %s", self._ramstream_loss.reason)
        if self._ramstream_loss.reason:
            return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
        inputs = dict(inputs)
        labels = inputs.pop("labels")
        kw = {"num_items_in_batch": num_items_in_batch} if self.model_accepts_loss_kwargs else {}
        with self.accelerator.autocast():
            loss = self._ramstream_loss(labels, **kw, **inputs)
        self.chunked_loss_used += 1
        if (
            self.args.average_tokens_across_devices
            and self.model_accepts_loss_kwargs
            and num_items_in_batch is not None
        ):
            loss = loss * self.accelerator.num_processes
        return loss

    # -- a step larger than the plan: re-planned, then re-run once --------------------------------
    def training_step(self, model, inputs, num_items_in_batch=None):
        """transformers.Trainer.training_step; a step refused with PlanOutOfMemoryError(replanned=
        True) (runtime/tokens.py: the plan now recomputes more blocks; nothing ran, weights and
        optimizer state as before) runs once more, as is; a second refusal, or one that changed
        nothing (replanned=False), propagates."""
        from ..runtime.tokens import PlanOutOfMemoryError

        try:
            return super().training_step(model, inputs, num_items_in_batch)
        except PlanOutOfMemoryError as e:
            if not e.replanned:
                raise
            logger.warning("ramstream: %s; re-running the step", str(e).splitlines()[0])
        # outside the except clause: the refused forward's frames are released before the re-run
        return super().training_step(model, inputs, num_items_in_batch)

    # -- logs: ramstream's figures on every training log -----------------------------------------
    def log(self, logs: dict, start_time=None) -> None:
        from ..optim import OffloadAdamW

        opt = getattr(self.optimizer, "optimizer", self.optimizer)  # accelerate's wrapper
        if "loss" in logs and isinstance(opt, OffloadAdamW) and not opt._closed:
            target = (
                self.model if getattr(self.model, "_ramstream", None) is not None else _unpeft(self.model)
            )
            logs = {**logs, **self.ramstream_callback.log_figures(target, opt)}
        super().log(logs, start_time)


class TrainStreamTrainer(OffloadTrainer):
    """OffloadTrainer under TrainStream's name: trainstream={...} is ramstream={...}."""

    def __init__(
        self, *args, trainstream: dict | None = None, ramstream: dict | None = None, **kwargs
    ) -> None:
        if trainstream is not None and ramstream is not None:
            raise ValueError("TrainStreamTrainer: pass trainstream= or ramstream=, not both")
        if trainstream is not None and not isinstance(trainstream, dict):
            raise TypeError(
                f"TrainStreamTrainer: trainstream= must be a dict of wrap() options, got {type(trainstream).__name__}"
            )
        super().__init__(*args, ramstream=trainstream if trainstream is not None else ramstream, **kwargs)

    # TrainStream's public attributes (chunked_loss, loss_chunk_size and chunked_loss_used are
    # OffloadTrainer's own, under the same names)
    @property
    def trainstream_config(self) -> dict:
        """The wrap() options given (trainstream= or ramstream=), without the Trainer's own keys
        (chunked_loss, loss_chunk_size, atomic_checkpoints): ramstream_options."""
        return self.ramstream_options

    @property
    def ts_optimizer(self):
        """The OffloadAdamW once create_optimizer() ran (train() runs it), else None."""
        from ..optim import OffloadAdamW

        opt = getattr(self.optimizer, "optimizer", self.optimizer)  # accelerate's wrapper
        return opt if isinstance(opt, OffloadAdamW) else None
