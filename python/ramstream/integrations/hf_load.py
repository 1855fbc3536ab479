"""load_model(): a Hugging Face causal LM from local .safetensors files, read tensor by tensor and
quantized while reading (frozen block weights as int8/NF4), so the full-precision base never
exists in RAM at once; random_weights builds the shapes without a checkpoint."""

from __future__ import annotations

import contextlib

import torch
import torch.nn as nn

from ..ops.quant import quantize_into_
from ..quant.packed import quantizable, quantize_module_
from .hf_load_args import _parse, _resolve
from .safetensors_files import checkpoint_files, read_header
from .tensor_reads import (
    interleave,
    map_tensor,
    read_into,
    run_bounded,
    usable_cores,
    with_range,
)

__all__ = ["load_model"]

# Tensors are read by up to _WORKERS threads (no more than the usable cores) in pieces
# (block-aligned where they are packed); the bytes read and not yet turned into what the model
# keeps stay within 1/_WORKING_SHARE of the loaded model's size (at least _MIN_CAP, at most
# _WORKERS pieces of _CHUNK_BYTES), and a piece is at most that cap / workers, so that every
# worker has one: the peak RSS stays close to the model's own size. 8 workers: on the H200 host
# (16 cores) 4 left the pool waiting on mappings (1.09-1.21 s against 0.86-0.90 s for a
# 7B-shaped NF4 load; bench/train/probe_load.py).
_CHUNK_BYTES = 64 << 20
_WORKERS = 8
_WORKING_SHARE = 16
_MIN_CAP = 4 << 20
_MIN_PIECE = 1 << 16
# A tensor kept as it is stored (no cast, not packed) from this size on stays a private mapping of
# the file (tensor_reads.map_tensor), as from_pretrained leaves it, instead of being copied (the
# embeddings and head: 2.2 GB of a 7B model); smaller ones are copied (a mapping costs whole pages).
_SHARE_MIN = 1 << 20


def _available_ram() -> int:
    from ..hardware import host_memory  # noqa: PLC0415

    return host_memory()["available"]


@contextlib.contextmanager
def _params_on_meta():
    """Parameters registered while this runs live on the meta device (no memory); buffers are built
    normally, so the values models compute at construction (rotary frequencies) are real. The
    parameters are marked as initialised (``_is_hf_initialized``, which transformers' init
    functions honour): initialising a meta tensor computes nothing, yet costs about 0.3 ms a
    tensor (torch's Python decompositions), more than from_pretrained takes for the whole model."""
    orig = nn.Module.register_parameter

    def register(self, name, param):
        if param is not None and param.device.type != "meta":
            param = nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)
        if param is not None:
            param._is_hf_initialized = True
        orig(self, name, param)

    nn.Module.register_parameter = register
    try:
        yield
    finally:
        nn.Module.register_parameter = orig


def _skeleton(config, dtype, trust_remote_code):
    from transformers import AutoModelForCausalLM  # noqa: PLC0415

    with _params_on_meta():
        return AutoModelForCausalLM.from_config(config, dtype=dtype, trust_remote_code=trust_remote_code)


def _owners(model) -> dict[int, list[tuple[nn.Module, str, str]]]:
    """id(parameter or persistent buffer) -> [(module, attribute, full name)], tied ones together."""
    out: dict[int, list] = {}
    for mname, m in model.named_modules(remove_duplicate=False):
        pre = mname + "." if mname else ""
        for n, p in m._parameters.items():
            if p is not None:
                out.setdefault(id(p), []).append((m, n, pre + n))
        for n, b in m._buffers.items():
            if b is not None and n not in m._non_persistent_buffers_set:
                out.setdefault(id(b), []).append((m, n, pre + n))
    return out


