"""One forward pass's saved-tensor records: which tensors may page, which byte ranges of a storage
were already measured or paged (a tensor saved twice, or views of one, cost one copy), and the
bytes each block saved. Owned by the ActivationOffloader (hooks.py); training thread only."""

from __future__ import annotations

import weakref

import torch
import torch.nn as nn

ALIGN = 512  # a span copied from inside a storage starts at a multiple of this (CUDA's alignment)


class PassRecords:
    def __init__(self, n_blocks: int) -> None:
        self.persistent: set[int] = set()  # storages of the blocks' parameters and buffers
        self.by_storage: dict[int, list] = {}
        self.block_bytes = [0] * n_blocks
        self.pass_bytes = 0  # bytes paged in this pass

    def new_pass(self, blocks) -> None:
        """Forgets the last pass's records; the blocks' parameters and buffers never page."""
        self.by_storage = {}
        self.block_bytes = [0] * len(blocks)
        self.pass_bytes = 0
        ptrs = set()
        for b in blocks:
            for t in list(b.parameters()) + list(b.buffers()):
                p = t.untyped_storage().data_ptr()
                if p:
                    ptrs.add(p)
        self.persistent = ptrs

    def clear(self) -> None:
        self.by_storage = {}

    def pageable(self, t: torch.Tensor, device: torch.device, min_bytes: int) -> bool:
        """A plain strided activation on `device` of at least min_bytes, not a parameter."""
        if (
            type(t) is not torch.Tensor
            or t.layout is not torch.strided
            or t.is_nested
            or t.is_quantized
            or t.device != device
        ):
            return False
        if t.numel() * t.element_size() < max(1, min_bytes):
            return False
        if t.is_leaf and t.requires_grad:
            return False
        base = t._base
        if base is not None and isinstance(base, nn.Parameter):
            return False
        return t.untyped_storage().data_ptr() not in self.persistent

    def lookup(self, t: torch.Tensor):
        """(record list of t's storage, t's byte range lo/hi in it, the entry already holding it,
        False when it was measured only, or None)."""
        st = t.untyped_storage()
        item = t.element_size()
        lo_t = t.storage_offset() * item
        span = item
        for n, s in zip(t.shape, t.stride()):
            span += (n - 1) * s * item
        hi_t = lo_t + span
        recs = self.by_storage.setdefault(st.data_ptr(), [])
        for sref, ver, eref, lo, hi in recs:
            if sref() is st and ver == t._version and lo <= lo_t and hi_t <= hi:
                found = eref() if eref is not None else False
                if found is not None:
                    return recs, lo_t, hi_t, found
        return recs, lo_t, hi_t, None

    @staticmethod
    def span(t: torch.Tensor, lo_t: int, hi_t: int) -> tuple[int, int]:
        """The byte range to copy: the whole storage when t covers half of it or more."""
        size = t.untyped_storage().nbytes()
        if 2 * (hi_t - lo_t) >= size:
            return 0, size
        return lo_t - lo_t % ALIGN, hi_t

    @staticmethod
    def add(recs: list, t: torch.Tensor, entry, lo: int, hi: int) -> None:
        """Records t's storage range [lo, hi) as measured (entry None) or held by `entry`."""
        ref = weakref.ref(entry) if entry is not None else None
        recs.append((weakref.ref(t.untyped_storage()), t._version, ref, lo, hi))


def top_hooks_are_checkpoint() -> bool:
    """True inside torch.utils.checkpoint's own saved-tensor hooks (its frame owns the tensors)."""
    try:
        top = torch._C._autograd._top_saved_tensors_default_hooks(False)
    except Exception:  # pragma: no cover - older torch
        return False
    if not top:
        return False
    fn = top[0]
    fn = getattr(fn, "__wrapped__", fn)
    return "checkpoint" in (getattr(fn, "__module__", "") or "") or "checkpoint" in (
        getattr(fn, "__qualname__", "") or ""
    )
