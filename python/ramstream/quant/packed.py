"""Packed int8/NF4 storage of one frozen Linear (or Hugging Face Conv1D) weight, expanded right
before use: QuantLinearFn dequantizes in forward and again in backward, saving only the codes."""

from __future__ import annotations

import threading
import weakref

import torch
import torch.nn as nn

from .._native import lib

__all__ = [
    "FORMATS",
    "QuantLinearFn",
    "is_quantized",
    "packed_buffers",
    "quantize_module_",
    "dequantize_module_",
]

FORMATS = ("int8", "nf4")

_CODES, _ABSMAX = "weight_codes", "weight_absmax"


class _ExpandBuffers:
    """One reused full-precision buffer per (device, dtype, shape): what a layer's weight expands
    into right before it runs. Reuse is safe because the expanded weight is read only by the op
    that follows on the same stream (QuantLinearFn saves the codes, never the buffer). One lock:
    the autograd engine's device threads and the main thread may both expand."""

    def __init__(self) -> None:
        self._bufs: dict[tuple, torch.Tensor] = {}
        self.lock = threading.RLock()

    def get(self, device: torch.device, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
        key = (device, dtype, shape)
        buf = self._bufs.get(key)
        if buf is None:
            buf = self._bufs[key] = torch.empty(shape, dtype=dtype, device=device)
        return buf

    def nbytes(self) -> int:
        return sum(b.nbytes for b in self._bufs.values())

    def clear(self) -> None:
        with self.lock:
            self._bufs.clear()
        LAST_READ.drop()


EXPAND = _ExpandBuffers()


def _dequantize_into(module: nn.Module, out: torch.Tensor) -> torch.Tensor:
    """Writes the module's dequantized weight into ``out`` (the host kernel on the CPU, the CUDA
    kernel on torch's current stream on a GPU) and returns it."""
    codes, absmax = getattr(module, _CODES), getattr(module, _ABSMAX)
    nf4 = module.quant_format == "nf4"
    if codes.is_cuda:
        from ..ops import cuda as _cuda  # noqa: PLC0415

        _cuda.cuda_ready("dequantize_nf4" if nf4 else "dequantize_int8")
        kernel = lib().cuda_dequantize_nf4 if nf4 else lib().cuda_dequantize_int8
        stream = torch.cuda.current_stream(codes.device).cuda_stream
        _cuda._launch(
            codes.device, kernel, codes, absmax, out, module.quant_block_size, stream, codes.device.index
        )
    else:
        (lib().dequantize_nf4 if nf4 else lib().dequantize_int8)(codes, absmax, out, module.quant_block_size)
    return out


def expand_weight(module: nn.Module, *, reuse: bool) -> torch.Tensor:
    """The module's weight in its original dtype and shape on the codes' device: in the shared
    per-shape buffer (``reuse``; valid until the next expansion of that shape) or a new tensor."""
    codes = getattr(module, _CODES)
    shape, dtype = module.quant_shape, module.quant_dtype
    if not reuse:
        return _dequantize_into(module, torch.empty(shape, dtype=dtype, device=codes.device))
    return _dequantize_into(module, EXPAND.get(codes.device, dtype, shape))


class _LastRead:
    """The weight that the ``weight`` property expanded last, served again while nothing changed.

    Code that asks a layer only for its weight's device, dtype or shape reads the whole property:
    peft's get_peft_model reads each base layer's ``weight`` about 20 times (dispatch, in/out
    features, the adapters' device, once per adapter submodule), which expanded every weight 20
    times (4.4 s per Llama-3-70B layer on 16 cores). Here the reads that follow one another get a
    new tensor (``detach()``) sharing the memory of one expansion, as long as the module, its codes
    and absmax (objects and versions) and the expanded values (version: an in-place write through
    any read) are unchanged; a write through ``.data`` (torch counts no version) is seen by the
    reads that follow it until the expansion is let go. It holds one weight at most, CPU ones only
    (never VRAM; nor under inference_mode, whose tensors have no version), and lets it go at the
    next quantized forward (QuantLinearFn, FusedQuantLoraFn), dequantize_module_ or EXPAND.clear().
    """

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self._weight: torch.Tensor | None = None
        self._refs: tuple = ()  # weak references to the module, its codes and absmax
        self._state: tuple = ()

    def read(self, module: nn.Module) -> torch.Tensor:
        """The module's expanded weight as a new tensor (requires_grad False)."""
        codes, absmax = getattr(module, _CODES), getattr(module, _ABSMAX)
        if codes.device.type != "cpu" or torch.is_inference_mode_enabled():
            return expand_weight(module, reuse=False)  # an inference tensor has no version
        objs = (module, codes, absmax)
        state = (codes._version, absmax._version, module.quant_format, module.quant_block_size)
        state += (module.quant_shape, module.quant_dtype)
        with self.lock:
            w = self._weight
            if (
                w is not None
                and self._state == state + (w._version,)
                and all(r() is o for r, o in zip(self._refs, objs))
            ):
                return w.detach()
        w = expand_weight(module, reuse=False)
        with self.lock:
            self._weight, self._refs = w, tuple(weakref.ref(o) for o in objs)
            self._state = state + (w._version,)
        return w.detach()

    def drop(self) -> None:
        """Lets the kept expansion go (the reads already handed out keep their memory)."""
        if self._weight is not None:
            with self.lock:
                self._weight, self._refs, self._state = None, (), ()


LAST_READ = _LastRead()


class QuantLinearFn(torch.autograd.Function):
    """y = x @ W^T + b (Linear) or x @ W + b (Conv1D, ``transposed``) with W expanded from the
    module's packed codes in forward and expanded again in backward. Saves no tensor of its own:
    backward reads the codes from the module. Gradients flow to x and to a trained bias; the
    weight is frozen."""

    @staticmethod
    def forward(ctx, x, bias, module, transposed):  # noqa: D102
        ctx.module, ctx.transposed = module, transposed
        ctx.x_dtype = x.dtype
        LAST_READ.drop()
        with EXPAND.lock:
            w = expand_weight(module, reuse=True)
            if transposed:
                shape = x.shape[:-1] + (w.shape[1],)
                x2 = x.reshape(-1, x.shape[-1])
                y = torch.addmm(bias, x2, w) if bias is not None else x2.mm(w)
                return y.view(shape)
            return torch.nn.functional.linear(x, w, bias)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad):  # noqa: D102
        module = ctx.module
        gx = gb = None
        g2 = grad.reshape(-1, grad.shape[-1])
        if ctx.needs_input_grad[0]:
            with EXPAND.lock:
                w = expand_weight(module, reuse=True)
                if w.dtype != g2.dtype:
                    w = w.to(g2.dtype)
                gx = g2.mm(w.t() if ctx.transposed else w)
            gx = gx.view(grad.shape[:-1] + (gx.shape[-1],)).to(ctx.x_dtype)
        if ctx.needs_input_grad[1]:
            gb = g2.sum(0)
        return gx, gb, None, None