def _decide(fmt, model, targets, block, ram_fraction):
    """'none', 'int8' or 'nf4' for quantize='auto': quantize only if the model in its dtype does not
    fit in ram_fraction of the available RAM (int8 before NF4); MemoryError when NF4 does not either."""
    seen, total, packable = set(), 0, 0
    for p in model.parameters():
        if id(p) not in seen:
            seen.add(id(p))
            total += p.numel() * p.element_size()
    for m in targets:
        packable += m.weight.numel()
    w_bytes = sum(m.weight.numel() * m.weight.element_size() for m in targets)
    sizes = {"none": total}
    sizes["int8"] = total - w_bytes + packable * (1 + 4 / block)
    sizes["nf4"] = total - w_bytes + packable * (0.5 + 4 / block)
    if fmt != "auto":
        return fmt, sizes
    limit = ram_fraction * _available_ram()
    for f in ("none", "int8", "nf4"):
        if sizes[f] <= limit:
            return f, sizes
    gib = 2**30
    raise MemoryError(
        f"load_model(): the model does not fit: {sizes['none'] / gib:.2f} GiB in its dtype, "
        f"{sizes['int8'] / gib:.2f} as int8, {sizes['nf4'] / gib:.2f} as NF4 > ram_fraction "
        f"{ram_fraction} x {_available_ram() / gib:.2f} GiB available = {limit / gib:.2f} GiB"
    )


def _plan(headers, owners, prefix):
    """{file: [(key, owners entry id)]} and the model names no file provides."""
    by_name = {o[2]: pid for pid, os_ in owners.items() for o in os_}
    plan, found = {}, set()
    for path, (header, _start) in headers.items():
        rows = []
        for key in header:
            name = key if key in by_name else None
            if name is None and prefix:
                alt = key[len(prefix) + 1 :] if key.startswith(prefix + ".") else f"{prefix}.{key}"
                name = alt if alt in by_name else None
            if name is None:
                continue  # not part of this model (e.g. an old checkpoint's buffers)
            rows.append((key, by_name[name]))
            found.add(by_name[name])
        plan[path] = rows
    return plan, [os_[0][2] for pid, os_ in owners.items() if pid not in found]


def _place(entries, value, requires_grad):
    for m, attr, _ in entries:
        if attr in m._parameters:
            m._parameters[attr] = (
                value if isinstance(value, nn.Parameter) else nn.Parameter(value, requires_grad)
            )
            value = m._parameters[attr]
        else:
            m._buffers[attr] = value


def _torch_dtype(name: str) -> torch.dtype:
    return {
        "F64": torch.float64,
        "F32": torch.float32,
        "F16": torch.float16,
        "BF16": torch.bfloat16,
        "I64": torch.int64,
        "I32": torch.int32,
        "I16": torch.int16,
        "I8": torch.int8,
        "U8": torch.uint8,
        "BOOL": torch.bool,
    }[name]


def _progress(total: int, desc: str):
    try:
        from tqdm.auto import tqdm  # noqa: PLC0415

        return tqdm(total=total, desc=desc, unit="tensor", disable=None)
    except ImportError:  # pragma: no cover
        return None


