"""Which GPU kind (plan/kinds.py, the one table) a CUDA device name or a Ray accelerator label
names, and the peak and memory that follow; and whether torch's CUDA build suits the node's driver.

Names are matched exactly, never by substring: "NVIDIA L40" is not an "L4", and Ray's label "A100"
does not say whether the card has 40 or 80 GB (Ray derives its label from the first model token
of the device name: "NVIDIA A100-SXM4-80GB" -> "A100"; ray/_private/accelerators/nvidia_gpu.py).
"""

from __future__ import annotations

import re
from functools import lru_cache
from typing import Optional

from raytrain_lm.plan.kinds import GPUKind, kinds

BRANDS = ("NVIDIA", "Tesla")


@lru_cache(maxsize=1)
def _device_keys() -> dict[str, str]:
    """Each device name key (gpu_kinds.json's `devices`) -> its kind."""
    out: dict[str, str] = {}
    for k in kinds().values():
        for name in k.devices:
            if name in out:
                raise ValueError(f"gpu_kinds.json: device {name!r} is both {out[name]} and {k.key}")
            out[name] = k.key
    return out


def kind_of_device(device_name: str) -> Optional[str]:
    """The kind of a CUDA device name ("NVIDIA H100 PCIe" -> h100-pcie, "NVIDIA A100-SXM4-80GB"
    -> a100-80gb, "NVIDIA L40" -> l40); None for a model not in the table and for a MIG slice (a
    part of a GPU: less memory, fewer cores)."""
    words = [w for w in re.split(r"[\s-]+", device_name.strip()) if w and w not in BRANDS]
    if not words or "MIG" in words:
        return None
    chip, rest = words[0], [w.upper() for w in words[1:]]
    form = "NVL" if "NVL" in rest else "PCIe" if "PCIE" in rest else None
    memory = next((w for w in rest if re.fullmatch(r"\d+GB", w)), None)
    # The form factor first (an H100 PCIe and an H100 SXM both have 80 GB), then the memory.
    keys = _device_keys()
    return next((keys[k] for k in (f"{chip} {form}", f"{chip} {memory}", chip) if k in keys), None)


def peak_tflops(device_name: str, precision: str = "bf16") -> Optional[float]:
    """The dense peak of this device's kind for a run in `precision` (fp32, bf16, fp16)."""
    key = kind_of_device(device_name)
    return kinds()[key].peak(precision) if key else None


def _label_kinds(label: str) -> list[GPUKind]:
    """The kinds a Ray accelerator label may stand for, in the table's order: those with a device
    key whose first word is the label (as Ray derives it), or that list it (AMD's). "A100-80G",
    a label a user adds by hand, names the memory too."""
    chip, _, size = label.partition("-")
    return [k for k in kinds().values() if label in k.ray_labels or any(
        name.split()[0] == chip and (not size or name == f"{chip} {size}B") for name in k.devices)]


def label_memory_gb(label: str) -> Optional[float]:
    """Memory per GPU of a Ray accelerator_type label when the label determines it ("L4" -> 24,
    "A100-80G" -> 80, "H200" -> 141); None when kinds of different memory share it ("A100",
    "H100", "V100") or it is unknown."""
    sizes = {k.memory_gb for k in _label_kinds(label)}
    return sizes.pop() if len(sizes) == 1 else None


def kind_of_label(label: str, memory_gb: Optional[float] = None) -> Optional[str]:
    """The kind a Ray accelerator label names (None: none the table knows). Where kinds share
    the label, the memory per GPU tells them apart (the smallest that holds it: 40 GiB is the A100
    40GB, 94 the H100 NVL); without it, or among equals, the first in the table (H100 -> the SXM
    part)."""
    candidates = _label_kinds(label)
    if not candidates:
        return None
    if memory_gb:
        holding = [k for k in candidates if k.memory_gb >= memory_gb]
        return (min(holding, key=lambda k: k.memory_gb) if holding
                else max(candidates, key=lambda k: k.memory_gb)).key
    return candidates[0].key


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
    import torch  # torch: cluster.yaml's setup asks the installed torch its CUDA

    line = cuda_mismatch(torch.version.cuda, driver_cuda_version())
    if line:
        print(f"WARNING: {line}", flush=True)
