"""PipeDream-2BW's per-stage state: two weight banks (double-buffered weights), the stage's own
optimizer (on the stage's device, or on CPU fp32 masters), the gradient of the group in progress,
and the undo of the stage's latest update; plus the checks that refuse what 2BW cannot train.

A StageWeights belongs to one stage and is used only by that stage's worker thread during a run
(and by the session's thread between runs); it is not thread-safe. On CUDA every method runs on
the stage's stream (the worker's current stream); nothing here synchronizes a device.
"""

from __future__ import annotations

import torch
import torch.nn as nn
from torch.func import functional_call

__all__ = ["StageWeights", "check_stage_module", "version_of"]


def version_of(group: int, stages: int) -> int:
    """The weight version the forwards (and backwards) of update group `group` use: the newest
    version every stage holds when the group's first microbatch enters the pipeline. With one
    stage that is the group's own (no staleness); with several, stage 0's warm-up forwards of
    a group run before the previous group's update, so the group uses one version older:
    W(g+1) = W(g) - step(grad f(W(g-1))), the 2BW rule (group 0 and 1 both use W(0))."""
    return group if stages == 1 else max(group - 1, 0)


_DROPOUT = (nn.modules.dropout._DropoutNd, nn.RReLU)


def check_stage_module(where: str, s: int, module: nn.Module) -> None:
    """ValueError for what a 2BW stage cannot run: a forward that changes its module's buffers
    (BatchNorm in train mode with running statistics) or weights (Embedding max_norm), or draws
    random numbers in a module (dropout in train mode), whose order across stage threads would
    make runs irreproducible."""
    for name, m in module.named_modules():
        what = f"stage {s}'s module {name or type(m).__name__!r} ({type(m).__name__})"
        if isinstance(m, nn.modules.batchnorm._BatchNorm) and m.training and m.track_running_stats:
            raise ValueError(
                f"{where}: {what} updates its running statistics in forward, which 2BW's two weight "
                "versions cannot keep consistent; put it in eval mode (.eval()), use "
                "track_running_stats=False, or use a norm without buffers (LayerNorm)"
            )
        if isinstance(m, _DROPOUT) and m.training and getattr(m, "p", 1) > 0:
            raise ValueError(
                f"{where}: {what} draws random numbers in train mode; 2BW stages run on concurrent "
                "threads, so the draws would depend on timing: use p=0 or .eval()"
            )
        if isinstance(m, (nn.MultiheadAttention, nn.RNNBase)) and m.training and m.dropout:
            raise ValueError(
                f"{where}: {what} has dropout={m.dropout} in train mode; use dropout=0 or .eval()"
            )
        if isinstance(m, (nn.Embedding, nn.EmbeddingBag)) and m.max_norm is not None:
            raise ValueError(
                f"{where}: {what} has max_norm={m.max_norm}, which rewrites its weight in forward; "
                "2BW needs forwards that leave the weights as they are (max_norm=None)"
            )


def _copy_state(state: dict, into: dict | None) -> dict:
    """A copy of an optimizer's per-parameter state ({param: {key: tensor or value}}), reusing
    `into`'s tensors where shapes and dtypes match."""
    out = {}
    for p, st in state.items():
        old = into.get(p, {}) if into is not None else {}
        row = {}
        for k, v in st.items():
            if torch.is_tensor(v):
                buf = old.get(k)
                if (
                    torch.is_tensor(buf)
                    and buf.shape == v.shape
                    and buf.dtype == v.dtype
                    and buf.device == v.device
                ):
                    row[k] = buf.copy_(v)
                else:
                    row[k] = v.detach().clone()
            else:
                row[k] = v
        out[p] = row
    return out


