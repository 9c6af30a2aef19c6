"""What is planned: the cluster, a layout, and where the parameters are."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from raytrain_lm.config.settings import ModelConfig
from raytrain_lm.config.sizes import split_layers

GB = 1e9  # bytes sent (link speeds are decimal)
GIB = 2 ** 30  # bytes of memory: an "80 GB" card holds 80 GiB (torch reports 80 x 2^30 for an A100 80GB)
USABLE_FRACTION = 0.9
# Defaults of the cluster (H100 SXM nodes of 8 GPUs):
# NVLink 4: 900 GB/s per GPU both directions together = 450 GB/s = 3600 Gb/s per direction.
H100_NVLINK_GBPS = 3600.0
# One 400 Gb/s InfiniBand (or RoCE) NIC per GPU, as in DGX H100 and Meta's Grand Teton hosts.
IB_400_GBPS = 400.0
H100_TFLOPS = 989.0  # H100 SXM dense bf16 (gpus.py)
GPUS_PER_NODE = 8

# Activation elements per layer per token, in units of the width: (whole on every tp rank without
# sequence parallelism, divided by tp). Sums: 17 without recomputation, 11 selective, 9 op (the
# block input; the outputs of c_attn, attention and c_fc: parallel/ac.py).
AC_SPLIT = {"none": (5, 12), "selective": (3, 8), "op": (1, 8)}
AC_MODES = ("none", "selective", "op", "full")
# STRATEGIES (config/checks.py), of the data-parallel dimension: ddp replicates everything; the
# others run on FSDP2 and hold parameters, gradients and AdamW's states sharded at rest: zero1
# gathers the parameters once per step, zero2 once per micro-step (both keep them through
# backward), fsdp (ZeRO-3) gathers them for each use.
PRECISIONS = ("auto", "fp32", "bf16", "fp16")


@dataclass(frozen=True)
class Cluster:
    gpus: int
    gpus_per_node: int = GPUS_PER_NODE
    memory_gb: float = 80.0
    intra_gbps: float = H100_NVLINK_GBPS  # per GPU per direction, gigabits per second
    inter_gbps: float = IB_400_GBPS
    tflops: float = H100_TFLOPS  # peak per GPU
    efficiency: Optional[float] = None  # of the peak, reached by the matmuls; None: efficiency.py
    gpu: bool = True  # False: CPU workers (fp32 activations)
    precision: str = "auto"  # the run's --precision: auto is bf16 on GPU, fp32 on CPU
    peak_fraction: Optional[float] = None  # efficiency.py's ceiling; None: its default
    # Whether the training framework overlaps the gradient reduction with backward (this
    # project's DDP and FSDP2 do; Megatron-LM's DDP of 2021 reduced after the backward pass)
    overlap_reduce: bool = True
    # Bytes a gradient value takes in the data-parallel reduction: fp32 here (FSDP2's
    # reduce_dtype, DDP's fp32 gradients); Megatron-LM reduces fp16 gradients in fp16 unless
    # --accumulate-allreduce-grads-in-fp32
    reduce_bytes: int = 4
    # Whether full recomputation stops once backward has what it needs (torch.utils.checkpoint's
    # non-reentrant default, this project's and torchtitan's: a block's last matmul and its
    # all-reduce are not run again); Megatron-LM's and DeepSpeed's checkpointing reruns the
    # whole block
    recompute_early_stop: bool = True
    # Whether pipeline sends overlap compute (torch.distributed.pipelining posts them
    # asynchronously); Megatron-LM's p2p of 2021 (and Megatron-DeepSpeed's) waits for each
    # batched send/receive and synchronizes the device before computing on
    overlap_pp: bool = True

    @property
    def budget(self) -> float:
        """Bytes a GPU may plan for: --gpu-memory-gb is GiB, as cards are sold."""
        return self.memory_gb * GIB * USABLE_FRACTION

    @property
    def act_bytes(self) -> int:
        """Activations, checkpointed block inputs, gathered FSDP parameters, tp collectives and
        pipeline sends: 2 bytes in bf16/fp16, 4 in fp32 (auto: bf16 on GPU, fp32 on CPU)."""
        if self.precision == "auto":
            return 2 if self.gpu else 4
        return 4 if self.precision == "fp32" else 2

    @property
    def node(self) -> int:
        """GPUs that share a node's fast links (all of them when they do not fill one node)."""
        return min(self.gpus_per_node, self.gpus)

    def inside(self, block: int) -> bool:
        """Whether a group whose ranks lie in aligned blocks of `block` consecutive ranks stays
        inside one node."""
        return block <= self.node and self.node % block == 0

    def bandwidth(self, block: int) -> float:
        """Bytes/s per GPU per direction for such a group."""
        return (self.intra_gbps if self.inside(block) else self.inter_gbps) * 1e9 / 8


