"""The GPU kinds the planner knows (gpu_kinds.json: every figure with its source) and the cluster
a kind makes: `plan --gpu KIND` takes its peak, memory, HBM, links, node and achievable rates
from here, and any flag the user gives overrides one of them."""

from __future__ import annotations

import json
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Optional

from raytrain_lm.errors import UserError
from raytrain_lm.plan.hardware import Cluster

PATH = Path(__file__).with_name("gpu_kinds.json")
DEFAULT_KIND = "h100-sxm"
# Flash attention's fraction of the peak, as published: FlashAttention-2 on A100 'reaching 50-73%
# of the theoretical maximum FLOPs/s' (Dao 2023, arXiv 2307.08691; the middle taken), and on H100
# 'only 35% utilization' (Shah et al. 2024, FlashAttention-3, arXiv 2407.08608). Other chips: the
# H100's, assumed.
FLASH_FRACTION = {"ampere": 0.6, "other": 0.35}


@dataclass(frozen=True)
class GPUKind:
    key: str
    name: str
    bf16_tflops: float
    memory_gb: float
    hbm_tbps: float
    intra_gbs: float  # GB/s per GPU per direction inside a node
    gpus_per_node: int
    nics_per_node: int
    nic_gbps: float
    matmul_fraction: float  # MAMF / peak, measured (or the same chip's)
    fitted_clock: bool  # a power-capped part: its clock factor is fitted (calibration.json)
    note: str

    @property
    def inter_gbps(self) -> float:
        """The node's NIC bandwidth per GPU, Gb/s per direction."""
        return self.nics_per_node * self.nic_gbps / self.gpus_per_node

    @property
    def attention_fraction(self) -> float:
        return FLASH_FRACTION["ampere" if self.key.startswith(("a100", "a10g")) else "other"]


@lru_cache(maxsize=1)
def kinds() -> dict[str, GPUKind]:
    raw = json.loads(PATH.read_text())["kinds"]
    out = {}
    for key, k in raw.items():
        frac = k.get("matmul_fraction") or raw[k["matmul_from"]]["matmul_fraction"]
        out[key] = GPUKind(key, k["name"], k["bf16_tflops"], k["memory_gb"], k["hbm_tbps"], k["intra_gbs"],
                           k["gpus_per_node"], k["nics_per_node"], k["nic_gbps"], frac,
                           k.get("clock_factor") == "fitted", k.get("note", ""))
    return out


def kind(key: str) -> GPUKind:
    if key not in kinds():
        raise UserError(f"--gpu must be one of {', '.join(kinds())}, got {key!r}")
    return kinds()[key]


def kind_cluster(key: str, gpus: int, gpus_per_node: Optional[int] = None,
                 memory_gb: Optional[float] = None, intra_gbps: Optional[float] = None,
                 inter_gbps: Optional[float] = None, tflops: Optional[float] = None,
                 hbm_tbps: Optional[float] = None, **rest) -> Cluster:
    """The cluster of `gpus` GPUs of kind `key`; a figure given overrides the kind's."""
    from raytrain_lm.plan.calibration import clock_factor

    k = kind(key)

    def given(value, default):
        return default if value is None else value

    return Cluster(gpus=gpus, gpus_per_node=given(gpus_per_node, k.gpus_per_node),
                   memory_gb=given(memory_gb, k.memory_gb), intra_gbps=given(intra_gbps, k.intra_gbs * 8),
                   inter_gbps=given(inter_gbps, k.inter_gbps), tflops=given(tflops, k.bf16_tflops),
                   kind=key, hbm_tbps=given(hbm_tbps, k.hbm_tbps), matmul_fraction=k.matmul_fraction,
                   clock_factor=clock_factor(key), attention_fraction=k.attention_fraction, **rest)


# Ray's accelerator labels (ray/_private/accelerators: NVIDIA's first model token, AMD's product
# name) -> the kind; a label two memory sizes share is told apart by the memory per GPU.
LABELS = {"H100": "h100-sxm", "H200": "h200", "H800": "h800", "B200": "b200", "L40S": "l40s",
          "A10G": "a10g", "AMD-Instinct-MI300X-OAM": "mi300x"}


def kind_of_label(label: str, memory_gb: Optional[float] = None) -> Optional[str]:
    """The kind a Ray accelerator label names (None: not one the planner knows)."""
    if label == "A100":
        return "a100-40gb" if memory_gb and memory_gb <= 40 else "a100-80gb"
    return LABELS.get(label)


def kinds_markdown() -> str:
    """docs/planner.md's table of the kinds (gpu_kinds.json's figures; its sources there)."""
    from raytrain_lm.plan.calibration import clock_factor

    lines = ["| --gpu | GPU | bf16 TFLOP/s | GB | HBM TB/s | links in a node, GB/s per direction | "
             "node: GPUs, NICs x Gb/s | large matmuls reach (of the peak) | flash attention |",
             "|---|---|---:|---:|---:|---:|---|---:|---:|"]
    for k in kinds().values():
        reach = f"{k.matmul_fraction:.3f}" + (f" x {clock_factor(k.key):.3g} (fitted clock)" if k.fitted_clock else "")
        lines.append(f"| `{k.key}` | {k.name} | {k.bf16_tflops:g} | {k.memory_gb:g} | {k.hbm_tbps:g} | "
                     f"{k.intra_gbs:g} | {k.gpus_per_node}, {k.nics_per_node} x {k.nic_gbps:g} | {reach} | "
                     f"{k.attention_fraction:g} |")
    return "\n".join(lines)
