"""wrap(nvme_weights=...): the frozen weights of streamed blocks at home on disk (issue 29).

Applies a choice, decides nothing: "auto" takes the plan's blocks (plan.weights["disk"], planner/
disk_weights.py), any other value goes through the same planner function. The mechanism is
OffloadModel's (weights/disk_slab.py: one DiskSlab per block, one DiskWeights store and staging
ring per streamer). In wrap()'s order:

  prepare()  before any weight moves: the blocks checked (ValueError naming nvme_weights,
             NotImplementedError when the chosen blocks hold no frozen weight), the folder
             (nvme_dir, else RAMSTREAM_NVME_DIR) and the store opened: its file is created
             exclusively, mode 0600, its space reserved, so a missing, full or unwritable folder is
             an OSError naming it here.
  build()    once the engine exists: each block's frozen tensors written to its record; they
             become empty stand-ins (the host copies are freed); the streamer reads them back into
             its staging ring ahead of use. Trained parameters of those blocks stay in RAM (the
             engine's streamed buckets, updated by the host AdamW).
  attach()   the streamer owns the store (its close(), from unwrap(), brings the weights back as
             ordinary host tensors and removes the file; garbage collection and exit remove it
             too); per disk block, state-dict hooks page the weights in from disk for state_dict()
             (copies) and load_state_dict() (written back to the records).

Between steps, blocks that start streaming (runtime/apply.py StreamLever) whose frozen weights the
revised plan puts on disk (planner/disk_weights.py, the same rule) join the store: extend() writes
their records into a second file in the same folder, its space reserved at open as the first's (a
full disk is an OSError naming the folder, nothing changed), and hooks them as attach() did;
undo() takes them back out when a later part of the change fails. A run whose wrap() opened no
store (nothing needed disk then) but was given a folder opens it at that point (open_mid_run), with
wrap()'s safety: exclusive file, mode 0600, space reserved before any weight moves (an OSError
naming the folder, nothing changed), removed by unwrap(), garbage collection or exit; undo() then
closes it and puts every tensor back where it was.
"""

from __future__ import annotations

import contextlib

import torch

from ..weights.disk_slab import _put_back

_GIB = 2**30