class _QuantMixin:
    """Mixed in front of nn.Linear / Conv1D on a quantized module (its class is swapped, as
    torch.nn.utils.parametrize does): ``weight`` becomes a read-only property that dequantizes
    into a new tensor (reads that follow one another may share one expansion's memory:
    _LastRead); forward runs QuantLinearFn."""

    @property
    def weight(self) -> torch.Tensor:
        return LAST_READ.read(self)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return QuantLinearFn.apply(x, self.bias, self, self.quant_transposed)

    def extra_repr(self) -> str:
        shape = "x".join(map(str, self.quant_shape))
        return f"{shape}, quantized={self.quant_format}, block_size={self.quant_block_size}, bias={self.bias is not None}"


_CLASSES: dict[type, type] = {}


def _quant_class(cls: type) -> type:
    if cls not in _CLASSES:
        _CLASSES[cls] = type(f"Quantized{cls.__name__}", (_QuantMixin, cls), {"_ramstream_base": cls})
    return _CLASSES[cls]


def is_quantized(module: nn.Module) -> bool:
    return isinstance(module, _QuantMixin)


def packed_buffers(module: nn.Module) -> list[tuple[nn.Module, str, torch.Tensor]]:
    """[(owner, buffer name, tensor)] of the packed codes and absmax of every quantized module in
    ``module`` (itself included), each once, in module order: what the weight streamer carries in
    a block's slabs next to its parameters."""
    out, seen = [], set()
    for m in module.modules():
        if is_quantized(m):
            for name in (_CODES, _ABSMAX):
                t = m._buffers.get(name)
                if t is not None and id(t) not in seen:
                    seen.add(id(t))
                    out.append((m, name, t))
    return out


def quantized_numel(module: nn.Module) -> int:
    """Elements of the full-precision weights that ``module``'s quantized modules pack."""
    n = 0
    for m in module.modules():
        if is_quantized(m):
            k = 1
            for d in m.quant_shape:
                k *= d
            n += k
    return n


def quantizable(module: nn.Module) -> str | None:
    """'linear' or 'conv1d' (transformers' Conv1D: weight (in, out)) for a module whose weight this
    file can pack, else None."""
    if is_quantized(module):
        return None
    w = module._parameters.get("weight") if isinstance(module, nn.Module) else None
    if w is None or w.dim() != 2:
        return None
    if isinstance(module, nn.Linear):
        return "linear"
    if type(module).__name__ == "Conv1D" and hasattr(module, "nf") and hasattr(module, "nx"):
        return "conv1d"
    return None


