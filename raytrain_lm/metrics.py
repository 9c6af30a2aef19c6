"""Throughput, MFU and memory: what a worker measures about its own steps."""

from __future__ import annotations

import resource
import sys
import time
from typing import Optional

import torch

# Dense bf16 tensor-core peaks (TFLOP/s, no sparsity), from the vendors' datasheets.
PEAK_BF16_TFLOPS = {
    "H200": 989.0,
    "H100 SXM": 989.0,
    "H100 80GB HBM3": 989.0,
    "H100 NVL": 835.0,
    "H100 PCIe": 756.0,
    "A100": 312.0,
    "L40S": 362.0,
    "L4": 121.0,
}


def gpu_peak_tflops(device: torch.device, override: Optional[float] = None) -> Optional[float]:
    """The peak used for MFU: `override`, else the table's entry for this GPU, else None (no MFU)."""
    if override:
        return override
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    # Longest key first, so "H100 PCIe" wins over a bare "H100".
    for key in sorted(PEAK_BF16_TFLOPS, key=len, reverse=True):
        if key in name:
            return PEAK_BF16_TFLOPS[key]
    if "H100" in name:
        return PEAK_BF16_TFLOPS["H100 SXM"]
    return None


def mfu(tokens_per_second: float, flops_per_token: float, num_devices: int,
        peak_tflops: Optional[float]) -> Optional[float]:
    """Model FLOPs utilisation: achieved model FLOP/s over the devices' summed peak."""
    if not peak_tflops:
        return None
    return tokens_per_second * flops_per_token / (num_devices * peak_tflops * 1e12)


def peak_memory_gb(device: torch.device) -> float:
    """Peak allocated GPU memory on CUDA; peak resident set size of this process on CPU. GB = 1e9
    bytes throughout, as in `plan`."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 1e9
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux, bytes on macOS
    return rss * (1 if sys.platform == "darwin" else 1024) / 1e9


class StepTimer:
    """Accumulates wall time, time spent waiting for data, and tokens between two log points."""

    def __init__(self, device: torch.device):
        self.device = device
        self.reset()

    def reset(self, excluded: float = 0.0) -> None:
        """Start a new interval at the last log point: the cost of logging and reporting (a
        barrier) counts against the next interval; `excluded` seconds (eval, checkpoint) do not."""
        self._sync()
        now = time.perf_counter()
        self.start = getattr(self, "mark", now) + excluded
        self.mark = now
        self.data_wait = 0.0
        self.tokens = 0
        self.steps = 0

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def elapsed(self) -> float:
        """Seconds since the interval started; marks now as the end of the interval."""
        self._sync()
        self.mark = time.perf_counter()
        return self.mark - self.start
