"""What a live OffloadModel installs (its streamer, gradient hooks, recompute, host optimizer,
activation offloader), held apart from the model so that close() or garbage collection releases
them without a reference cycle."""

from __future__ import annotations

import weakref


class Hooks:
    """What a live OffloadModel installed (released by close() or when the model is collected:
    holds no reference to the model)."""

    def __init__(self) -> None:
        self.streamer = None
        self.grad_hooks: list = []
        self.recompute = None
        self.host_opt = None  # the host optimizer (optim.py), while attached
        self.opt_handles: list = []
        self.activations = None  # the ActivationOffloader of activation_offload=True
        self.disk = None  # the DiskWeights of the chunks on disk (nvme, nvme_layers)

    def release_host_opt(self) -> None:
        """Closes the attached host optimizer's engine (waits for its updates, removes its hooks)."""
        opt, self.host_opt = self.host_opt, None
        for h in self.opt_handles:
            h.remove()
        self.opt_handles = []
        if opt is not None:
            from ...optim import OffloadAdamW

            OffloadAdamW.close(opt)

    def release_streamer(self) -> None:
        if self.streamer is not None:
            self.streamer.close()
            self.streamer = None
        for h in self.grad_hooks:
            h.remove()
        self.grad_hooks = []

    def release(self) -> None:
        self.release_host_opt()
        self.release_streamer()
        if self.disk is not None:  # the file removed: disk chunks keep their empty stand-ins
            self.disk.close()
            self.disk = None
        if self.activations is not None:
            self.activations.detach()
            self.activations = None
        if self.recompute is not None:
            self.recompute.close()
            self.recompute = None


def weak_grad_hook(model):
    ref = weakref.ref(model)

    def hook(p) -> None:
        m = ref()
        if m is not None:
            m._grad_landed(p)

    return hook