def _pack(weight: torch.Tensor, fmt: str, block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    from ..ops.quant import quantize_int8, quantize_nf4  # noqa: PLC0415

    host = weight.detach().to("cpu").contiguous()
    codes, absmax = (quantize_nf4 if fmt == "nf4" else quantize_int8)(host, block_size)
    return codes, absmax


def quantize_module_(
    module: nn.Module,
    fmt: str,
    block_size: int,
    weight: torch.Tensor | None = None,
    *,
    pin: bool = False,
    packed: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> int:
    """Replaces the module's weight parameter by packed codes + float32 absmax buffers (on the
    weight's device; pinned host memory when ``pin``) and returns their bytes. ``weight``: the
    values to pack instead of the module's own (load_model passes what it read; the module's
    weight may then be on the meta device). ``packed``: (codes, absmax) already made from
    ``weight`` (as _pack makes them; load_model packs in worker threads), installed as they are;
    ``weight`` then only gives the shape and dtype (a meta tensor will do). Nothing changes when
    packing raises."""
    kind = quantizable(module)
    if kind is None:
        raise TypeError(
            f"quantize_module_: {type(module).__name__} is not a Linear or Conv1D with a 2-D weight"
        )
    param = module._parameters["weight"]
    src = param if weight is None else weight
    if tuple(src.shape) != tuple(param.shape):
        raise ValueError(
            f"quantize_module_: weight has shape {tuple(src.shape)}, the module {tuple(param.shape)}"
        )
    if not src.is_floating_point():
        raise TypeError(f"quantize_module_: weight must be a float tensor, got {src.dtype}")
    device = src.device if src.device.type != "meta" else torch.device("cpu")
    codes, absmax = _pack(src, fmt, block_size) if packed is None else packed
    if device.type != "cpu":
        codes, absmax = codes.to(device), absmax.to(device)
    elif pin:
        codes, absmax = codes.pin_memory(), absmax.pin_memory()
    del module._parameters["weight"]
    module.register_buffer(_CODES, codes)
    module.register_buffer(_ABSMAX, absmax)
    module.quant_format, module.quant_block_size = fmt, block_size
    module.quant_shape, module.quant_dtype = tuple(param.shape), src.dtype
    module.quant_transposed = kind == "conv1d"
    module.quant_hooks = (
        module._register_state_dict_hook(_state_dict_hook),
        module._register_load_state_dict_pre_hook(_load_state_dict_pre_hook, with_module=True),
    )
    module.__class__ = _quant_class(type(module))
    return codes.nbytes + absmax.nbytes


def dequantize_module_(module: nn.Module) -> None:
    """Turns a quantized module back into its original class with a frozen weight parameter
    holding the dequantized values (on the codes' device)."""
    if not is_quantized(module):
        raise TypeError(f"dequantize_module_: {type(module).__name__} is not quantized")
    w = expand_weight(module, reuse=False)
    LAST_READ.drop()
    for h in module.quant_hooks:
        h.remove()
    module.__class__ = module._ramstream_base
    del module._buffers[_CODES], module._buffers[_ABSMAX]
    for name in (
        "quant_format",
        "quant_block_size",
        "quant_shape",
        "quant_dtype",
        "quant_transposed",
        "quant_hooks",
    ):
        delattr(module, name)
    rest = dict(module._parameters)  # the weight goes first again, as the module registered it
    module._parameters.clear()
    module._parameters["weight"] = nn.Parameter(w, requires_grad=False)
    module._parameters.update(rest)


def _state_dict_hook(module, state_dict, prefix, local_metadata):
    """Serves the dequantized weight under the original key, before the bias as nn.Linear has it."""
    state_dict.pop(prefix + _CODES, None)
    state_dict.pop(prefix + _ABSMAX, None)
    bias = state_dict.pop(prefix + "bias", None)
    state_dict[prefix + "weight"] = expand_weight(module, reuse=False)
    if bias is not None:
        state_dict[prefix + "bias"] = bias
    return state_dict


def _load_state_dict_pre_hook(
    module, state_dict, prefix, local_metadata, strict, missing, unexpected, errors
):
    """A state dict with a full-precision ``weight`` (what state_dict() serves) loads by packing it
    again in this module's format."""
    key = prefix + "weight"
    if key in state_dict and prefix + _CODES not in state_dict:
        w = state_dict.pop(key)
        if tuple(w.shape) != module.quant_shape:
            errors.append(
                f"size mismatch for {key}: copying a param with shape {tuple(w.shape)}, the quantized weight has shape {module.quant_shape}"
            )
            return
        codes, absmax = _pack(w.to(module.quant_dtype), module.quant_format, module.quant_block_size)
        state_dict[prefix + _CODES] = codes
        state_dict[prefix + _ABSMAX] = absmax