@dataclass(frozen=True)
class Layout:
    dp: int
    tp: int
    pp: int
    strategy: str  # of the dp dimension: ddp, zero1, zero2 or fsdp
    ac: str  # activation checkpointing: none, selective, full
    sp: bool  # sequence parallelism
    schedule: str  # gpipe, 1f1b, interleaved-1f1b; "-" without pp
    micro_batch: int  # b: sequences per micro-batch
    microbatches: int  # n: pipeline microbatches (pp > 1), else gradient-accumulation steps
    seq_len: int
    virtual: int = 2  # stages per GPU of the interleaved schedule (the others run one)

    @property
    def gpus(self) -> int:
        return self.dp * self.tp * self.pp

    @property
    def v(self) -> int:
        """Pipeline stages per GPU."""
        return self.virtual if self.schedule == "interleaved-1f1b" else 1

    @property
    def sequences(self) -> int:
        """S: sequences per data-parallel rank per step."""
        return self.micro_batch * self.microbatches

    @property
    def sharded(self) -> bool:
        """Parameters, gradients and states shard only over a dp dimension of 2 or more
        (fsdp.apply_dp: FSDP2 runs zero1, zero2 and fsdp)."""
        return self.strategy != "ddp" and self.dp > 1

    @property
    def optimizer_shards(self) -> int:
        """Ranks AdamW's states are spread over: dp for every strategy but ddp."""
        return self.dp if self.strategy != "ddp" else 1

    @property
    def blocks(self) -> dict[str, int]:
        """Each dimension's groups as aligned blocks of consecutive ranks (parallel/mesh.py)."""
        return {"tp": self.tp, "dp": self.dp * self.tp, "pp": self.gpus}

    def flags(self) -> str:
        """This layout as `train` flags (the data-parallel size follows from --workers)."""
        out = [f"--tp {self.tp}", f"--pp {self.pp}", f"--strategy {self.strategy}",
               f"--activation-checkpointing {self.ac}"]
        if self.sp:
            out.append("--sequence-parallel")
        if self.pp > 1:
            out += [f"--pp-schedule {self.schedule}", f"--batch-size {self.sequences}",
                    f"--microbatches {self.microbatches}"]
            if self.schedule == "interleaved-1f1b" and self.v != 2:
                out.append(f"--virtual-stages {self.v}")
        else:
            out += [f"--batch-size {self.micro_batch}", f"--grad-accum {self.microbatches}"]
        return " ".join(out)


# ---------------------------------------------------------------- parameters

def param_counts(m: ModelConfig) -> dict[str, int]:
    h, V, L = m.n_embd, m.vocab_size or 256, m.n_layer
    if m.arch == "llama":  # q, o (h x h), k, v (h x kv heads), SwiGLU (3 h x hidden), 2 RMSNorms
        block = 2 * h * h + 2 * h * m.kv_heads * m.head_dim + 3 * h * m.hidden_dim + 2 * h
        root = 2 * V * h + h  # embedding, untied head, final norm
        return {"block": block, "root": root, "total": L * block + root}
    bias = 1 if m.bias else 0
    block = 12 * h * h + bias * (3 * h + h + 4 * h + h) + (2 + 2 * bias) * h
    root = V * h + m.block_size * h + (1 + bias) * h  # tied embedding, positions, final norm
    return {"block": block, "root": root, "total": L * block + root}


def matmul_params(m: ModelConfig) -> int:
    """The N of 6N FLOPs per token, as model.Decoder.matmul_params counts it: the GPT's
    parameters but its position embeddings (the tied embedding counts as the head), the Llama's
    but its embedding (a lookup; its head is its own matrix)."""
    lookup = (m.vocab_size or 256) * m.n_embd if m.arch == "llama" else m.block_size * m.n_embd
    return param_counts(m)["total"] - lookup


