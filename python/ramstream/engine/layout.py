"""Where a bucket's tensors live, and keeping that right when the model changes under the engine.

Placements:
  "host":   fp32 master and moments in host RAM, gradients land in a pinned buffer, the host
            threads run AdamW, the new weights go back by H2D copy (optimizer_mode="cpu").
  "mapped": moments (and the fp32 master of a low-precision model) in pinned host memory mapped
            into the GPU's address space; the CUDA kernel updates over PCIe as gradients arrive;
            an fp32 model's weights on the GPU are their own master (optimizer_mode="gpu").
  "device": as "mapped", with the moments (and a low-precision model's master) in device memory:
            the same CUDA kernel updates them at device bandwidth, nothing crosses PCIe. Buckets
            move there with relocate() when the planner finds VRAM to spare (runtime/optimizer_split.py
            maybe_share), or start there when the plan is resident (runtime/optimizer_split.py
            state_starts_on_device: no host state is made that the resident switch would drop).
"""

from __future__ import annotations

import torch

from .buckets import GPU_UPDATED, Bucket
from .disk_tier import paged


def allocate(engine, b: Bucket, placement: str, owned: bool = True) -> None:
    """Points b's parameters at a fresh flat device buffer and allocates its state (none when
    another data-parallel rank owns the bucket)."""
    if placement not in ("host", "mapped", "device"):
        raise ValueError(f"allocate: placement={placement!r}; accepted: 'host', 'mapped', 'device'")
    if placement == "device" and engine.device.type != "cuda":
        raise ValueError("allocate: placement 'device' needs a CUDA device")
    dev = engine.dev
    b.placement = placement
    b.dtype, b.device = b.slots[0].param.dtype, engine.device
    if b.streamed:
        _allocate_streamed(engine, b, owned)
        return
    b.device_flat = torch.zeros(b.numel, dtype=b.dtype, device=engine.device)
    for s in b.slots:
        b.device_flat[s.offset : s.offset + s.numel].copy_(s.param.detach().reshape(-1))
        s.param.data = b.device_flat[s.offset : s.offset + s.numel].view(s.param.shape)
    if not owned:
        b.master = b.exp_avg = b.exp_avg_sq = b.landing = b.acc = None
    elif placement == "host":
        b.master = b.device_flat.to("cpu", torch.float32, copy=True)
        b.exp_avg = torch.zeros(b.numel, dtype=engine.moment_dtype)
        b.exp_avg_sq = torch.zeros(b.numel, dtype=engine.moment_dtype)
        b.landing = dev.host_buffer(b.numel, b.dtype)
        b.acc = torch.empty(b.numel, dtype=torch.float32) if engine.accumulation_steps > 1 else None
    elif placement == "mapped":
        b.master = None
        if b.dtype != torch.float32:
            b.master = dev.host_buffer(b.numel, torch.float32)
            b.master.copy_(b.device_flat)
        b.exp_avg = dev.host_buffer(b.numel, engine.moment_dtype).zero_()
        b.exp_avg_sq = dev.host_buffer(b.numel, engine.moment_dtype).zero_()
        b.landing = b.acc = None
    else:  # "device", a resident plan: the state starts in VRAM, nothing of it on the host
        b.master = None if b.dtype == torch.float32 else b.device_flat.to(torch.float32, copy=True)
        b.exp_avg = torch.zeros(b.numel, dtype=engine.moment_dtype, device=engine.device)
        b.exp_avg_sq = torch.zeros(b.numel, dtype=engine.moment_dtype, device=engine.device)
        b.landing = b.acc = None
    dev.synchronize()


def _allocate_streamed(engine, b: Bucket, owned: bool) -> None:
    """A streamed bucket: its weights at home in a pinned slab (weights/slab.py, its device
    storage released until its block runs), fp32 master and moments on the host; the host
    AdamW writes the new weights into the slab's home. An fp32 bucket's home is its own master
    (updated in place: no second copy in RAM, no separate write of the new weights). Under data
    parallel a rank that does not own the bucket keeps only the home (no master, no moments):
    the owner's broadcast writes the new weights into it (distributed.py)."""
    from ..weights.slab import Slab

    if b.placement != "host":
        raise ValueError("ramstream: a streamed bucket is updated on the host")
    params = [s.param for s in b.slots]
    b.slab = Slab(params, [s.offset for s in b.slots], b.numel, copier=engine.copier)
    b.device_flat = b.slab.flat
    if not owned:
        b.master = b.exp_avg = b.exp_avg_sq = b.landing = b.acc = None
        return
    home = b.slab.home
    b.master = home if home.dtype == torch.float32 else home.to(torch.float32, copy=True)
    b.exp_avg = torch.zeros(b.numel, dtype=engine.moment_dtype)
    b.exp_avg_sq = torch.zeros(b.numel, dtype=engine.moment_dtype)
    b.landing = engine.dev.host_buffer(b.numel, b.dtype)
    b.acc = torch.empty(b.numel, dtype=torch.float32) if engine.accumulation_steps > 1 else None