class DiskBlocks:
    """The blocks whose frozen weights are on disk, their tensors and the store."""

    def __init__(self, indices: list[int], groups: list[list[torch.Tensor]], store, folder: str) -> None:
        self.indices, self.groups, self.store, self.folder = indices, groups, store, folder
        self.slabs: dict[int, list] = {}
        self._open: dict[int, tuple[contextlib.ExitStack, object]] = {}
        self.streamer = None
        self.steps, self._read_at_step = 0, 0
        self.read_last_step = 0
        self.added: list[int] = []  # blocks extend() (or open_mid_run) put on disk between steps
        self.opened_mid_run = False  # the store was opened between steps (wrap() opened none)

    @property
    def nbytes(self) -> int:
        return sum(self.store.sizes)

    # ---- build ---------------------------------------------------------------------------------
    def build(self, engine, was: list | None = None) -> dict[int, list]:
        """Writes each block's frozen tensors to its record ({index: [DiskSlab]}). A failed write
        brings back the records written so far (nothing lost; with `was`, per block the tensors as
        they were before, e.g. on the device, put back instead), closes the store and raises."""
        from ..weights.disk_slab import DiskSlab
        from ..weights.slab import make_copier

        copier = engine.copier or make_copier(engine.device)
        engine.copier = self.store.copier = copier
        made = []
        try:
            for r, g in enumerate(self.groups):
                made.append(DiskSlab(self.store, r, list(g)))
        except BaseException:
            if was is None:
                for s in made:
                    s.restore()
            else:
                _put_back(self.groups, was)
            self.store.close()
            raise
        self.slabs = {k: [s] for k, s in zip(self.indices, made)}
        return self.slabs

    def attach(self, model, streamer, opt) -> list:
        """The streamer owns the store; state-dict hooks on each disk block; the per-step reads
        counted. Returns the hook handles (unwrap() removes them)."""
        streamer.disk, self.streamer = self.store, streamer
        opt._step_callbacks.append(self._after_step)
        blocks = {b.index: b.module for b in streamer.blocks}
        return [h for k in self.indices for h in self._hooks(blocks[k], k)]

    def _hooks(self, m, k: int) -> list:
        return [
            m.register_state_dict_pre_hook(lambda mod, prefix, keep_vars, k=k: self._page_in(k, False)),
            m.register_state_dict_post_hook(lambda mod, sd, prefix, meta, k=k: self._saved(k, sd, prefix)),
            m.register_load_state_dict_pre_hook(lambda mod, sd, prefix, meta, *a, k=k: self._loading(k, meta)),
            m.register_load_state_dict_post_hook(lambda mod, keys, k=k: self._page_out(k)),
        ]  # fmt: skip

    # ---- blocks that start streaming between steps ---------------------------------------------
    def extend(self, blocks, new: list[int], streamed: dict):
        """Blocks `new` (starting to stream; `streamed`: their {id(tensor): block}) with their frozen
        tensors written to records of a second file (DiskWeights.grow); the tensors become empty
        stand-ins. Returns ({index: [DiskSlab]}, undo token for undo()); ({}, None) when none of them
        holds a frozen tensor. OSError naming the folder (nothing changed) when the disk refuses."""
        groups = [frozen_tensors(blocks[k], k, streamed) for k in new]
        keep = [(k, g) for k, g in zip(new, groups) if g]
        if not keep:
            return {}, None
        if self.streamer is not None:  # every staging buffer free, nothing in flight
            self.streamer.evict_all()
            self.streamer.copier.synchronize()
        was = [[t.data for t in g] for _, g in keep]
        slabs = self.store.grow([g for _, g in keep])
        made = {k: [s] for (k, _), s in zip(keep, slabs)}
        self.indices += [k for k, _ in keep]
        self.groups += [g for _, g in keep]
        self.slabs.update(made)
        self.added += [k for k, _ in keep]
        return made, (made, was)

    def hook(self, blocks, made: dict) -> list:
        """State-dict hooks on the blocks extend() added (as attach()); the handles."""
        return [h for k in made for h in self._hooks(blocks[k], k)]

    def undo(self, token) -> None:
        """Takes extend()'s blocks back out: their tensors as they were before it, the second file
        removed."""
        if token is None:
            return
        made, was = token
        if self.opened_mid_run and set(made) == set(self.indices):  # open_mid_run's store: closed
            for s in (s for ss in made.values() for s in ss):
                s.evict()
            _put_back(self.groups, was)
            self.store.close()
            self.indices, self.groups, self.slabs, self.added = [], [], {}, []
            return
        self.store.shrink([s for ss in made.values() for s in ss], was)
        for k in made:
            i = self.indices.index(k)
            del self.indices[i], self.groups[i]
            self.slabs.pop(k)
            self.added.remove(k)

    def release(self) -> None:
        """The disk blocks' weights back in host memory (ordinary tensors) and the store closed:
        wrap() failing after build()."""
        for k in list(self._open):
            self._page_out(k)
        if self.streamer is not None:
            self.streamer.disk = None
        if not self.store.store.closed:
            for s in (s for ss in self.slabs.values() for s in ss):
                s.restore()
        self.store.close()

    # ---- state dicts ----------------------------------------------------------------------------
    def _page_in(self, k: int, write_back: bool) -> None:
        self._page_out(k)  # a state dict that raised half-way left it open
        self.streamer.evict_all()
        self.streamer.copier.synchronize()
        stack = contextlib.ExitStack()
        copies = [stack.enter_context(s.paged(write_back)) for s in self.slabs[k]]
        self._open[k] = (stack, {c.untyped_storage().data_ptr() for c in copies})

    def _page_out(self, k: int) -> None:
        opened = self._open.pop(k, None)
        if opened is not None:
            opened[0].close()

    def _saved(self, k: int, sd: dict, prefix: str) -> None:
        """The block's entries become copies (the parameters return to their stand-ins)."""
        ptrs = self._open.get(k, (None, set()))[1]
        for key, v in list(sd.items()):
            if (
                key.startswith(prefix)
                and torch.is_tensor(v)
                and v.numel()
                and v.untyped_storage().data_ptr() in ptrs
            ):
                sd[key] = v.detach().clone()
        self._page_out(k)

    def _loading(self, k: int, meta: dict) -> None:
        if meta.get("assign_to_params_buffers"):
            raise ValueError(
                "load_state_dict(assign=True) is not accepted on a wrapped model whose blocks keep their frozen "
                "weights on disk (wrap(nvme_weights=...)): load with assign=False (the weights are written to disk)"
            )
        self._page_in(k, True)

    # ---- report ---------------------------------------------------------------------------------
    def _after_step(self) -> None:
        read = self.store.stats["nvme_bytes_read"]
        self.read_last_step, self._read_at_step = read - self._read_at_step, read
        self.steps += 1

    def report(self) -> dict:
        """memory_report(model)["params"]["nvme_weights"]."""
        st = self.store.stats
        return {
            "blocks": sorted(self.indices),
            # of them, the blocks that started streaming between steps (a larger step's re-plan)
            "added_mid_run": list(self.added),
            "opened_mid_run": self.opened_mid_run,  # the store itself opened between steps
            "bytes_on_disk": self.nbytes,
            "staging_bytes": self.store.staging_bytes(),
            "loads": st["nvme_loads"],
            "bytes_read": st["nvme_bytes_read"],
            "bytes_read_last_step": self.read_last_step,
            "reads_ahead": st["reads_ahead"],
            "bytes_written_per_step": 0,
            "dir": self.folder,
            "direct": None if self.store.store.closed else self.store.direct(),
        }


def frozen_tensors(block, k: int, streamed: dict) -> list[torch.Tensor]:
    """Block k's streamed tensors that no optimizer updates: frozen parameters, packed codes."""
    from ..weights.setup import weight_tensors

    return [
        t for t in weight_tensors(block) if streamed.get(id(t)) == k and not t.requires_grad and t.numel() > 0
    ]