def load_model(
    name_or_path,
    *,
    quantize="auto",
    dtype=torch.bfloat16,
    quant_block_size=64,
    random_weights=False,
    ram_fraction=0.85,
    trust_remote_code=False,
    disable_mmap=False,
    **config_overrides,
):
    """A Hugging Face causal LM (AutoModelForCausalLM) from a local folder or the HF cache holding
    config.json and .safetensors files (one, or shards with model.safetensors.index.json).

    The model is built without memory (parameters on the meta device), then filled from the
    files by a few threads, piece by piece (tensor_reads.py; a cap on the bytes in flight,
    results installed in file order whatever the thread timing): each frozen weight of the block
    stack is packed as ``quantize`` codes right after it is read (int8/NF4; ``"auto"``: only when the model in
    ``dtype`` does not fit in ``ram_fraction`` of the available RAM, int8 before NF4), so the
    full-precision base never exists in RAM at once. Packed weights are frozen; the others keep
    requires_grad=True, as from_pretrained leaves them. With ``quantize="none"`` the result equals
    ``AutoModelForCausalLM.from_pretrained(name_or_path, dtype=dtype)`` tensor for tensor.
    As in from_pretrained, a tensor kept as it is stored (no cast to ``dtype``, not packed: the
    embeddings and the head of a bf16 checkpoint) of 1 MiB or more is not copied: it stays a
    private, copy-on-write mapping of its bytes in the file (tensor_reads.map_tensor), whose pages
    come from the page cache when first used; writes (training it) copy only the pages written and
    never reach the file. The files must then keep their bytes while the model lives: do not
    truncate or rewrite them in place (save elsewhere, or to new files renamed over them);
    ``disable_mmap=True`` copies every tensor instead (the model then keeps nothing of the files).
    ``random_weights=True`` reads no checkpoint: Linear and Embedding weights are drawn from
    N(0, config.initializer_range) on every core at once (Hugging Face's distribution, not its
    numbers; repeatable under torch.manual_seed), biases zero, other modules get the model's own
    initialisation; block by block, packed as they are drawn.
    ``config_overrides`` set config attributes (``num_hidden_layers=4``). Returns the model in
    eval mode, on the CPU.

    Raises ValueError for a bad argument, a folder without .safetensors files, a pickle
    checkpoint (never unpickled), a truncated or inconsistent file or a shape that does not match
    the config (naming the file and tensor); MemoryError when even NF4 does not fit. Nothing is
    returned half-loaded.
    """
    fmt, block = _parse(
        quantize, dtype, quant_block_size, random_weights, ram_fraction, disable_mmap, trust_remote_code
    )
    folder = _resolve(name_or_path)
    headers = (
        {} if random_weights else {p: read_header(p) for p in checkpoint_files(folder)}
    )  # (header, start)
    from transformers import AutoConfig  # noqa: PLC0415

    config, unused = AutoConfig.from_pretrained(
        folder, trust_remote_code=trust_remote_code, return_unused_kwargs=True, **config_overrides
    )
    if unused:  # transformers drops a key the config does not have (a typo would load the full model)
        raise ValueError(
            f"load_model(): {', '.join(sorted(unused))} is not an attribute of {type(config).__name__} "
            "(config_overrides set attributes of the model's config, such as num_hidden_layers)"
        )
    model = _skeleton(config, dtype, trust_remote_code)
    from ..activations.blocks import find_blocks  # noqa: PLC0415

    try:
        blocks = find_blocks(model)
    except ValueError:
        blocks = []
    targets = {id(m): m for b in blocks for m in b.modules() if quantizable(m)}
    fmt, sizes = _decide(fmt, model, list(targets.values()), block, ram_fraction)
    owners = _owners(model)
    weight_of = {id(m._parameters["weight"]): m for m in targets.values()}
    if random_weights:
        _fill_random(model, owners, weight_of, fmt, block)
    else:
        _fill(model, headers, owners, weight_of, fmt, block, int(sizes[fmt]), share=not disable_mmap)
    left = [
        n for n, t in list(model.named_parameters()) + list(model.named_buffers()) if t.device.type == "meta"
    ]
    if left:
        raise ValueError(
            f"load_model(): the checkpoint in {folder} lacks {len(left)} tensor(s): {', '.join(left[:8])}"
        )
    model.eval()
    return model


