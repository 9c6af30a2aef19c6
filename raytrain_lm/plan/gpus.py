"""What the project knows about GPU models: which model a device name or a Ray accelerator label
names, its dense peaks per precision (for MFU) and its memory (for the memory check).

Names are matched exactly, never by substring: "NVIDIA L40" is not an "L4", and Ray's label "A100"
does not say whether the card has 40 or 80 GB (Ray derives its label from the first model token
of the device name: "NVIDIA A100-SXM4-80GB" -> "A100"; ray/_private/accelerators/nvidia_gpu.py).
"""

from __future__ import annotations

import re
from typing import NamedTuple, Optional


class GPU(NamedTuple):
    """Dense tensor-core peaks in TFLOP/s without sparsity, from the vendors' datasheets (None: no
    such tensor cores or no published figure), and memory in GB as sold. `fp32` is the peak an
    fp32 run reaches: TF32 tensor cores where the GPU has them (a GPU worker enables TF32 for
    fp32 matmuls, loop.py), else the plain fp32 units."""
    bf16: Optional[float]
    fp16: Optional[float]
    fp32: Optional[float]
    memory: float


# Keys are what `gpu_model` reads from torch's device name.
GPUS: dict[str, GPU] = {
    "B200": GPU(2250.0, 2250.0, 1100.0, 180),  # "NVIDIA B200" (HGX: 180 GB per GPU)
    "GH200": GPU(989.0, 989.0, 494.0, 96),  # "NVIDIA GH200 480GB" (the 480 GB: CPU + GPU
    #                                         memory; 96 GB HBM3 on the GPU, 144 on the HBM3e one)
    "H200": GPU(989.0, 989.0, 494.0, 141),  # "NVIDIA H200" (SXM)
    "H200 NVL": GPU(835.0, 835.0, 417.0, 141),
    "H100 80GB": GPU(989.0, 989.0, 494.0, 80),  # "NVIDIA H100 80GB HBM3" (SXM)
    "H100 PCIe": GPU(756.0, 756.0, 378.0, 80),
    "H100 NVL": GPU(835.0, 835.0, 417.0, 94),
    "H800": GPU(989.0, 989.0, 494.0, 80),  # "NVIDIA H800" (SXM: the H100's compute, less NVLink)
    "H800 PCIe": GPU(756.0, 756.0, 378.0, 80),
    "A100 80GB": GPU(312.0, 312.0, 156.0, 80),  # "NVIDIA A100-SXM4-80GB", "NVIDIA A100 80GB PCIe"
    "A100 40GB": GPU(312.0, 312.0, 156.0, 40),  # "NVIDIA A100-SXM4-40GB", "NVIDIA A100-PCIE-40GB"
    "L40S": GPU(362.0, 362.0, 183.0, 48),
    "L40": GPU(181.0, 181.0, 90.5, 48),
    "L4": GPU(121.0, 121.0, 60.0, 24),
    "A10": GPU(125.0, 125.0, 62.5, 24),
    # AWS's variant of the A10 (g5 instances): NVIDIA publishes no datasheet; the A10's figures
    # (the same GA102 chip), as AWS's and cloud providers' tables give them. --peak-tflops
    # overrides where a measured figure is wanted.
    "A10G": GPU(125.0, 125.0, 62.5, 24),
    "V100 32GB": GPU(None, 125.0, 15.7, 32),  # no bf16 units: auto picks fp16 (step.py)
    "V100 16GB": GPU(None, 125.0, 15.7, 16),
    "T4": GPU(None, 65.0, 8.1, 16),
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


def peak_tflops(device_name: str, precision: str = "bf16") -> Optional[float]:
    """The dense peak of this device's model for a run in `precision` (fp32, bf16, fp16)."""
    model = gpu_model(device_name)
    return getattr(GPUS[model], precision) if model else None


def label_memory_gb(label: str) -> Optional[float]:
    """Memory per GPU of a Ray accelerator_type label when the label determines it ("L4" -> 24,
    "A100-80G" -> 80, "H200" -> 141); None when models of different memory share it ("A100",
    "H100", "V100") or it is unknown."""
    chip, _, size = label.partition("-")  # "A100-80G": a label a user adds by hand
    sizes = {gpu.memory for model, gpu in GPUS.items()
             if model.split()[0] == chip and (not size or model == f"{chip} {size}B")}
    return sizes.pop() if len(sizes) == 1 else None


def cuda_mismatch(torch_cuda: Optional[str], driver_version: Optional[int]) -> Optional[str]:
    """One line when torch's CUDA build (torch.version.cuda, "12.8") needs a newer driver than
    the node's (cuDriverGetVersion: 12040 for CUDA 12.4), else None (a CPU build, no driver,
    or a driver new enough)."""
    if not torch_cuda or not driver_version:
        return None
    major, minor = (int(x) for x in torch_cuda.split(".")[:2])
    have = (driver_version // 1000, driver_version % 1000 // 10)
    if have >= (major, minor):
        return None
    runs = ("most kernels run under CUDA's minor-version compatibility, some may not load"
            if have[0] == major else "CUDA will not start")
    return (f"torch is built for CUDA {major}.{minor} but this node's NVIDIA driver supports "
            f"{have[0]}.{have[1]} ({runs}); use an image with a newer driver or a torch build "
            f"for CUDA {have[0]}.{have[1]} or older")


def driver_cuda_version() -> Optional[int]:
    """The CUDA version the installed NVIDIA driver supports (cuDriverGetVersion), or None."""
    import ctypes

    try:
        libcuda = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return None
    version = ctypes.c_int(0)
    return version.value if libcuda.cuDriverGetVersion(ctypes.byref(version)) == 0 else None


def say_cuda_mismatch() -> None:
    """cluster.yaml's setup: print the mismatch line, if any (never fails the setup)."""
    import torch

    line = cuda_mismatch(torch.version.cuda, driver_cuda_version())
    if line:
        print(f"WARNING: {line}", flush=True)
