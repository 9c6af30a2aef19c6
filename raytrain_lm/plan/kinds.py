"""The one GPU table: every GPU kind the project knows (gpu_kinds.json, each figure with its
source), as `plan --gpu KIND`, the memory check and a worker's MFU read it. Which kind a device
name or a Ray label names is plan/gpus.py's; the cluster a kind makes is plan/hardware.py's.
Standard library only: a GPU host with torch alone reads it (bench/gpu_check.py)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Optional

from raytrain_lm.errors import UserError

PATH = Path(__file__).with_name("gpu_kinds.json")
DEFAULT_KIND = "h100-sxm"  # `plan`'s --gpu when none is named
PRECISIONS = ("bf16", "fp16", "fp32")


@dataclass(frozen=True)
class GPUKind:
    key: str
    name: str
    devices: tuple[str, ...]  # the name keys of the CUDA device names it is (plan/gpus.py)
    ray_labels: tuple[str, ...]  # Ray's labels not derived from a device key (AMD's)
    arch: str
    bf16_tflops: Optional[float]  # dense peaks; None: no such units
    fp16_tflops: float
    fp32_tflops: float  # TF32 where the GPU has it
    memory_gb: float
    hbm_tbps: float
    intra_gbs: float  # GB/s per GPU per direction inside a node
    gpus_per_node: int
    nics_per_node: int
    nic_gbps: float
    matmul_fraction: float  # MAMF / peak, measured (or the same chip's)
    fitted_clock: bool  # a power-capped part: its clock factor is fitted (calibration.json)
    attention_fraction: float  # flash attention's fraction of the peak, by architecture
    note: str

    @property
    def half_tflops(self) -> float:
        """The peak the planner plans with: bf16, or fp16 on a GPU without bf16 units (where
        precision auto runs fp16)."""
        return self.bf16_tflops or self.fp16_tflops

    def peak(self, precision: str) -> Optional[float]:
        """The dense peak of a run in `precision` (bf16, fp16, fp32: TF32 where it has it)."""
        return {"bf16": self.bf16_tflops, "fp16": self.fp16_tflops, "fp32": self.fp32_tflops}[precision]

    @property
    def inter_gbps(self) -> float:
        """The node's NIC bandwidth per GPU, Gb/s per direction."""
        return self.nics_per_node * self.nic_gbps / self.gpus_per_node


@lru_cache(maxsize=1)
def kinds() -> dict[str, GPUKind]:
    data = json.loads(PATH.read_text())
    raw, flash = data["kinds"], data["flash_fraction"]
    out = {}
    for key, k in raw.items():
        frac = k.get("matmul_fraction") or raw[k["matmul_from"]]["matmul_fraction"]
        out[key] = GPUKind(key, k["name"], tuple(k["devices"]), tuple(k.get("ray_labels", ())), k["arch"],
                           k["bf16_tflops"], k["fp16_tflops"], k["fp32_tflops"], k["memory_gb"], k["hbm_tbps"],
                           k["intra_gbs"], k["gpus_per_node"], k["nics_per_node"], k["nic_gbps"], frac,
                           k.get("clock_factor") == "fitted", flash.get(k["arch"], flash["other"]),
                           k.get("note", ""))
    return out


def kind(key: str) -> GPUKind:
    if key not in kinds():
        raise UserError(f"--gpu must be one of {', '.join(kinds())}, got {key!r}")
    return kinds()[key]


def kinds_markdown() -> str:
    """docs/planner.md's table of the kinds (gpu_kinds.json's figures; its sources there)."""
    from raytrain_lm.plan.calibration import clock_factor

    lines = ["| --gpu | GPU | CUDA device / Ray label | TFLOP/s bf16 / fp16 / fp32 | GB | HBM TB/s | "
             "links in a node, GB/s per direction | node: GPUs, NICs x Gb/s | large matmuls reach "
             "(of the peak) | flash attention |",
             "|---|---|---|---|---:|---:|---:|---|---:|---:|"]
    for k in kinds().values():
        reach = f"{k.matmul_fraction:.3f}" + (f" x {clock_factor(k.key):.3g} (fitted clock)" if k.fitted_clock else "")
        names = ", ".join(k.devices + k.ray_labels) or "-"
        peaks = " / ".join("-" if p is None else f"{p:g}" for p in map(k.peak, PRECISIONS))
        lines.append(f"| `{k.key}` | {k.name} | {names} | {peaks} | {k.memory_gb:g} | {k.hbm_tbps:g} | "
                     f"{k.intra_gbs:g} | {k.gpus_per_node}, {k.nics_per_node} x {k.nic_gbps:g} | {reach} | "
                     f"{k.attention_fraction:g} |")
    return "\n".join(lines)