class StageWeights:
    """One stage's two weight banks and optimizer.

    `params` are the stage's trainable nn.Parameters (named as in `module`). Bank 0 starts as an
    alias of their storage, bank 1 as a copy; the bank tensors are the leaves the graphs of
    forward() use (through torch.func.functional_call), so a graph keeps reading its version
    while the other bank is rewritten. The module's own Parameters always hold the latest
    version (their .data is that bank), so pipe.parameters() shows it. optimizer_factory gets the
    Parameters (or, with cpu_masters, fp32 CPU copies that the optimizer updates and the device
    banks are refreshed from)."""

    def __init__(
        self, module: nn.Module, device: torch.device, factory, cpu_masters: bool, stage: int
    ) -> None:
        self.module, self.device, self.stage = module, device, stage
        named = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
        self.names = [n for n, _ in named]
        self.params = [p for _, p in named]
        with torch.no_grad():
            self.banks = [
                [p.data.requires_grad_(True) for p in self.params],
                [p.detach().clone().requires_grad_(True) for p in self.params],
            ]
        self.versions: list = [0, None]
        self.latest = 0
        self.live = [0, 0]  # forwards whose backward has not run, per bank
        self.buffers = [(n, b, b._version) for n, b in module.named_buffers()]
        self.cuda = device.type == "cuda"
        self.masters = None
        self.optimizer = None
        self.undo = None  # (version, optimizer state, masters) from before the latest update
        if not self.params:
            return
        if cpu_masters:
            self.masters = [
                nn.Parameter(
                    torch.empty(
                        p.shape, dtype=torch.promote_types(p.dtype, torch.float32), pin_memory=self.cuda
                    )
                )
                for p in self.params
            ]
            with torch.no_grad():
                for m, p in zip(self.masters, self.params):
                    m.copy_(p.detach())
            self.landing = [torch.empty(m.shape, dtype=m.dtype, pin_memory=self.cuda) for m in self.masters]
        targets = self.masters if cpu_masters else self.params
        opt = factory(list(targets))
        if not isinstance(opt, torch.optim.Optimizer):
            raise TypeError(
                f"Pipeline.train_session: optimizer_factory must return a torch.optim.Optimizer for stage "
                f"{stage}, got {type(opt).__name__}"
            )
        owned = [p for g in opt.param_groups for p in g["params"]]
        if len(owned) != len(targets) or {id(p) for p in owned} != {id(p) for p in targets}:
            raise ValueError(
                f"Pipeline.train_session: stage {stage}'s optimizer must own exactly the parameters "
                f"optimizer_factory was given ({len(targets)}), it owns {len(owned)}"
            )
        self.optimizer = opt

    def slot(self, version: int) -> int:
        if self.optimizer is None:
            return 0  # nothing to train: one bank, every version
        if version not in self.versions:
            raise RuntimeError(f"2BW: stage {self.stage} holds versions {self.versions}, not {version}")
        return self.versions.index(version)

    # ---- a worker's ops -----------------------------------------------------------------------
    def forward(self, version: int, args, autocast):
        """The stage's module on `args` with the weights of `version`; returns (output, bank)."""
        b = self.slot(version)
        weights = dict(zip(self.names, self.banks[b]))
        with autocast:
            out = functional_call(self.module, weights, args)
        for name, buf, v in self.buffers:
            if buf._version != v:
                raise RuntimeError(
                    f"Pipeline.train_session: stage {self.stage}'s forward modified its buffer {name!r}; "
                    "2BW needs forwards that leave buffers as they are"
                )
        self.live[b] += 1
        return out, b

    def backward_done(self, bank: int) -> None:
        self.live[bank] -= 1

    def update(self, version: int) -> list:
        """One update (its group's gradient accumulated on the bank of `version`): the optimizer steps
        from the latest version into the other bank, which becomes the latest. Raises (leaving the
        stage as before it) on failure. Returns the gradients it applied (None entries: unused)."""
        latest = self.latest
        if self.optimizer is None:
            self.latest = latest + 1
            return []
        src = self.slot(latest)
        dst = 1 - src
        if self.live[dst]:
            raise RuntimeError(
                f"2BW: stage {self.stage} would overwrite a bank with {self.live[dst]} live graphs"
            )
        gb = self.banks[self.slot(version)]
        grads = [t.grad for t in gb]
        for t in gb:
            t.grad = None
        opt = self.optimizer
        masters = [m.detach().clone() for m in self.masters] if self.masters is not None else None
        self.undo = (latest, _copy_state(opt.state, self.undo[1] if self.undo else None), masters)
        try:
            with torch.no_grad():
                if self.masters is None:
                    for p, a, b, g in zip(self.params, self.banks[src], self.banks[dst], grads):
                        b.copy_(a)
                        p.data = b
                        p.grad = g
                    opt.step()
                else:
                    self._master_step(grads)
                    for p, b, m in zip(self.params, self.banks[dst], self.masters):
                        b.copy_(m, non_blocking=self.cuda)
                        p.data = b
        except BaseException:
            self._restore()
            raise
        finally:
            opt.zero_grad(set_to_none=True)
            for p in self.params:
                p.grad = None
        self.versions[dst] = latest + 1
        self.latest = latest + 1
        return grads

    def _master_step(self, grads) -> None:
        """CPU masters: the gradients land in pinned host buffers (a stage-local event wait, never
        a device synchronize), the optimizer steps on the CPU."""
        for m, land, g in zip(self.masters, self.landing, grads):
            if g is None:
                m.grad = None
                continue
            land.copy_(g, non_blocking=self.cuda)
            m.grad = land
        if self.cuda:
            ev = torch.cuda.Event()
            ev.record(torch.cuda.current_stream(self.device))
            ev.synchronize()
        self.optimizer.step()

    # ---- failures and the end -----------------------------------------------------------------
    def _restore(self) -> None:
        """Back to the state before the latest update's step (weights, optimizer state, masters)."""
        version, state, masters = self.undo
        opt = self.optimizer
        opt.state.clear()
        for p, st in state.items():
            opt.state[p] = {k: v.clone() if torch.is_tensor(v) else v for k, v in st.items()}
        if masters is not None:
            with torch.no_grad():
                for m, old in zip(self.masters, masters):
                    m.copy_(old)
        b = self.slot(version)
        for p, t in zip(self.params, self.banks[b]):
            p.data = t

    def roll_back_to(self, version: int) -> None:
        """After a failed run: drop the group in progress (gradients, graphs) and, when this stage
        is one update ahead of `version`, undo its latest update."""
        for bank in self.banks:
            for t in bank:
                t.grad = None
        self.live = [0, 0]
        if self.latest == version:
            return
        if self.latest != version + 1 or self.undo is None or self.undo[0] != version:
            raise RuntimeError(
                f"2BW: stage {self.stage} is at version {self.latest}, cannot go back to {version}"
            )
        newer = self.slot(self.latest)
        self._restore()
        self.versions[newer] = None
        self.latest = version
        self.undo = None

    def release(self) -> None:
        """The Parameters keep the latest version; the other bank, gradients and undo go."""
        for bank in self.banks:
            for t in bank:
                t.grad = None
        self.banks = []
        self.undo = None
        self.masters = None
