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
    # The Llama skeleton (models/llama/llama.py) and the families built on it: llama, qwen2,
    # qwen3, mistral. RMSNorm, rotary positions, SwiGLU, grouped-query attention, no biases but
    # Qwen2's q/k/v. Ignored by the GPT (those it cannot compute, it refuses).
    arch: str = setting("gpt", help="Architecture: gpt (GPT-2: LayerNorm, learned positions, GELU, "
                        "tied embeddings), or one on the Llama skeleton (RMSNorm, RoPE, SwiGLU, "
                        "GQA): llama, qwen2 (q/k/v biases), qwen3 (per-head q/k norms), mistral "
                        "(a sliding window), moe (a mixture of experts in every block).")
    n_kv_head: Optional[int] = setting(None, help="llama-like: key/value heads (grouped-query "
                                       "attention; divides n_head) [default: n_head].")
    head_size: Optional[int] = setting(None, help="llama-like: the size of each attention head "
                                       "(Qwen3 0.6B/4B: 128) [default: n_embd / n_head].")
    ffn_dim: Optional[int] = setting(None, help="llama-like: SwiGLU hidden size [default: Llama's "
                                     "rule, 8/3 x n_embd x ffn_multiplier rounded up to multiple_of].")
    ffn_multiplier: Optional[float] = setting(None, help="llama-like: scales the SwiGLU hidden size "
                                              "(Llama 2 70B and Llama 3: 1.3; 405B: 1.2).")
    multiple_of: int = setting(256, help="llama-like: the SwiGLU hidden size is rounded up to a "
                               "multiple of this.")
    rope_theta: float = setting(10000.0, help="llama-like: rotary base (Llama 2: 10000, Llama 3: "
                                "500000, Qwen2.5/3: 1000000).")
    rope_type: str = setting("default", help="llama-like: rotary frequencies as transformers' "
                             "rope_type: default, linear (divided by rope_factor) or llama3 (Llama "
                             "3.1+: the low frequencies divided by rope_factor, a smooth band between).")
    rope_factor: float = setting(1.0, help="llama-like: rope_type linear's and llama3's factor "
                                 "(Llama 3.1: 8, 3.2: 32).")
    rope_low_freq_factor: float = setting(1.0, help="llama-like: llama3's low_freq_factor.")
    rope_high_freq_factor: float = setting(4.0, help="llama-like: llama3's high_freq_factor.")
    rope_original_context: Optional[int] = setting(None, help="llama-like: llama3's "
                                                   "original_max_position_embeddings [default: "
                                                   "block_size].")
    norm_eps: float = setting(1e-5, help="llama-like: RMSNorm epsilon.")
    tie_embeddings: bool = setting(False, help="llama-like: the output head is the token embedding "
                                   "(Llama 3.2 1B/3B, small Qwens; the GPT's always is).")
    qkv_bias: bool = setting(False, help="llama-like: biases on the q, k and v projections (Qwen2).")
    qk_norm: bool = setting(False, help="llama-like: an RMSNorm of each query and key head before "
                            "the rotary embedding (Qwen3).")
    sliding_window: Optional[int] = setting(None, help="llama-like: each token attends to itself and "
                                            "the window-1 tokens before it (Mistral 7B v0.1: 4096) "
                                            "[default: the whole context].")
    # The mixture of experts (arch="moe", models/moe/): the Llama skeleton with every block's MLP
    # a set of routed SwiGLU experts (each of ffn_dim hidden units). Ignored by the others.
    n_experts: int = setting(0, help="moe: routed experts per block (2 or more).")
    top_k: int = setting(2, help="moe: experts each token is sent to (Mixtral: 2 of 8).")
    shared_ffn_dim: int = setting(0, help="moe: hidden size of a shared expert every token also "
                                  "passes through (0: none).")
    norm_top_k: bool = setting(True, help="moe: rescale each token's top-k routing weights to sum "
                               "to 1 (Mixtral; Qwen3-MoE's norm_topk_prob).")
    aux_loss_coef: float = setting(0.01, help="moe: weight of the load-balancing loss (Switch / "
                                   "Mixtral form, 1.0 when balanced) added to the training loss; a "
                                   "Hugging Face folder's is its router_aux_loss_coef x top_k "
                                   "(transformers' loss is top_k when balanced).")
    z_loss_coef: float = setting(0.0, help="moe: weight of the router z-loss (ST-MoE: 0.001; 0: off).")
    # The parametrization (models/mup.py): how initial values, multipliers and Adam's learning
    # rates scale with the width.
    param: str = setting("sp", help="sp (standard: the best lr moves as the model widens) or mup "
                         "(maximal update: tune a narrow proxy, train the wide model at its lr; "
                         "docs/tuning.md).")
    mup_base_width: Optional[int] = setting(None, help="mup: the width whose learning rates and "
                                            "initial values the model keeps (the proxy's; at it "
                                            "mup is sp) [default: n_embd].")
    mup_zero_init: bool = setting(False, help="mup: the query projection (GPT's c_attn query "
                                  "rows) and an untied output head start at zero, as the muP "
                                  "paper recommends (`mup`'s readout_zero_init); a tied head is "
                                  "the embedding and keeps its draws.")
    init_std: float = setting(0.02, help="The std of the matrices' and embeddings' initial "
                              "normal draws (GPT-2's 0.02; the residual projections' is it / "
                              "sqrt(2 n_layer)); under mup, the base width's (it transfers).")

    @property
    def kv_heads(self) -> int:
        return self.n_kv_head or self.n_head

    @property
    def head_dim(self) -> int:
        return self.head_size or self.n_embd // self.n_head

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

    def check(self, m: ModelConfig) -> None:
        """The family's own rules for its settings: one UserError line each."""

    def tied(self, m: ModelConfig) -> bool:
        """Whether the output head is the token embedding (one parameter: a pipeline's first and
        last stage then each hold a copy, their gradients summed)."""
        return False

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
            return (f"--ep {ep} splits a mixture of experts (model.arch moe); model.arch "
                    f"{self.name} has no experts: drop --ep")
        return None

    def hidden_dim(self, m: ModelConfig) -> int:
        return 4 * m.n_embd

    def counts(self, m: ModelConfig) -> ParamCounts:
        raise NotImplementedError

    def lookup_params(self, m: ModelConfig) -> int:
        """Parameters read by lookup, not multiplied (position or token embeddings)."""
        raise NotImplementedError

    def active_params(self, m: ModelConfig) -> int:
        """Parameters a token passes through (a mixture of experts: k of its experts)."""
        return self.counts(m).total

    def active_block(self, m: ModelConfig) -> int:
        """A block's parameters a token passes through (the planner's FLOPs per block)."""
        return self.counts(m).block

    def expert_params(self, m: ModelConfig) -> int:
        """A block's routed experts' parameters, which expert parallelism splits (none here)."""
        return 0

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