def relocate(engine, b: Bucket, placement: str) -> None:
    """Moves a quiescent bucket's optimizer state (no job, update or gradient of it in flight:
    between steps, after synchronize()) to `placement`, values unchanged: the fp32 master, the
    moments and the step counts are copied, so the next update reads exactly what the old
    placement would have read (mapped <-> device: the same kernel, bit for bit)."""
    if placement not in ("host", "mapped", "device"):
        raise ValueError(f"relocate: placement={placement!r}; accepted: 'host', 'mapped', 'device'")
    if b.streamed or b.exp_avg is None or placement == b.placement:
        return
    if b.disk is not None:
        raise ValueError(f"relocate: bucket {b.index}'s state is on disk (nvme_offload): it stays 'host'")
    if placement != "host" and engine.dev.type != "cuda":
        raise ValueError(f"relocate: placement {placement!r} needs a CUDA device")
    dev, n, fp32 = engine.dev, b.numel, b.dtype == torch.float32
    master = master_flat(b)
    if placement == "host":
        new = dict(
            master=_host_copy(master, torch.float32),
            exp_avg=_host_copy(b.exp_avg, b.exp_avg.dtype),
            exp_avg_sq=_host_copy(b.exp_avg_sq, b.exp_avg_sq.dtype),
            landing=dev.host_buffer(n, b.dtype),
            acc=torch.empty(n, dtype=torch.float32) if engine.accumulation_steps > 1 else None,
        )
    else:

        def place(t, dtype):
            if placement == "device":
                return t.to(engine.device, dtype, copy=True)
            if t.device.type == "cpu" and t.dtype == dtype and _arena_pinned(t):
                return t  # already in the pinned arena (a bucket that was mapped): no second copy
            return dev.host_buffer(n, dtype).copy_(t)

        new = dict(
            master=None if fp32 else place(master, torch.float32),
            exp_avg=place(b.exp_avg, b.exp_avg.dtype),
            exp_avg_sq=place(b.exp_avg_sq, b.exp_avg_sq.dtype),
            landing=None,
            acc=None,
        )
    if fp32 and b.placement == "host":  # the fp32 weights become their own master: same values
        b.device_flat.copy_(master)
    dev.synchronize()
    for k, t in new.items():
        setattr(b, k, t)
    b.placement = placement
    if getattr(engine, "delayed", None) is not None:  # delayed_update's side buffers follow
        engine.delayed.placed(b)