def _fill(model, headers, owners, weight_of, fmt, block, model_bytes, share):
    plan, missing = _plan(headers, owners, getattr(model, "base_model_prefix", ""))
    for path, rows in plan.items():  # shapes, before anything is read
        for key, pid in rows:
            want, got = tuple(_current(owners[pid]).shape), tuple(headers[path][0][key]["shape"])
            if got != want:
                raise ValueError(
                    f"load_model(): {path}, tensor {key!r} has shape {got}, the config's model expects {want} "
                    f"for {owners[pid][0][2]}"
                )
    if missing:
        raise ValueError(
            f"load_model(): the checkpoint lacks {len(missing)} tensor(s) of the model: {', '.join(missing[:8])}"
        )
    workers = max(1, min(_WORKERS, usable_cores()))
    cap = max(_MIN_CAP, min(model_bytes // _WORKING_SHARE, workers * _CHUNK_BYTES))
    chunk = max(_MIN_PIECE, cap // workers)
    bar = _progress(sum(len(r) for r in plan.values()), "load_model")

    packs = {pid for pid in weight_of} if fmt in ("int8", "nf4") else set()
    mapped = {  # (file, key) of the tensors that stay mappings of the file: nothing to read
        (p, k)
        for p, rows in plan.items()
        for k, pid in rows
        if share and pid not in packs and _mappable(headers[p][1], headers[p][0][k], owners[pid])
    }

    def jobs(packed: bool):  # the tensors packed (or copied or mapped), in file order
        for path, rows in plan.items():
            header, start = headers[path]
            for key, pid in rows:
                if (pid in packs) == packed:
                    module = weight_of[pid] if packed else None
                    info, entries = header[key], owners[pid]
                    yield from _tensor_jobs(
                        path, start, key, info, entries, module, fmt, block, chunk, bar, (path, key) in mapped
                    )

    def total(packed: bool) -> int:  # file bytes read, the share interleave() balances
        return sum(
            headers[p][0][k]["data_offsets"][1] - headers[p][0][k]["data_offsets"][0]
            for p, rows in plan.items()
            for k, pid in rows
            if (pid in packs) == packed and (p, k) not in mapped
        )

    try:  # copies beside packing (interleave); results are still installed in one fixed order
        run_bounded(
            interleave([(total(True), jobs(True)), (total(False), jobs(False))]), workers=workers, cap=cap
        )
    finally:
        if bar is not None:
            bar.close()


def _current(entries) -> torch.Tensor:
    m, attr, _ = entries[0]
    return m._parameters[attr] if attr in m._parameters else m._buffers[attr]


def _named(path, key, fn):
    """fn, with its errors naming the file and the tensor (ValueError; MemoryError stays one)."""

    def run():
        try:
            fn()
        except MemoryError as e:
            e.add_note(f"load_model(): while reading {path}, tensor {key!r}")
            raise
        except (OSError, ValueError, TypeError, RuntimeError, BufferError) as e:
            raise ValueError(f"load_model(): {path}, tensor {key!r}: {e}") from None

    return run


def _kept_dtype(info, entries) -> tuple[torch.dtype, torch.dtype]:
    """(stored dtype, dtype the model keeps): a float is cast to the skeleton's float dtype, as
    from_pretrained does; other dtypes stay as stored."""
    old = _current(entries)
    src = _torch_dtype(info["dtype"])
    return src, old.dtype if src.is_floating_point and old.is_floating_point() else src


def _mappable(start, info, entries) -> bool:
    """Whether a tensor the model keeps unpacked can stay a mapping of the file: kept as stored,
    at least _SHARE_MIN bytes, starting at a multiple of its element size."""
    src, dst = _kept_dtype(info, entries)
    b0, b1 = info["data_offsets"]
    return dst == src and b1 - b0 >= _SHARE_MIN and (start + b0) % src.itemsize == 0


def _tensor_jobs(path, start, key, info, entries, module, fmt, block, chunk, bar, mapped=False):
    """The jobs (size, work, done) that read one tensor in pieces of about ``chunk`` bytes into
    what the model keeps:
    packed codes (``module``: the Linear it packs into) or a tensor of the model's dtype
    (_kept_dtype). The outputs are allocated here, on the calling thread; the last piece's done
    installs them. ``mapped`` (a _mappable tensor): one job of size 0 whose done installs a
    mapping of the file's bytes (map_tensor) instead; nothing is read."""
    old = _current(entries)
    src, dst = _kept_dtype(info, entries)
    shape, (b0, b1) = tuple(info["shape"]), info["data_offsets"]
    n, width, base = b1 - b0, src.itemsize, start + b0
    numel = n // width
    if mapped:

        def install():
            _place(entries, map_tensor(path, base, shape, src), getattr(old, "requires_grad", False))
            if bar is not None:
                bar.update(1)

        yield 0, lambda: None, _named(path, key, install)
        return
    if module is not None:
        nf4 = fmt == "nf4"
        codes = torch.empty((numel + 1) // 2 if nf4 else shape, dtype=torch.uint8 if nf4 else torch.int8)
        absmax = torch.empty(-(-numel // block), dtype=torch.float32)
        flat_codes = codes.view(-1)
        step = max(block, chunk // width // block * block)  # elements, a multiple of block

        def piece(e0, e1):
            def use(raw):
                x = raw.view(src)
                if dst != src:
                    x = x.to(dst)  # the values quantize_model would see after from_pretrained's cast
                c = flat_codes[e0 // 2 : (e1 + 1) // 2] if fmt == "nf4" else flat_codes[e0:e1]
                quantize_into_(fmt, x, c, absmax[e0 // block : -(-e1 // block)], block)

            return lambda: with_range(path, base + e0 * width, (e1 - e0) * width, use, width)

        def done():
            meta = torch.empty(shape, dtype=dst, device="meta")
            quantize_module_(module, fmt, block, weight=meta, packed=(codes, absmax))

        extra = dst.itemsize if dst != src else 0
    else:
        out = torch.empty(shape, dtype=dst)
        flat = out.view(-1)
        step = max(1, chunk // width)

        def piece(e0, e1):
            if dst == src:  # straight from the page cache into the kept tensor: nothing mapped
                return lambda: read_into(path, base + e0 * width, flat[e0:e1])

            def use(raw):
                flat[e0:e1].copy_(raw.view(src))  # the cast is the copy

            return lambda: with_range(path, base + e0 * width, (e1 - e0) * width, use, width)

        def done():
            _place(entries, out, getattr(old, "requires_grad", False))

        extra = 0
    cuts = list(range(0, numel, step)) + [numel] if numel else [0, 0]
    for i in range(len(cuts) - 1):
        e0, e1 = cuts[i], cuts[i + 1]
        last = i == len(cuts) - 2
        fin = None
        if last:

            def fin(done=done):
                done()
                if bar is not None:
                    bar.update(1)

            fin = _named(path, key, fin)
        yield (e1 - e0) * (width + extra), _named(path, key, piece(e0, e1)), fin


def _fill_random(model, owners, weight_of, fmt, block):
    """Each module's parameters get memory and random values (random_init.py: Linear and
    Embedding weights drawn in parallel, others by the model's own initialisation), one module at
    a time; block weights are packed right away, drawn into memory that the next weight of the same
    size reuses (fresh pages cost 10 % of a 70B-shaped layer's draw and pack on 2 cores)."""
    from .random_init import init_module_  # noqa: PLC0415

    init = getattr(model, "_init_weights", None)
    config = getattr(model, "config", None)
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    std = getattr(text, "initializer_range", None)
    targets = {id(m) for m in weight_of.values()}
    mods = [m for m in model.modules() if any(p is not None and p.is_meta for p in m._parameters.values())]
    packs = fmt in ("int8", "nf4")
    drawn: dict[tuple, torch.Tensor] = {}  # (numel, dtype) -> memory reused by the packed weights
    bar = _progress(len(mods), "load_model (random weights)")
    for m in mods:
        packed = packs and id(m) in targets
        for name, p in list(m._parameters.items()):
            if p is not None and p.is_meta:
                if packed and name == "weight" and len(owners[id(p)]) == 1:
                    key = (p.numel(), p.dtype)
                    if key not in drawn:
                        drawn[key] = torch.empty(p.numel(), dtype=p.dtype)
                    value = drawn[key].view(p.shape)  # packed below, then drawn over again
                else:
                    value = torch.empty(p.shape, dtype=p.dtype)
                _place(owners[id(p)], value, p.requires_grad)
        init_module_(m, std, init)
        if packed:
            quantize_module_(m, fmt, block)
        if bar is not None:
            bar.update(1)
    if bar is not None:
        bar.close()
