"""ModelShape: what the planner needs to know about a model (bytes, parameters, saved activations and
flops of each block and of the parts around the stack), built from an nn.Module, a built-in GPT
size or a Hugging Face (Llama / Qwen2 / Mistral) config, with no GPU and no training.

Saved activations (per token, per block; the estimate ``from_gpt`` / ``from_hf_config`` use and
``from_model`` uses unless ``act_bytes`` is given). A pre-norm transformer block with fused
norms and flash / SDPA attention saves, in the activation dtype (``a`` bytes, the working dtype):

    norm 1 input x and output             2 d
    q, k, v (SDPA saves them)             d + 2 kv        (kv = KV heads x head dim; GPT: kv = d)
    attention output (o-proj input)       d               (SDPA's own copy of it is the same tensor)
    norm 2 input and output               2 d
    MLP, GELU (GPT):  fc out, GELU out    2 f
    MLP, SwiGLU:      gate, up, silu(gate), product       4 f
    LoRA rank r on the 7 projections      7 r             (each adapter's A output)

    act_bytes_per_token = a * (6 d + 2 kv + m f + 7 r) + 4 * heads (attention log-sum-exp, fp32)
                          + 16 (fp32 mean / rstd of the two norms)

so a GPT block (f = 4 d) saves 16 d a + 4 heads + 16 bytes per token. With recompute only the
block input is kept: ``boundary_bytes_per_token = a * d``. Under bf16 autocast of an fp32 GPT
(``autocast="bf16"``) the residual stream and LayerNorms stay fp32 and the matmul inputs and
outputs are bf16: 44 d bytes per token (norm inputs and outputs 4 x 4 d, their bf16 casts 2 x 2 d,
qkv 6 d, attention output 2 d, fc and GELU outputs 2 x 8 d), the block input 4 d; autocast also
keeps a bf16 copy of every matmul weight it casts until the forward ends
(``ModelShape.autocast_cache_bytes``). Logits: ``dense`` keeps the logits
(a bytes), their fp32 copy (4) and, in backward, the fp32 gradient (4): ``V (a + 8)`` bytes per
token; ``chunked`` (ramstream.chunked_cross_entropy, 1024 tokens at a time) the same for 1024
tokens at most.

Flops per token: a forward matmul with an n-parameter weight is 2 n; backward is 2 n for the
input gradient plus 2 n for the weight gradient when the weight is trained. Causal attention
adds 2 seq d forward and 4 seq d backward.

Eager ops per forward (``fwd_ops``, for the step-time model's host-side cost per op): a GPT block
launches about 20 (4 matmuls, their weight and bias casts under autocast, 2 LayerNorms, SDPA, GELU,
2 residual adds, a layout copy); a Llama / Qwen2 block 23 + 10 (RMSNorms of 8 ops, 7 matmuls,
RoPE, SDPA with its copies, SiLU and product, residual adds) and 6 per LoRA adapter (its two
matmuls, their weight casts, scale, add).
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import asdict, dataclass, field, replace

_DTYPE_BYTES = {"float32": 4, "fp32": 4, "bfloat16": 2, "bf16": 2, "float16": 2, "fp16": 2}
_CANON = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}
LOSS_CHUNK = 1024  # tokens per chunk of ramstream.chunked_cross_entropy (its default)

# Built-in GPT sizes (the bench/train/gpt.py architecture: learned positions, LayerNorm with
# bias, biased linears, GELU MLP of 4 d, untied head).
GPT_SIZES = {
    "125m": dict(d=768, layers=12, heads=12),
    "350m": dict(d=1024, layers=24, heads=16),
    "1.3b": dict(d=2048, layers=24, heads=16),
    "1.8b": dict(d=2048, layers=32, heads=16),
    "6.85b": dict(d=4096, layers=32, heads=32),
}


def _dtype_name(dtype) -> str:
    """'float32' / 'bfloat16' / 'float16' from a string or a torch dtype; ValueError otherwise."""
    name = str(dtype).replace("torch.", "")
    if name not in _DTYPE_BYTES:
        raise ValueError(
            f"ModelShape: dtype={dtype!r} is not accepted; accepted: 'float32', 'fp32', 'bfloat16', "
            "'bf16', 'float16', 'fp16' or the torch dtypes"
        )
    return _CANON.get(name, name)


def _positive_int(where: str, name: str, v, lo: int = 1) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or v < lo:
        raise ValueError(f"{where}: {name} must be an int >= {lo}, got {v!r}")
    return v


@dataclass(frozen=True)
class BlockShape:
    """One block (or the part before / after the stack) for one token of the shape's batch x seq.

    trained_bytes / frozen_bytes: parameter bytes as stored (working dtype); frozen_matrix_numel:
    the frozen parameters in weight matrices (what int8 / NF4 can quantize); act_bytes_per_token:
    saved activations when kept; boundary_bytes_per_token: what recompute keeps; fwd/bwd flops per
    token at the shape's seq; attn_flops_per_seq: the part of fwd flops per token that grows with
    seq (bwd has twice that).
    """

    name: str
    trained_numel: int = 0
    frozen_numel: int = 0
    trained_bytes: int = 0
    frozen_bytes: int = 0
    frozen_matrix_numel: int = 0
    act_bytes_per_token: float = 0.0
    boundary_bytes_per_token: float = 0.0
    fwd_flops_per_token: float = 0.0
    bwd_flops_per_token: float = 0.0
    attn_flops_per_seq: float = 0.0
    matrix_numel: int = 0  # parameters in matmul weights (what autocast casts)
    fwd_ops: int = 0  # eager ops one forward launches (module docstring)

    @property
    def weight_bytes(self) -> int:
        return self.trained_bytes + self.frozen_bytes


@dataclass(frozen=True)
class ModelShape:
    """What the planner needs about a model: the block stack, the parts before (embeddings) and
    after it (final norm, head), and the loss's logits, for `batch` x `seq` tokens per step.
    Immutable; with_tokens() gives the same model at another batch / seq."""

    name: str
    blocks: tuple[BlockShape, ...]
    embed: BlockShape
    head: BlockShape
    batch: int
    seq: int
    dtype: str = "bfloat16"
    vocab: int = 0
    loss: str = "dense"
    hidden: int = 0
    notes: tuple[str, ...] = field(default_factory=tuple)
    autocast: str | None = None  # "bfloat16" when an fp32 model trains under bf16 autocast

    @property
    def autocast_cache_bytes(self) -> int:
        """bf16 copies of the matmul weights autocast keeps during the forward (0 without autocast
        or for a low-precision model); the chunked loss casts the head itself, outside the cache."""
        return self.autocast_cache_bytes_without(())

    def autocast_cache_bytes_without(self, blocks) -> int:
        """autocast_cache_bytes less the blocks in `blocks`: wrap() clears the cache after each
        recomputed or streamed block (their casts have no other holder)."""
        if not self.autocast or self.elem_bytes <= 2:
            return 0
        skip = set(blocks)
        n = sum(b.matrix_numel for i, b in enumerate(self.blocks) if i not in skip)
        return 2 * (n + (self.head.matrix_numel if self.loss == "dense" else 0))

    @property
    def tokens(self) -> int:
        return self.batch * self.seq

    @property
    def elem_bytes(self) -> int:
        """Bytes of one element of the working dtype (weights, gradients, activations)."""
        return _DTYPE_BYTES[self.dtype]

    @property
    def parts(self) -> tuple[BlockShape, ...]:
        return (self.embed, *self.blocks, self.head)

    @property
    def trained_numel(self) -> int:
        return sum(p.trained_numel for p in self.parts)

    @property
    def frozen_numel(self) -> int:
        return sum(p.frozen_numel for p in self.parts)

    @property
    def numel(self) -> int:
        return self.trained_numel + self.frozen_numel

    @property
    def weight_bytes(self) -> int:
        return sum(p.weight_bytes for p in self.parts)

    def act_bytes(self, i: int) -> int:
        """Saved activation bytes of block i for one step (kept)."""
        return int(math.ceil(self.blocks[i].act_bytes_per_token * self.tokens))

    def boundary_bytes(self, i: int) -> int:
        """Bytes block i keeps when it is recomputed (its input) for one step."""
        return int(math.ceil(self.blocks[i].boundary_bytes_per_token * self.tokens))

    @property
    def act_elem_bytes(self) -> int:
        """Bytes of one activation element: the autocast dtype's, else the working dtype's."""
        return 2 if self.autocast else self.elem_bytes

    @property
    def logits_bytes(self) -> int:
        """Device bytes the loss needs for its logits at its peak (see the module docstring)."""
        t = self.tokens if self.loss == "dense" else min(self.tokens, LOSS_CHUNK)
        return t * self.vocab * (self.act_elem_bytes + 8)

    @property
    def outside_act_bytes(self) -> int:
        """Saved activations of the parts around the stack (final norm, head input) for one step."""
        return int(math.ceil((self.embed.act_bytes_per_token + self.head.act_bytes_per_token) * self.tokens))

    def with_tokens(self, batch: int | None = None, seq: int | None = None) -> "ModelShape":
        """The same model at another batch and / or seq (activations scale with tokens, attention
        flops with seq)."""
        b = _positive_int("ModelShape.with_tokens", "batch", self.batch if batch is None else batch)
        s = _positive_int("ModelShape.with_tokens", "seq", self.seq if seq is None else seq)

        def re(p: BlockShape) -> BlockShape:
            dfwd = p.attn_flops_per_seq * (s - self.seq)
            return replace(
                p,
                fwd_flops_per_token=p.fwd_flops_per_token + dfwd,
                bwd_flops_per_token=p.bwd_flops_per_token + 2 * dfwd,
            )

        return replace(
            self,
            batch=b,
            seq=s,
            blocks=tuple(re(p) for p in self.blocks),
            embed=re(self.embed),
            head=re(self.head),
        )

    def to_dict(self) -> dict:
        return asdict(self)

    # ---- constructors -----------------------------------------------------------------------

    @classmethod
    def gpt(
        cls, size, *, batch: int, seq: int, dtype="bfloat16", vocab: int = 50304, loss: str = "dense",
        autocast=None,
    ) -> "ModelShape":  # fmt: skip
        """A GPT of the built-in sizes ("125m", "350m", "1.3b", "1.8b": d_model 2048 x 32 blocks,
        "6.85b": d_model 4096 x 32 blocks), or a dict(d=, layers=, heads=[, ctx=]). Everything is
        trained; the position table has max(1024, seq) rows (or ctx). autocast: None or "bf16" /
        "bfloat16" (an fp32 model trained under torch.autocast(dtype=torch.bfloat16))."""
        where = "ModelShape.gpt"
        if isinstance(size, str):
            if size.lower() not in GPT_SIZES:
                raise ValueError(
                    f"{where}: size={size!r} is not accepted; accepted: {', '.join(GPT_SIZES)} or a dict(d=, layers=, heads=)"
                )
            cfg, name = dict(GPT_SIZES[size.lower()]), f"gpt-{size.lower()}"
        elif (
            isinstance(size, dict)
            and {"d", "layers", "heads"} <= set(size)
            and set(size) <= {"d", "layers", "heads", "ctx"}
        ):
            cfg, name = dict(size), f"gpt-d{size['d']}x{size['layers']}"
        else:
            raise ValueError(
                f"{where}: size={size!r} is not accepted; accepted: {', '.join(GPT_SIZES)} or a dict(d=, layers=, heads=[, ctx=])"
            )
        d, layers, heads = (_positive_int(where, k, cfg[k]) for k in ("d", "layers", "heads"))
        ctx = _positive_int(where, "ctx", cfg.get("ctx", max(1024, seq)))
        return cls._transformer(
            name, d=d, f=4 * d, kv=d, heads=heads, layers=layers, vocab=vocab, batch=batch, seq=seq, dtype=dtype,
            loss=loss, gated=False, norm_bias=True, qkv_bias=True, mlp_bias=True, o_bias=True, tied=False,
            pos_rows=ctx, lora=None, autocast=autocast,
        )  # fmt: skip

    @classmethod
    def from_hf_config(
        cls, config, *, batch: int, seq: int, dtype="bfloat16", lora: int | None = None, loss: str = "dense"
    ) -> "ModelShape":
        """A Llama / Qwen2 / Mistral style decoder from its config.json (a dict, or a path to the file
        or its folder): hidden_size, intermediate_size, num_hidden_layers, num_attention_heads,
        num_key_value_heads (default: the attention heads), vocab_size, tie_word_embeddings
        (default False). Qwen2 has q/k/v biases (as does attention_bias=True). lora=R: rank-R
        adapters on q, k, v, o, gate, up, down are trained, every other weight is frozen."""
        where = "ModelShape.from_hf_config"
        if isinstance(config, (str, os.PathLike)):
            path = os.fspath(config)
            if os.path.isdir(path):
                path = os.path.join(path, "config.json")
            with open(path, encoding="utf-8") as f:
                config = json.load(f)
        if not isinstance(config, dict):
            raise TypeError(
                f"{where}: config must be a dict or a path to config.json, got {type(config).__name__}"
            )
        need = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "vocab_size")
        missing = [k for k in need if k not in config]
        if missing:
            raise ValueError(
                f"{where}: config lacks {', '.join(missing)} (a Llama / Qwen2 / Mistral config has them)"
            )
        d, f, layers, heads, vocab = (_positive_int(where, k, config[k]) for k in need)
        kv_heads = _positive_int(where, "num_key_value_heads", config.get("num_key_value_heads") or heads)
        head_dim = config.get("head_dim") or d // heads
        if lora is not None:
            lora = _positive_int(where, "lora", lora)
        qkv_bias = config.get("model_type") == "qwen2" or bool(config.get("attention_bias", False))
        name = config.get("_name_or_path") or config.get("model_type") or "hf"
        return cls._transformer(
            str(name), d=d, f=f, kv=kv_heads * head_dim, heads=heads, layers=layers, vocab=vocab, batch=batch,
            seq=seq, dtype=dtype, loss=loss, gated=True, norm_bias=False, qkv_bias=qkv_bias, mlp_bias=False,
            o_bias=bool(config.get("attention_bias", False)) and config.get("model_type") != "qwen2",
            tied=bool(config.get("tie_word_embeddings", False)), pos_rows=0, lora=lora, q_dim=heads * head_dim,
        )  # fmt: skip

    @classmethod
    def _transformer(cls, name, *, d, f, kv, heads, layers, vocab, batch, seq, dtype, loss, gated, norm_bias,
                     qkv_bias, mlp_bias, o_bias, tied, pos_rows, lora, q_dim=None, autocast=None) -> "ModelShape":  # fmt: skip
        where = "ModelShape"
        if autocast is not None:
            if autocast not in ("bf16", "bfloat16"):
                raise ValueError(
                    f"{where}: autocast={autocast!r} is not accepted; accepted: None, 'bf16', 'bfloat16'"
                )
            autocast = "bfloat16" if _DTYPE_BYTES[_dtype_name(dtype)] == 4 else None
        batch, seq = _positive_int(where, "batch", batch), _positive_int(where, "seq", seq)
        dt = _dtype_name(dtype)
        if loss not in ("dense", "chunked"):
            raise ValueError(f"{where}: loss={loss!r} is not accepted; accepted: 'dense', 'chunked'")
        a = _DTYPE_BYTES[dt]
        q = q_dim or d
        # weight matrices (in, out) of the block
        mats = [(d, q), (d, kv), (d, kv), (q, d)] + ([(d, f), (d, f), (f, d)] if gated else [(d, f), (f, d)])
        if not gated:  # GPT: one fused qkv matrix and biases throughout
            mats = [(d, q + 2 * kv), (q, d), (d, f), (f, d)]
        mat_numel = sum(i * o for i, o in mats)
        vec = (4 * d if norm_bias else 2 * d) + ((q + 2 * kv) if qkv_bias else 0) + (d if o_bias else 0)
        vec += f + d if mlp_bias else 0
        attn = 2 * d  # causal attention forward flops per token per unit of seq
        lora_numel = 0
        if lora:
            adapted = mats if gated else [(d, q), (d, kv), (d, kv), (q, d), (d, f), (d, f), (f, d)]
            lora_numel = lora * sum(i + o for i, o in adapted)
        trained_mm = lora_numel if lora else mat_numel
        amp = autocast is not None and gated is False
        act_tok = a * (6 * d + 2 * kv + (4 if gated else 2) * f + 7 * (lora or 0)) + 4 * heads + 16
        if amp:  # fp32 residual stream and norms, bf16 matmul inputs and outputs (module docstring)
            act_tok = 4 * 4 * d + 2 * 2 * d + 2 * (q + 2 * kv) + 2 * d + 2 * 2 * f + 4 * heads + 16
        n_mats = len(mats) if gated else 4
        ops = (2 * 8 + 7 + 10 + 6 + 1 + 2 + 2 + 6 * 7 * bool(lora)) if gated else 20
        block = BlockShape(
            name="block",
            matrix_numel=mat_numel,
            fwd_ops=ops if n_mats else 0,
            trained_numel=(lora_numel if lora else mat_numel + vec),
            frozen_numel=(mat_numel + vec if lora else 0),
            trained_bytes=(lora_numel if lora else mat_numel + vec) * a,
            frozen_bytes=(mat_numel + vec if lora else 0) * a,
            frozen_matrix_numel=mat_numel if lora else 0,
            act_bytes_per_token=act_tok,
            boundary_bytes_per_token=float(a * d),
            fwd_flops_per_token=2.0 * (mat_numel + lora_numel) + attn * seq,
            bwd_flops_per_token=2.0 * (mat_numel + lora_numel) + 2.0 * trained_mm + 2 * attn * seq,
            attn_flops_per_seq=float(attn),
        )
        emb_numel = vocab * d + pos_rows * d
        head_mat = 0 if tied else vocab * d
        frozen_outside = bool(lora)
        embed = BlockShape(
            name="embed",
            trained_numel=0 if frozen_outside else emb_numel,
            frozen_numel=emb_numel if frozen_outside else 0,
            trained_bytes=0 if frozen_outside else emb_numel * a,
            frozen_bytes=emb_numel * a if frozen_outside else 0,
        )
        head_numel = head_mat + (2 * d if norm_bias else d)
        head = BlockShape(
            name="head",
            matrix_numel=vocab * d,
            trained_numel=0 if frozen_outside else head_numel,
            frozen_numel=head_numel if frozen_outside else 0,
            trained_bytes=0 if frozen_outside else head_numel * a,
            frozen_bytes=head_numel * a if frozen_outside else 0,
            act_bytes_per_token=2.0 * (4 if amp else a) * d
            + 8,  # final norm input and output, its fp32 rstd / mean
            fwd_flops_per_token=2.0 * vocab * d,
            bwd_flops_per_token=(2.0 if frozen_outside else 4.0) * vocab * d,
        )
        notes = (
            f"d={d} f={f} kv={kv} heads={heads} layers={layers} vocab={vocab}"
            + (f" lora r={lora}" if lora else ""),
        )
        return cls(name=name, blocks=(block,) * layers, embed=embed, head=head, batch=batch, seq=seq, dtype=dt,
                   vocab=vocab, loss=loss, hidden=d, notes=notes, autocast="bfloat16" if amp else None)  # fmt: skip

    @classmethod
    def from_model(
        cls, model, blocks=None, *, batch: int, seq: int, dtype=None, act_bytes=None, loss: str = "dense"
    ) -> "ModelShape":
        """The shape of an nn.Module: parameter counts and bytes measured from its parameters
        (each counted once, trained when requires_grad), `blocks` the repeated stack (None: found
        by ramstream's find_blocks). act_bytes: saved activation bytes per block for one step (an
        int for every block, or a list); None estimates them by the module docstring's formula
        from the block's Linear shapes (d = the most common in_features, f = the largest
        dimension, SwiGLU when two Linears output f). Parameters of nn.Embedding modules form the
        part before the stack, every other parameter outside the blocks the part after it."""
        import torch.nn as nn

        from ..blocks import check_blocks, find_blocks

        where = "ModelShape.from_model"
        if not isinstance(model, nn.Module):
            raise TypeError(f"{where}: model must be an nn.Module, got {type(model).__name__}")
        batch, seq = _positive_int(where, "batch", batch), _positive_int(where, "seq", seq)
        blocks = find_blocks(model) if blocks is None else check_blocks(where, model, blocks)
        params = [p for p in model.parameters() if p.is_floating_point()]
        if dtype is None:
            dtype = params[0].dtype if params else "float32"
        dt = _dtype_name(dtype)
        a = _DTYPE_BYTES[dt]
        if loss not in ("dense", "chunked"):
            raise ValueError(f"{where}: loss={loss!r} is not accepted; accepted: 'dense', 'chunked'")
        tokens = batch * seq
        if act_bytes is not None:
            acts = [act_bytes] * len(blocks) if isinstance(act_bytes, int) else list(act_bytes)
            if len(acts) != len(blocks) or any(
                isinstance(x, bool) or not isinstance(x, int) or x < 0 for x in acts
            ):
                raise ValueError(
                    f"{where}: act_bytes must be an int >= 0 or a list of {len(blocks)} of them, got {act_bytes!r}"
                )
        seen: set[int] = set()

        def count(mods) -> tuple[dict, int, int]:
            """Parameter counts of the modules' own parameters (each parameter once over all
            calls), and the matmul parameters used (shared ones in every use; Embedding excluded)."""
            out = dict(
                trained_numel=0, frozen_numel=0, trained_bytes=0, frozen_bytes=0, frozen_matrix_numel=0
            )
            mm_all = mm_trained = 0
            for sub in mods:
                for p in sub.parameters(recurse=False):
                    if p.dim() >= 2 and not isinstance(sub, nn.Embedding):
                        mm_all += p.numel()
                        mm_trained += p.numel() if p.requires_grad else 0
                    if id(p) in seen:
                        continue
                    seen.add(id(p))
                    k = "trained" if p.requires_grad else "frozen"
                    out[f"{k}_numel"] += p.numel()
                    out[f"{k}_bytes"] += p.numel() * p.element_size()
                    if not p.requires_grad and p.dim() >= 2:
                        out["frozen_matrix_numel"] += p.numel()
            return out, mm_all, mm_trained

        shaped = []
        for i, blk in enumerate(blocks):
            c, mm, mm_t = count(list(blk.modules()))
            lin = [m for m in blk.modules() if isinstance(m, nn.Linear)]
            ins = [m.in_features for m in lin]
            d = max(set(ins), key=ins.count) if ins else 1
            f = max([max(m.in_features, m.out_features) for m in lin], default=d)
            gated = sum(1 for m in lin if m.out_features == f) >= 2
            if act_bytes is not None:
                per_tok = acts[i] / tokens
            else:
                per_tok = a * (8 * d + (4 if gated else 2) * f) + 16
            leaves = sum(1 for m in blk.modules() if next(m.children(), None) is None)
            shaped.append(BlockShape(
                name=f"block{i}", act_bytes_per_token=per_tok, boundary_bytes_per_token=float(a * d),
                matrix_numel=mm, fwd_ops=2 * leaves,
                fwd_flops_per_token=2.0 * mm + 2 * d * seq, bwd_flops_per_token=2.0 * mm + 2.0 * mm_t + 4 * d * seq,
                attn_flops_per_seq=2.0 * d, **c,
            ))  # fmt: skip
        in_blocks = {id(m) for b in blocks for m in b.modules()}
        embs = [m for m in model.modules() if isinstance(m, nn.Embedding) and id(m) not in in_blocks]
        c_emb, _, _ = count(embs)
        rest = [m for m in model.modules() if id(m) not in in_blocks and not isinstance(m, nn.Embedding)]
        c_rest, mm_rest, mm_rest_t = count(rest)
        hidden = shaped[0].boundary_bytes_per_token / a
        vocab = max((m.num_embeddings for m in embs), default=0)
        embed = BlockShape(name="embed", **c_emb)
        head = BlockShape(
            name="head", act_bytes_per_token=2.0 * a * hidden + 8, fwd_flops_per_token=2.0 * mm_rest,
            bwd_flops_per_token=2.0 * mm_rest + 2.0 * mm_rest_t, **c_rest,
        )  # fmt: skip
        name = type(model).__name__
        return cls(name=name, blocks=tuple(shaped), embed=embed, head=head, batch=batch, seq=seq, dtype=dt,
                   vocab=vocab, loss=loss, hidden=int(hidden))  # fmt: skip


from .wrap_rules import lora_like as _lora_like  # noqa: E402


def lora_like(shape: ModelShape) -> bool:
    """Whether the shape's blocks are LoRA-like (wrap_rules.lora_like: less than LORA_LIKE of their
    elements train; policy.py's decisions and timing.py's step model both ask)."""
    trained = sum(b.trained_numel for b in shape.blocks)
    return _lora_like(trained, sum(b.trained_numel + b.frozen_numel for b in shape.blocks))
