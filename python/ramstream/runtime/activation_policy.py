"""wrap()'s activation paging: which blocks page their saved tensors, fixed or decided by "auto".

"auto" on a GPU: the first step pages every block (safe whatever the batch); the second is
measured (time, peak VRAM, bytes each block saved). If the run would fit without paging, one
unpaged step is measured too; then planner.choose_paged_blocks picks how many blocks page
(as many as keep the step within max_activation_slowdown of the unpaged one, or as many as
needed to fit). Every number goes into memory_report(model)["events"]. On the CPU engine there is
no VRAM to save: "auto" pages nothing. The planner decides (planner/activations.py), this policy
measures and applies through the mechanism (activations/hooks.py ActivationOffloader.set_paged).
"""

from __future__ import annotations

import time

import torch

from ..activations.hooks import ActivationOffloader
from ..blocks import find_blocks, fraction_to_blocks
from ..planner.activations import choose_paged_blocks, copy_seconds, estimate_overlap


class ActivationPolicy:
    def __init__(self, model: torch.nn.Module, device: torch.device, opts, log) -> None:
        self.log = log
        self.device = device
        self.mode = opts.activation_offload
        self.max_slowdown = opts.max_activation_slowdown
        self.headroom = opts.vram_headroom
        blocks = list(opts.blocks) if opts.blocks is not None else find_blocks(model)
        self.off = ActivationOffloader(
            blocks,
            device,
            prefetch_depth=opts.prefetch_depth,
            min_offload_bytes=opts.min_offload_bytes,
            log=log,
        ).attach()
        n = len(blocks)
        self.plan: dict = {"blocks": n}
        self.phase = "done"
        if self.mode is True:
            self.off.set_paged(range(n))
        elif isinstance(self.mode, float):
            self.off.set_paged(fraction_to_blocks(self.mode, n))
        elif device.type != "cuda":
            self.off.set_paged([])
            log("activation_offload=auto: the CPU engine has no VRAM to save; nothing paged")
        else:
            self.off.set_paged(range(n))
            self.phase = "warmup"
        if self.phase == "done":
            log(f"activation paging: blocks {self.off.paged} of {n}")
        self._t0 = None

    def _mark(self) -> None:
        torch.cuda.synchronize(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)
        self._t0 = time.perf_counter()

    def on_step(self) -> None:
        """Called at the end of every optimizer step; drives the "auto" measurements."""
        if self.phase == "done":
            return
        if self.phase == "warmup":  # pinning buffers makes step 1 unrepresentative
            self._mark()
            self.phase = "all_paged"
            return
        torch.cuda.synchronize(self.device)
        dt = time.perf_counter() - self._t0
        peak = torch.cuda.max_memory_allocated(self.device)
        if self.phase == "all_paged":
            st = self.off.stats()
            self.plan.update(t_all_paged_s=dt, peak_all_paged=peak, block_bytes=list(st["block_bytes"]))
            from .measure import device_memory

            usable = device_memory(self.device)["usable"] * (1 - self.headroom)
            predicted = peak + sum(st["block_bytes"])
            self.plan.update(budget=usable, predicted_unpaged_peak=predicted)
            if predicted <= usable:
                self.off.set_paged([])
                self.off.set_measuring(True)
                self.phase = "unpaged"
                self._mark()
                return
            self._decide(unpaged_s=None, must_free=int(predicted - usable))
        elif self.phase == "unpaged":
            self.plan.update(t_unpaged_s=dt, peak_unpaged=peak)
            self._decide(unpaged_s=dt, must_free=0)

    def _decide(self, unpaged_s: float | None, must_free: int) -> None:
        from ..engine.rates import measured_rates as measure

        gbps = measure(self.device)["pcie_bytes_per_s"] / 1e9
        bb = self.plan["block_bytes"]
        copy_all = copy_seconds(sum(bb), gbps, gbps)
        t_all = self.plan["t_all_paged_s"]
        if unpaged_s is None:  # it does not fit unpaged: assume half of the copies hide
            overlap = 0.5
            unpaged_s = max(1e-6, t_all - (1 - overlap) * copy_all)
        else:
            overlap = estimate_overlap(unpaged_s, t_all, copy_all)
        chosen, info = choose_paged_blocks(
            bb,
            unpaged_step_s=unpaged_s,
            d2h_gbps=gbps,
            h2d_gbps=gbps,
            compute_overlap=overlap,
            max_slowdown=self.max_slowdown,
            must_free_bytes=must_free,
        )
        self.off.set_measuring(False)
        self.off.set_paged(chosen)
        self.plan.update(info)
        self.phase = "done"
        self.log(
            f"activation_offload=auto: paging {len(chosen)} of {len(bb)} blocks "
            f"({info.get('reason', '')}); all paged {t_all * 1e3:.0f} ms/step, "
            f"unpaged {unpaged_s * 1e3:.0f} ms/step, PCIe {gbps:.1f} GB/s"
        )

    def report(self) -> dict:
        return {"paged_blocks": list(self.off.paged), "plan": dict(self.plan), "stats": self.off.stats()}

    def close(self) -> None:
        self.off.detach()
