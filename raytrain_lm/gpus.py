"""What the project knows about GPU models: which model a device name or a Ray accelerator label
names, its dense bf16 peak (for MFU) and its memory (for the memory check).

Names are matched exactly, never by substring: "NVIDIA L40" is not an "L4", and Ray's label "A100"
does not say whether the card has 40 or 80 GB (Ray derives its label from the first model token
of the device name: "NVIDIA A100-SXM4-80GB" -> "A100"; ray/_private/accelerators/nvidia_gpu.py).
"""

from __future__ import annotations

import re
from typing import Optional

# model: (dense bf16 tensor-core peak in TFLOP/s without sparsity, memory in GB as sold), from the
# vendors' datasheets; None: no bf16 tensor cores or no published figure. Keys are what
# `gpu_model` reads from torch's device name.
GPUS: dict[str, tuple[Optional[float], float]] = {
    "H200": (989.0, 141),  # "NVIDIA H200" (SXM)
    "H200 NVL": (835.0, 141),
    "H100 80GB": (989.0, 80),  # "NVIDIA H100 80GB HBM3" (SXM)
    "H100 PCIe": (756.0, 80),
    "H100 NVL": (835.0, 94),
    "A100 80GB": (312.0, 80),  # "NVIDIA A100-SXM4-80GB", "NVIDIA A100 80GB PCIe"
    "A100 40GB": (312.0, 40),  # "NVIDIA A100-SXM4-40GB", "NVIDIA A100-PCIE-40GB"
    "L40S": (362.0, 48),
    "L40": (181.0, 48),
    "L4": (121.0, 24),
    "A10": (125.0, 24),
    "A10G": (None, 24),  # AWS's variant of the A10: no published peak
    "V100 32GB": (None, 32),
    "V100 16GB": (None, 16),
    "T4": (None, 16),
}
BRANDS = ("NVIDIA", "Tesla")


def gpu_model(device_name: str) -> Optional[str]:
    """The GPUS key of a CUDA device name ("NVIDIA H100 PCIe" -> "H100 PCIe", "NVIDIA
    A100-SXM4-80GB" -> "A100 80GB", "NVIDIA L40" -> "L40"); None for a model not in the table
    and for a MIG slice (a part of a GPU: less memory, fewer cores)."""
    words = [w for w in re.split(r"[\s-]+", device_name.strip()) if w and w not in BRANDS]
    if not words or "MIG" in words:
        return None
    chip, rest = words[0], [w.upper() for w in words[1:]]
    form = "NVL" if "NVL" in rest else "PCIe" if "PCIE" in rest else None
    memory = next((w for w in rest if re.fullmatch(r"\d+GB", w)), None)
    # The form factor first (an H100 PCIe and an H100 SXM both have 80 GB), then the memory.
    return next((key for key in (f"{chip} {form}", f"{chip} {memory}", chip) if key in GPUS), None)


def peak_tflops(device_name: str) -> Optional[float]:
    model = gpu_model(device_name)
    return GPUS[model][0] if model else None


def label_memory_gb(label: str) -> Optional[float]:
    """Memory per GPU of a Ray accelerator_type label when the label determines it ("L4" -> 24,
    "A100-80G" -> 80, "H200" -> 141); None when models of different memory share it ("A100",
    "H100", "V100") or it is unknown."""
    chip, _, size = label.partition("-")  # "A100-80G": a label a user adds by hand
    sizes = {memory for model, (_, memory) in GPUS.items()
             if model.split()[0] == chip and (not size or model == f"{chip} {size}B")}
    return sizes.pop() if len(sizes) == 1 else None