def _host_copy(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The state tensor t for the host AdamW: kept as it is when it already lies in host memory
    in `dtype` (a mapped bucket's pinned moments and fp32 master: the host reads them where they
    are), else copied to ordinary host memory. A copy here would leave the pinned blocks cached in
    the arena (they stay page-locked and resident), so moving 30 % of a 7B model's state from
    mapped to host would hold ~26 GiB twice (the R5 row's host out-of-memory, bench/RESULTS.md)."""
    if t.device.type == "cpu" and t.dtype == dtype:
        return t
    return t.to("cpu", dtype, copy=True)


def _arena_pinned(t: torch.Tensor) -> bool:
    from .._native import lib

    return bool(lib().is_arena_pinned(t.data_ptr()))


def weights_flat(b: Bucket) -> torch.Tensor:
    """The flat working-dtype weights of a bucket: a streamed bucket's are at home in its slab."""
    return b.slab.home if b.streamed else b.device_flat


def master_flat(b: Bucket) -> torch.Tensor:
    """The fp32 master of a bucket (an fp32 mapped bucket's master is its device buffer)."""
    return b.master if b.master is not None else b.device_flat


def snapshot_masters(engine) -> None:
    """Before a dtype conversion: a mapped fp32 bucket keeps its master in the weights
    themselves, so copy it to pinned host memory first (a conversion must not round it)."""
    for b in engine.buckets:
        if b.placement in GPU_UPDATED and b.master is None:
            b.master = engine.dev.host_buffer(b.numel, torch.float32)
            b.master.copy_(b.device_flat)
    engine.dev.synchronize()


def rebind(engine, model: torch.nn.Module | None) -> None:
    """After model.to()/.half()/...: parameters on the engine's device are re-pointed at fresh
    flat buffers of their (possibly new) dtype, filled from the fp32 masters, so a conversion
    never rounds a master. Parameters left on another device make the next backward or step()
    raise."""
    if model is not None:
        adopt_replaced(engine, model)
    for b in engine.buckets:
        devices = {s.param.device for s in b.slots}
        if devices != {engine.device}:
            continue
        dtypes = {s.param.dtype for s in b.slots}
        if len(dtypes) != 1:
            raise RuntimeError(
                f"ramstream: parameters of one bucket were converted to different "
                f"dtypes {sorted(map(str, dtypes))}"
            )
        dtype = dtypes.pop()
        engine.check_param(b.slots[0].param)
        with paged(b):  # nvme_offload: the master is read from disk
            master = master_flat(b).clone() if b.disk is not None else master_flat(b)
        if dtype != b.dtype:
            b.dtype = dtype
            if b.landing is not None:
                b.landing = engine.dev.host_buffer(b.numel, dtype)
            engine.log(f"bucket {b.index}: working dtype now {dtype} (fp32 master kept)")
        flat = torch.empty(b.numel, dtype=dtype, device=engine.device)
        flat.copy_(master)
        if b.placement in GPU_UPDATED and dtype == torch.float32 and b.master is not None:
            b.master = None  # the fp32 weights are the master again
        b.device_flat = flat
        b.h2d_event = None
        for s in b.slots:
            s.param.data = flat[s.offset : s.offset + s.numel].view(s.param.shape)
    engine.dev.synchronize()


def adopt_replaced(engine, model: torch.nn.Module) -> None:
    """Module._apply replaces a Parameter object (rather than its .data) when the new tensor is
    of another kind (e.g. meta): move the slot, its hook and its guard to the new object."""
    for name, p in model.named_parameters():
        s = engine.names.get(name)
        if s is not None and p is not s.param:
            engine.replace_param(s, p)


def replaced_params(engine, model: torch.nn.Module) -> dict:
    """{slot: the Parameter now in the model} for the slots whose parameter object
    model.load_state_dict(..., assign=True) replaced; RuntimeError when it untied a parameter
    or changed its size."""
    current = dict(model.named_parameters(remove_duplicate=False))
    replaced: dict = {}
    for name, p in current.items():
        s = engine.names.get(name)
        if s is not None and p is not s.param:
            replaced[s] = p
    for s in replaced:
        names = sorted(n for n, x in engine.names.items() if x is s and n in current)
        if len({id(current[n]) for n in names}) > 1:
            raise RuntimeError(
                f"ramstream: load_state_dict(assign=True) untied {', '.join(names)} "
                "(one parameter when wrapped); load without assign=True"
            )
        if current[names[0]].numel() != s.numel:
            raise RuntimeError(
                f"ramstream: loaded parameter {names[0]} has "
                f"{current[names[0]].numel()} elements, the wrapped one {s.numel}"
            )
    return replaced


def adopt_loaded(engine, model: torch.nn.Module) -> None:
    """After model.load_state_dict(..., assign=True): the loaded tensors became new Parameter
    objects; their values move into the bucket (and the fp32 master) and the new objects take
    the slots, so they train (in the bucket's dtype, on the engine's device)."""
    replaced = replaced_params(engine, model)
    for s, p in replaced.items():
        value = p.detach().reshape(-1)
        engine.replace_param(s, p)
        b, sl = s.bucket, slice(s.offset, s.offset + s.numel)
        if b.streamed:
            raise RuntimeError(
                "ramstream: load_state_dict(assign=True) into streamed blocks is not supported; "
                "load without assign=True"
            )
        b.device_flat[sl].copy_(value)
        with paged(b, write=True):
            if b.master is not None:
                b.master[sl].copy_(value)
        p.data = b.device_flat[sl].view(p.shape)
    engine.dev.synchronize()


def resync_masters(engine, loaded: dict | None = None) -> None:
    """After weights were loaded into the model: masters take the fp32 values loaded into a
    low-precision slot (`loaded`: slot -> tensor, where the weight now equals their rounding),
    elsewhere the loaded values wherever the working copy no longer equals master.to(working
    dtype)."""
    loaded = loaded or {}
    for b in engine.buckets:
        if b.master is None:
            continue  # the weights are the master
        with paged(b, write=True) as ctl:  # nvme_offload: read, compared, written back if changed
            ctl.write = _resync_bucket(engine, b, loaded) > 0


def _resync_bucket(engine, b: Bucket, loaded: dict) -> int:
    changed = 0
    for s in b.slots:
        sl = slice(s.offset, s.offset + s.numel)
        v = loaded.get(s)
        w = weights_flat(b)
        if v is not None and torch.equal(w[sl], v.reshape(-1).to(w.device, b.dtype)):
            b.master[sl].copy_(v.reshape(-1))
            changed += 1
        elif not torch.equal(w[sl], b.master[sl].to(w.device, b.dtype)):
            b.master[sl].copy_(w[sl])
            changed += 1
    if changed:
        engine.log(f"bucket {b.index}: fp32 master of {changed} parameters reloaded from the model's weights")
    return changed


def relocation_host_bytes(engine, b: Bucket, placement: str) -> int:
    """Bytes of host memory (pinned or not) relocate(engine, b, placement) newly allocates: to the
    host, the landing (and the accumulation sum), plus the master and moments unless they already
    lie in host memory (a mapped bucket's), and with delayed_update the side buffers; to mapped,
    the pinned master and moments unless they already lie in the pinned arena; to the device,
    none. What the move frees is not subtracted
    (the arena keeps freed pinned blocks resident)."""
    if b.streamed or b.exp_avg is None or placement == b.placement or placement == "device":
        return 0

    def cost(t, dtype) -> int:
        size = b.numel * dtype.itemsize
        if t is None or t.device.type != "cpu" or t.dtype != dtype:
            return size
        return 0 if placement == "host" or _arena_pinned(t) else size

    m = b.exp_avg.dtype
    master = master_flat(b)
    total = cost(b.exp_avg, m) + cost(b.exp_avg_sq, m)
    if placement == "host":
        total += cost(master, torch.float32) + b.numel * b.dtype.itemsize
        total += b.numel * 4 if engine.accumulation_steps > 1 else 0
        if getattr(engine, "delayed", None) is not None:  # its side buffers (Delayed.placed)
            total += 2 * b.numel * b.dtype.itemsize + (b.numel * 4 if engine.accumulation_steps > 1 else 0)
    elif b.dtype != torch.float32:
        total += cost(master, torch.float32)
    return total


def move_buckets(opt, targets: list[str], relocate_fn=None, who: str = "ramstream", host_room=None) -> int:
    """Relocates opt's buckets whose target (in bucket order) differs from their placement, in
    bucket order, with relocate_fn (layout.relocate or a test's stand-in); the engine must be
    quiescent (after synchronize). Streamed buckets and those without state stay. Running out of
    memory (device or pinned), or pinned memory falling back to pageable memory the GPU cannot
    read, keeps that bucket, and the rest, where they were (logged, prefixed by `who`). Updates
    the engine's mapped_numel; returns the buckets moved. Used by the refinement and the
    watchdog (runtime/refiner.py, runtime/watchdog.py). host_room: None, or a callable giving the
    bytes of host memory the process may still take (the runtime's measurement and reserve): a
    bucket whose move would allocate more (relocation_host_bytes) stays, and the rest with it
    (logged with the numbers): a move never runs the host out of memory, where the kernel would
    kill the process with nothing saved."""
    from .._native import lib

    relocate_fn = relocate_fn or relocate
    e, moved = opt._engine, 0
    for b, where in zip(e.buckets, targets):
        if where == b.placement or b.streamed or getattr(b, "disk", None) is not None or b.exp_avg is None:
            continue
        was = b.placement
        if host_room is not None:
            need, room = relocation_host_bytes(e, b, where), host_room()
            if need > room:
                opt._log(
                    f"{who}: bucket {b.index} stays {was} (host RAM: the move needs {need / 2**20:.0f} MiB, "
                    f"{max(room, 0) / 2**20:.0f} MiB may still be taken)"
                )
                break
        try:
            relocate_fn(e, b, where)
        except (torch.OutOfMemoryError, MemoryError) as exc:
            opt._log(f"{who}: bucket {b.index} stays {was} ({exc})")
            break
        if (
            where == "mapped"
            and e.dev.type == "cuda"
            and not all(
                lib().is_arena_pinned(t.data_ptr())
                for t in (b.exp_avg, b.exp_avg_sq, b.master)
                if t is not None
            )
        ):  # above the page-lock budget: back where it was before any kernel reads it
            relocate_fn(e, b, was)
            opt._log(f"{who}: bucket {b.index} stays {was} (page-lock budget)")
            break
        moved += 1
    e.mapped_numel = sum(b.numel for b in e.buckets if b.placement == "mapped")
    return moved