def tp_param_counts(m: ModelConfig, tp: int) -> dict[str, float]:
    """Parameters one tp rank holds, per piece (parallel/tp.py's layouts). "head": an untied
    output projection (Llama); without it the last stage holds a copy of the tied wte."""
    h, V, T = m.n_embd, m.vocab_size or 256, m.block_size
    if m.arch == "llama":  # every matrix split, the RMSNorms whole
        split = 2 * h * h + 2 * h * m.kv_heads * m.head_dim + 3 * h * m.hidden_dim
        return {"block": split / tp + 2 * h, "wte": V * h / tp, "wpe": 0, "ln_f": h,
                "head": V * h / tp}
    bias = 1 if m.bias else 0
    ln = (1 + bias) * h
    # Split: c_attn (3h x h + 3h), c_fc (4h x h + 4h), attn.c_proj (h x h), mlp.c_proj (h x 4h).
    # Whole: the row-parallel biases (h each) and the two LayerNorms.
    block = (12 * h * h + bias * 7 * h) / tp + bias * 2 * h + 2 * ln
    return {"block": block, "wte": V * h / tp, "wpe": T * h / tp, "ln_f": ln}


def activation_split(m: ModelConfig, ac: str) -> tuple[float, float]:
    """Saved activations per layer per token in units of the width, (whole on every tp rank
    without sequence parallelism, divided by tp), for ac none or selective. GPT: AC_SPLIT. Llama,
    counted the same way: without recomputation the two norm inputs and the inputs of q/k/v and
    of the MLP stay whole (4); the rotated q and k, v, the attention output and SwiGLU's gate,
    up, silu(gate) and product (4 x hidden) divide. Selective keeps the block input and the two
    row-parallel outputs whole (3) and the q/k/v and attention outputs, gate and up divided. Op
    (every other matmul: parallel/ac.py) keeps the block input and the down projection's output
    whole (2), and the q, v, attention and gate outputs divided."""
    if m.arch != "llama":
        return AC_SPLIT[ac]
    kv, f = 2 * m.kv_heads / m.n_head, m.hidden_dim / m.n_embd
    return {"none": (4, 2 + kv + 4 * f), "selective": (3, 2 + kv + 2 * f),
            "op": (2, 2 + kv / 2 + f)}[ac]


@dataclass(frozen=True)
class Stage:
    layers: int
    first: bool
    last: bool


def rank_stages(m: ModelConfig, pp: int, v: int) -> list[list[Stage]]:
    """Each pp rank's stages: stage s on rank s % pp ("loop" placement, parallel/pp.py)."""
    n = pp * v
    sizes = [len(r) for r in split_layers(m.n_layer, n)]
    return [[Stage(sizes[s], s == 0, s == n - 1) for s in range(r, n, pp)] for r in range(pp)]


def stage_params(p: dict[str, float], st: Stage) -> float:
    """A stage's parameters. Tied (no "head"): wte on the first and the last stage, once where
    one stage is both. Untied: wte on the first, the head on the last."""
    head = p.get("head")
    embeddings = p["wte"] if st.first or (st.last and head is None) else 0
    return (st.layers * p["block"] + embeddings + (head if st.last and head else 0)
            + (p["wpe"] if st.first else 0) + (p["ln_f"] if st.last else 0))


def held_params(p: dict[str, float], stages: list[Stage]) -> float:
    return sum(stage_params(p, st) for st in stages)


def root_params(p: dict[str, float], stages: list[Stage]) -> float:
    """Parameters outside the blocks (FSDP's root group) on a rank."""
    return sum(stage_params(p, Stage(0, st.first, st.last)) for st in stages)


def candidate_ranks(ranks: list[list[Stage]]) -> list[int]:
    """The pp ranks that can be the worst: the first (most microbatches in flight, embeddings),
    the last (head, logits), and of the others the first with each layer count (a later rank
    with as many layers holds fewer microbatches and sends as much)."""
    p = len(ranks)
    out = {0, p - 1}
    seen = set()
    for r in range(1, p - 1):
        layers = sum(st.layers for st in ranks[r])
        if layers not in seen:
            seen.add(layers)
            out.add(r)
    return sorted(out)
