"""What a model is, torch-free: `ModelConfig` (the `model.` settings of every family, flat) and
`Family`, what generic code (checks, the planner, parallel/, export) asks a model family
instead of branching on `model.arch`. Each family's folder defines its Family (its
`__init__.py`, no torch) beside its decoder (torch); `models/__init__.py` lists them.

A Family answers from the config alone (no module is built): its settings' rules, its parameter
counts per piece (the one count: the planner, the loop's MFU and the tests' check against a
built module all read it), the weights of its blocks' matmuls (the one FLOPs count), its
activations per token, its tensor-parallel plan (which projections split by output, which by
input) and what its Hugging Face format is.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Optional

from raytrain_lm.errors import UserError


def setting(default: Any = dataclasses.MISSING, *, help: str, factory: Any = dataclasses.MISSING):
    """A config field with its help text beside it: `--help` of every command reads it from here
    (ModelConfig's fields here, TrainConfig's in config/settings.py)."""
    return field(default=default, default_factory=factory, metadata={"help": help})


@dataclass
class ModelConfig:
    vocab_size: Optional[int] = setting(None, help="Vocabulary size [default: the dataset's tokenizer's].")
    block_size: int = setting(256, help="Longest context the model can attend to (position embeddings).")
    n_layer: int = setting(4, help="Transformer blocks.")
    n_head: int = setting(4, help="Attention heads per block.")
    n_embd: int = setting(128, help="Width of the residual stream (a multiple of n_head).")
    dropout: float = setting(0.0, help="Dropout probability (attention, residual, embeddings).")
    bias: bool = setting(True, help="Biases in linear layers and LayerNorms (gpt; the Llama has none).")
    gelu: str = setting("exact", help="gpt: the MLP's GELU: exact (erf), or tanh (GPT-2's "
                        "approximation: the gpt2 presets, GPT-2's weights). Exported to "
                        "transformers as activation_function gelu or gelu_new.")
    # The Llama family (arch="llama", models/llama/): RMSNorm, rotary positions, SwiGLU,
    # grouped-query attention, no biases, an untied head. Ignored by the GPT.
    arch: str = setting("gpt", help="Architecture: gpt (GPT-2: LayerNorm, learned positions, GELU, "
                        "tied embeddings) or llama (RMSNorm, RoPE, SwiGLU, GQA, untied head).")
    n_kv_head: Optional[int] = setting(None, help="llama: key/value heads (grouped-query attention; "
                                       "divides n_head) [default: n_head].")
    ffn_dim: Optional[int] = setting(None, help="llama: SwiGLU hidden size [default: Llama's rule, "
                                     "8/3 x n_embd x ffn_multiplier rounded up to multiple_of].")
    ffn_multiplier: Optional[float] = setting(None, help="llama: scales the SwiGLU hidden size "
                                              "(Llama 2 70B and Llama 3: 1.3; 405B: 1.2).")
    multiple_of: int = setting(256, help="llama: the SwiGLU hidden size is rounded up to a multiple "
                               "of this.")
    rope_theta: float = setting(10000.0, help="llama: rotary base (Llama 2: 10000, Llama 3: 500000).")
    norm_eps: float = setting(1e-5, help="llama: RMSNorm epsilon.")

    @property
    def kv_heads(self) -> int:
        return self.n_kv_head or self.n_head

    @property
    def head_dim(self) -> int:
        return self.n_embd // self.n_head

    @property
    def hidden_dim(self) -> int:
        """The MLP's hidden size, as this config's family computes it."""
        from raytrain_lm.models import family  # the registry lists the families built on this

        return family(self).hidden_dim(self)


@dataclass(frozen=True)
class ParamCounts:
    """Parameters of one block, of everything outside the blocks, and in all."""
    block: int
    root: int
    total: int


@dataclass(frozen=True)
class TPPlan:
    """A block's linears by how tensor parallelism splits them (parallel/tp.py applies it):
    `colwise` by output features (whole heads, a slice of the MLP's hidden units), `rowwise` by
    input features (their outputs all-reduced, or reduce-scattered over the sequence)."""
    colwise: tuple[str, ...]
    rowwise: tuple[str, ...]


class Family:
    """A model family: the answers generic code needs, from a ModelConfig. Subclasses (one per
    folder of models/) set the attributes and override what differs; the defaults below are
    what holds for every decoder built on models/decoder.py."""

    name: str  # model.arch
    decoder: str  # "module:Class" of its torch module (imported only where a model is built)
    tp_plan: TPPlan
    # What choosing the family sets, right after the preset (`--arch llama` on a GPT preset: its
    # shape as a Llama); a file, flags and --set still override it.
    defaults: dict[str, Any] = {}
    # Its Hugging Face format, where it has one: the adapter module (names, config.json) and the
    # name `export` records; None: exported in this project's own format only.
    hf_adapter: Optional[str] = None
    hf_model_types: tuple[str, ...] = ()  # the model_type of the Hugging Face folders it imports
    export_format: str = ""
    export_notes: dict[str, Any] = {}  # what a native export's config.json says of its layout

    def check(self, m: ModelConfig) -> None:
        """The family's own rules for its settings: one UserError line each."""

    def check_layout(self, m: ModelConfig, tp: int, ep: int = 1) -> Optional[str]:
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
            return f"model.arch {self.name} has no experts to split over {ep} expert-parallel ranks"
        return None

    def hidden_dim(self, m: ModelConfig) -> int:
        return 4 * m.n_embd

    def counts(self, m: ModelConfig) -> ParamCounts:
        raise NotImplementedError

    def lookup_params(self, m: ModelConfig) -> int:
        """Parameters read by lookup, not multiplied (position or token embeddings)."""
        raise NotImplementedError

    def matmul_params(self, m: ModelConfig) -> int:
        """The N of 6N FLOPs per token: the parameters used in matrix multiplies."""
        return self.counts(m).total - self.lookup_params(m)

    def tp_counts(self, m: ModelConfig, tp: int) -> dict[str, float]:
        """Parameters one tp rank holds, per piece: "block", "wte", "wpe", "ln_f", and "head"
        for an untied output projection (without it the last stage holds a copy of the tied
        wte)."""
        raise NotImplementedError

    def block_matmuls(self, m: ModelConfig) -> list[int]:
        """A block's matmuls in forward order, by weight elements (their forward FLOPs: 2 per
        element per token)."""
        raise NotImplementedError

    def activation_split(self, m: ModelConfig, ac: str) -> tuple[float, float]:
        """Saved activations per layer per token in units of the width, (whole on every tp rank
        without sequence parallelism, divided by tp), for ac none, selective or op."""
        raise NotImplementedError

    def fused_mlp_unsaved(self, m: ModelConfig) -> float:
        """Activation elements per token (units of the width) a fused MLP does not save: the
        activation's output, recomputed from its input in backward (torch.compile's partitioner
        recomputes pointwise ops rather than saving them)."""
        raise NotImplementedError

    def kernel_bytes(self, m: ModelConfig, kernels: str) -> tuple[tuple[float, float], tuple[float, float]]:
        """((forward, backward) elements per token of a layer's memory-bound kernels that stay
        whole on every tp rank without sequence parallelism, (forward, backward) that divide by
        tp), counted per implementation (plan/kernels.py): "fused" or "eager". A norm over h reads
        h and writes h forward, reads x and dy and writes dx backward; a residual add reads two
        and writes one, and its gradient the same in backward."""
        raise NotImplementedError


def positive_settings(m: ModelConfig, keys: tuple[str, ...]) -> None:
    """Each of `keys` (ModelConfig fields a family reads) is unset or positive."""
    for key in keys:
        value = getattr(m, key)
        if value is not None and not value > 0:
            raise UserError(f"model.{key} must be positive, got {value}")
