"""What every model family shares, torch-free: `ModelShape`, the model settings every family
reads (its size and its `arch`), and `Family`, what generic code (checks, the planner, parallel/,
export) asks a model family instead of branching on `model.arch`. Each family's folder subclasses
both: its settings (a ModelShape with its own fields) and its Family (its `__init__.py`, no torch)
beside its decoder (torch); models/family.py composes the settings into the one ModelConfig and
lists the families.

A Family answers from the config alone (no module is built): its settings' rules, its parameter
counts per piece (the one count: the planner, the loop's MFU and the tests' check against a
built module all read it), the weights of its blocks' matmuls (the one FLOPs count), its
activations per token, its tensor-parallel plan (which projections split by output, which by
input) and what its Hugging Face format is.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

from raytrain_lm.errors import UserError
from raytrain_lm.setting import setting


@dataclass
class ModelShape:
    """The `model.` settings of every family (a family's folder adds its own: ModelConfig)."""
    vocab_size: Optional[int] = setting(None, help="Vocabulary size [default: the dataset's tokenizer's].")
    block_size: int = setting(256, help="Longest context the model can attend to (position embeddings).")
    n_layer: int = setting(4, help="Transformer blocks.")
    n_head: int = setting(4, help="Attention heads per block.")
    n_embd: int = setting(128, help="Width of the residual stream (a multiple of n_head).")
    dropout: float = setting(0.0, help="Dropout probability (attention, residual, embeddings).")
    arch: str = setting("gpt", help="Architecture (models/family.py's FAMILIES).")

    @property
    def kv_heads(self) -> int:
        return self.n_head

    @property
    def head_dim(self) -> int:
        return self.n_embd // self.n_head


@dataclass(frozen=True)
class ParamCounts:
    """Parameters of one block, of everything outside the blocks, and in all."""
    block: int
    root: int
    total: int


@dataclass(frozen=True)
class TPPlan:
    """A block's modules by how tensor parallelism splits them (parallel/tp.py applies it):
    `colwise` linears by output features (whole heads, a slice of the MLP's hidden units; their
    biases with their rows), `rowwise` by input features (their outputs all-reduced, or
    reduce-scattered over the sequence), `head_norms`: norms applied to each head of a colwise
    output, where a model has them (weights whole on every rank, gradients summed over the
    ranks' heads); `whole` modules stay whole on every tp rank, their input gathered over the
    sequence and their output sliced back to it under sequence parallelism (a mixture of
    experts)."""
    colwise: tuple[str, ...]
    rowwise: tuple[str, ...]
    head_norms: tuple[str, ...] = ()
    whole: tuple[str, ...] = ()


class Family:
    """A model family: the answers generic code needs, from a ModelConfig. Subclasses (one per
    folder of models/) set the attributes and override what differs; the defaults below are
    what holds for every decoder built on models/decoder.py."""

    name: str  # model.arch
    title: str  # in messages and in `train`'s help ("Train a GPT, Llama, ...")
    summary: str  # what it is, in --arch's help
    hf_releases: tuple[str, ...] = ()  # the releases --init-from imports (Hugging Face folders)
    decoder: str  # "module:Class" of its torch module (imported only where a model is built)
    tp_plan: TPPlan
    # What choosing the family sets, right after the preset (`--arch llama` on a GPT preset: its
    # shape as a Llama); a file, flags and --set still override it.
    defaults: dict[str, Any] = {}
    # Its Hugging Face format, where it has one: the module whose ADAPTER (models/hf.HFAdapter)
    # maps names, tensors and config.json; None: exported in this project's own format only.
    hf_adapter: Optional[str] = None
    hf_model_types: tuple[str, ...] = ()  # the model_type of the Hugging Face folders it imports
    export_format: str = ""
    export_notes: dict[str, Any] = {}  # what a native export's config.json says of its layout
    experts: Optional[str] = None  # a block's routed experts module, which expert parallelism splits
    # What a saved config of this family that lacks a setting meant (TrainConfig.from_dict): the
    # value the code used before the setting existed.
    saved_before: dict[str, Any] = {}

    def check(self, m: ModelShape) -> None:
        """The family's own rules for its settings: one UserError line each."""

    def tied(self, m: ModelShape) -> bool:
        """Whether the output head is the token embedding (one parameter: a pipeline's first and
        last stage then each hold a copy, their gradients summed)."""
        return False

    def check_layout(self, m: ModelShape, tp: int, ep: int = 1) -> Optional[str]:
        """Why `tp` tensor-parallel ranks (and `ep` expert-parallel ones) cannot split this model,
        or None: every tp rank holds whole query heads and whole key/value heads (the GPT's are
        its query heads). A family with experts adds that `ep` divides them."""
        if m.n_head % tp:
            return (f"model.n_head ({m.n_head}) must be divisible by --tp {tp}: each "
                    f"tensor-parallel rank holds whole attention heads")
        if m.kv_heads % tp:
            return (f"model.n_kv_head ({m.kv_heads}) must be divisible by --tp {tp}: each "
                    f"tensor-parallel rank holds whole key/value heads")
        if ep > 1:
            return (f"--ep {ep} splits a mixture of experts (model.arch moe); model.arch "
                    f"{self.name} has no experts: drop --ep")
        return None

    def hidden_dim(self, m: ModelShape) -> int:
        return 4 * m.n_embd

    def counts(self, m: ModelShape) -> ParamCounts:
        raise NotImplementedError

    def lookup_params(self, m: ModelShape) -> int:
        """Parameters read by lookup, not multiplied (position or token embeddings)."""
        raise NotImplementedError

    def active_params(self, m: ModelShape) -> int:
        """Parameters a token passes through (a mixture of experts: k of its experts)."""
        return self.counts(m).total

    def active_block(self, m: ModelShape) -> int:
        """A block's parameters a token passes through (the planner's FLOPs per block)."""
        return self.counts(m).block

    def expert_params(self, m: ModelShape) -> int:
        """A block's routed experts' parameters, which expert parallelism splits (none here)."""
        return 0

    def matmul_params(self, m: ModelShape) -> int:
        """The N of 6N FLOPs per token: the parameters used in matrix multiplies."""
        return self.counts(m).total - self.lookup_params(m)

    def tp_counts(self, m: ModelShape, tp: int) -> dict[str, float]:
        """Parameters one tp rank holds, per piece: "block", "wte", "wpe", "ln_f", and "head"
        for an untied output projection (without it the last stage holds a copy of the tied
        wte)."""
        raise NotImplementedError

    def block_matmuls(self, m: ModelShape) -> list[int]:
        """A block's matmuls in forward order, by weight elements (their forward FLOPs: 2 per
        element per token)."""
        raise NotImplementedError

    def activation_split(self, m: ModelShape, ac: str) -> tuple[float, float]:
        """Saved activations per layer per token in units of the width, (whole on every tp rank
        without sequence parallelism, divided by tp), for ac none, selective or op."""
        raise NotImplementedError

    def fused_mlp_unsaved(self, m: ModelShape) -> float:
        """Activation elements per token (units of the width) a fused MLP does not save: the
        activation's output, recomputed from its input in backward (torch.compile's partitioner
        recomputes pointwise ops rather than saving them)."""
        raise NotImplementedError

    def kernel_bytes(self, m: ModelShape, kernels: str) -> tuple[tuple[float, float], tuple[float, float]]:
        """((forward, backward) elements per token of a layer's memory-bound kernels that stay
        whole on every tp rank without sequence parallelism, (forward, backward) that divide by
        tp), counted per implementation (plan/kernels.py): "fused" or "eager". A norm over h reads
        h and writes h forward, reads x and dy and writes dx backward; a residual add reads two
        and writes one, and its gradient the same in backward."""
        raise NotImplementedError


def positive_settings(m: ModelShape, keys: tuple[str, ...]) -> None:
    """Each of `keys` (ModelConfig fields a family reads) is unset or positive."""
    for key in keys:
        value = getattr(m, key)
        if value is not None and not value > 0:
            raise UserError(f"model.{key} must be positive, got {value}")
