"""TrainStream 0.4.1's HardwareProfile names over ramstream's fields: read-only properties with
TrainStream's meanings and units (docs/compat.md), mixed into planner.profile.HardwareProfile."""

from __future__ import annotations

from .measure import ADAMW_STATE_BYTES


class TrainStreamProfileNames:
    """Needs the HardwareProfile fields device, gpu_name, vram_total, h2d_gbps, d2h_gbps,
    duplex_gbps, adamw_gbps, matmul_tflops. A rate ramstream does not measure is None."""

    @property
    def device_index(self) -> int | None:
        """The CUDA device index; None on the CPU."""
        if not str(self.device).startswith("cuda"):
            return None
        _, _, idx = str(self.device).partition(":")
        return int(idx) if idx else 0

    @property
    def device_name(self) -> str | None:
        """= gpu_name (None on the CPU)."""
        return self.gpu_name

    @property
    def vram_bytes(self) -> int:
        """= vram_total."""
        return self.vram_total

    @property
    def sm_count(self) -> int:
        """The GPU's streaming multiprocessors (read from torch, not cached); 0 on the CPU."""
        idx = self.device_index
        if idx is None:
            return 0
        import torch

        return int(torch.cuda.get_device_properties(idx).multi_processor_count)

    @property
    def bidir_gbps(self) -> float:
        """Both directions together while both run, GB/s: 2 x duplex_gbps (duplex_gbps is each way)."""
        return 2.0 * self.duplex_gbps

    @property
    def matmul_tflops_bf16(self) -> float | None:
        """= matmul_tflops (dense bf16 GEMM, TFLOP/s); None on the CPU."""
        return self.matmul_tflops

    @property
    def matmul_tflops_fp32(self) -> None:
        """Not measured by ramstream: None."""
        return None

    @property
    def cpu_adamw_gelems(self) -> float:
        """Host AdamW rate in 1e9 parameters/s: adamw_gbps / 28 (the fp32-moment bytes per
        parameter adamw_gbps counts)."""
        return self.adamw_gbps / ADAMW_STATE_BYTES["float32"]

    # measured by TrainStream's profiler, not by ramstream's
    pageable_h2d_gbps = latency_us_4k = zero_copy_adamw_gelems = zero_copy_pcie_gbps = property(
        lambda self: None, doc="Not measured by ramstream: None."
    )
    elapsed_s = property(lambda self: None, doc="Not recorded by ramstream: None.")
    sweep_h2d = sweep_d2h = property(lambda self: {}, doc="No size sweep in ramstream: {}.")

    # TrainStream's derived quantities, from the fields above
    def transfer_ms(self, nbytes: float, direction: str = "h2d") -> float:
        """Milliseconds to copy nbytes one way ("h2d" or "d2h"); 0.0 without a measured rate."""
        gbps = self.h2d_gbps if direction == "h2d" else self.d2h_gbps
        return 0.0 if gbps <= 0 else nbytes / (gbps * 1e6)

    def compute_ms(self, flops: float, dtype: str = "bf16") -> float:
        """Milliseconds of dense GEMM for `flops` at the measured bf16 rate; 0.0 when it is not
        measured (fp32, or the CPU)."""
        tflops = self.matmul_tflops_bf16 if dtype == "bf16" else self.matmul_tflops_fp32
        return 0.0 if not tflops or tflops <= 0 else flops / (tflops * 1e9)

    @property
    def duplex_factor(self) -> float:
        """bidir_gbps over the faster one-way rate, in [1, 2] (1: the directions share one copy
        engine, 2: full duplex)."""
        one_way = max(self.h2d_gbps, self.d2h_gbps, 1e-9)
        return min(2.0, max(1.0, self.bidir_gbps / one_way))

    @property
    def break_even_flops_per_byte(self) -> float:
        """bf16 FLOPs per host-to-device byte above which a copy hides behind compute; 0.0 when
        the matmul rate is not measured."""
        return (self.matmul_tflops_bf16 or 0.0) * 1e12 / max(self.h2d_gbps * 1e9, 1.0)

    def link_ms(self, d2h_bytes: float, h2d_bytes: float) -> float:
        """Milliseconds the link needs for this mix of both directions, at duplex_factor."""
        d2h, h2d = self.transfer_ms(d2h_bytes, "d2h"), self.transfer_ms(h2d_bytes, "h2d")
        return max(d2h, h2d, (d2h + h2d) / self.duplex_factor)

    def summary(self) -> str:
        """A few lines for a log: device, copy rates, matmul and host AdamW rates."""
        mm = "n/a" if self.matmul_tflops is None else f"{self.matmul_tflops:.1f} TFLOP/s (bf16)"
        return "\n".join(
            [
                f"ramstream hardware profile: {self.gpu_name or 'CPU'} ({self.device}, {self.source})",
                f"  copies   h2d {self.h2d_gbps:.1f} GB/s, d2h {self.d2h_gbps:.1f} GB/s, "
                f"both at once {self.bidir_gbps:.1f} GB/s (duplex factor {self.duplex_factor:.2f})",
                f"  matmul   {mm}",
                f"  AdamW    host {self.cpu_adamw_gelems:.2f} G params/s ({self.cpu_threads} threads)",
            ]
        )