def prepare(opts, plan, blocks, stream_idx: list[int], streamed: dict, log) -> DiskBlocks | None:
    """The disk blocks for opts.nvme_weights, checked, with their store open (module docstring);
    None when no block's frozen weights go to disk."""
    from ..planner.disk_weights import choose

    option = opts.nvme_weights
    if option == "auto":
        if plan is None or not plan.weights.get("disk"):
            return None
        return _open(
            opts, blocks, [i for i in plan.weights["disk"] if i in set(stream_idx)], streamed, log, "auto"
        )
    if option is False or option == 0 or option == []:
        return None
    shown = f"wrap(): option nvme_weights={option!r}"
    if not stream_idx:
        raise ValueError(
            f"{shown} puts streamed blocks' frozen weights on disk, but no block streams (param_offload="
            f"{opts.param_offload!r}); pass param_offload=True or the blocks to stream, or nvme_weights=False"
        )
    if isinstance(option, list) and not set(option) <= set(stream_idx):
        from ..blocks import ranges_text

        raise ValueError(
            f"{shown} names blocks {ranges_text(sorted(set(option) - set(stream_idx)))} that do not stream "
            f"(streamed: {ranges_text(stream_idx)}); accepted: True, False, 'auto', an int k or a list of "
            "streamed block indices"
        )
    if isinstance(option, int) and option is not True and option > len(stream_idx):
        raise ValueError(
            f"{shown} is more than the {len(stream_idx)} streamed blocks; accepted: an int in "
            f"[0, {len(stream_idx)}], True, False, 'auto' or a list of streamed block indices"
        )
    sizes = {k: sum(t.nbytes for t in frozen_tensors(blocks[k], k, streamed)) for k in stream_idx}
    named = choose(option, stream_idx, {k: 1 for k in stream_idx}, 0, True)
    idx = [k for k in choose(option, stream_idx, sizes, 0, True)]
    if not idx:
        raise NotImplementedError(
            f"{shown}: blocks {named} hold no frozen weight: every parameter there is trained, and trained "
            "weights stay in RAM (the host AdamW rewrites them every step); nvme_weights is for frozen "
            "weights (a LoRA base, quantized codes); nvme_offload puts optimizer state on disk"
        )
    return _open(opts, blocks, idx, streamed, log, option)


def folder_of(opts) -> str | None:
    """The scratch file's folder: nvme_dir, else RAMSTREAM_NVME_DIR; None: neither."""
    from .. import env

    return opts.nvme_dir or env.get("RAMSTREAM_NVME_DIR") or None


def open_mid_run(opts, blocks, new: list[int], streamed: dict, engine) -> tuple:
    """Between steps, on a run whose wrap() opened no disk store: the store opened in folder_of(opts)
    for the blocks `new` that start streaming and that the revised plan puts on disk (`streamed`:
    their {id(tensor): block}), their frozen tensors written to its records (empty stand-ins then).
    Returns (DiskBlocks, {index: [DiskSlab]}, undo token for DiskBlocks.undo); (None, {}, None)
    when none of them holds a frozen tensor. The module docstring's safety: an OSError naming the
    folder before any weight moved; on any failure nothing changed."""
    from ..blocks import ranges_text
    from ..weights.disk_slab import DiskWeights
    from ..weights.slab import make_copier

    keep = [(k, g) for k in new if (g := frozen_tensors(blocks[k], k, streamed))]
    if not keep:
        return None, {}, None
    idx, groups = [k for k, _ in keep], [g for _, g in keep]
    engine.copier = engine.copier or make_copier(engine.device)
    where = f"ramstream: blocks {ranges_text(idx)} starting to stream between steps, option nvme_dir"
    store = DiskWeights(groups, folder_of(opts), copier=engine.copier, ahead=opts.weight_window, where=where)
    out = DiskBlocks(idx, groups, store, store.directory)
    was = [[t.data for t in g] for g in groups]
    made = out.build(engine, was)
    out.added, out.opened_mid_run = list(idx), True
    return out, dict(made), (dict(made), was)


def _open(opts, blocks, idx: list[int], streamed: dict, log, option) -> DiskBlocks | None:
    from ..weights.disk_slab import DiskWeights

    if not idx:
        return None
    folder = folder_of(opts)
    if not folder:
        raise ValueError(
            f"wrap(): option nvme_weights={option!r} needs a folder for the scratch file: pass nvme_dir=<a "
            "directory> or set RAMSTREAM_NVME_DIR; or pass nvme_weights=False"
        )
    groups = [frozen_tensors(blocks[k], k, streamed) for k in idx]
    store = DiskWeights(
        groups, folder, copier=None, ahead=opts.weight_window, where="wrap(): option nvme_dir"
    )
    out = DiskBlocks(idx, groups, store, folder)
    from ..blocks import ranges_text

    log(
        f"nvme_weights={option!r}: frozen weights of blocks {ranges_text(idx)} on disk in {folder} "
        f"({out.nbytes / _GIB:.2f} GiB; staging ring {store.staging_bytes() / _GIB:.3f} GiB of pinned memory); "
        "read again at each load, none written"
    )
    return out
