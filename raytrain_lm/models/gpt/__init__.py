"""The GPT family (GPT-2's architecture): what generic code asks of it. Its decoder is gpt.py,
its Hugging Face names hf_gpt.py."""

from __future__ import annotations

from dataclasses import dataclass

from raytrain_lm.errors import UserError
from raytrain_lm.models.base import Family, ModelShape, ParamCounts, TPPlan
from raytrain_lm.setting import setting

# Settings the GPT does not compute, at their defaults (the others it ignores, as n_kv_head)
LLAMA_ONLY = {"head_size": None, "rope_type": "default", "qkv_bias": False, "qk_norm": False,
              "sliding_window": None}

# Activation elements per layer per token, in units of the width: (whole on every tp rank without
# sequence parallelism, divided by tp). Sums: 17 without recomputation, 11 selective, 9 op (the
# block input; the outputs of c_attn, attention and c_fc: parallel/ac.py).
AC_SPLIT = {"none": (5, 12), "selective": (3, 8), "op": (1, 8)}
GELUS = ("exact", "tanh")  # the MLP's activation: F.gelu's approximate="none" or "tanh"


@dataclass
class GPTSettings(ModelShape):
    """The GPT's own `model.` settings."""
    bias: bool = setting(True, help="Biases in linear layers and LayerNorms (gpt; the Llama has none).")
    gelu: str = setting("exact", help="gpt: the MLP's GELU: exact (erf), or tanh (GPT-2's "
                        "approximation: the gpt2 presets, GPT-2's weights). Exported to "
                        "transformers as activation_function gelu or gelu_new.")


class GPTFamily(Family):
    name = "gpt"
    title = "GPT"
    summary = "GPT-2"
    decoder = "raytrain_lm.models.gpt.gpt:GPT"
    tp_plan = TPPlan(colwise=("attn.c_attn", "mlp.c_fc"), rowwise=("attn.c_proj", "mlp.c_proj"))
    defaults = {"arch": "gpt"}
    hf_adapter = "raytrain_lm.models.gpt.hf_gpt"
    # c_attn's rows are head-interleaved (gpt.py), which gpt.GPT reads as is;
    # hf_gpt.qkv_interleaved_to_gpt2 gives GPT-2's [q; k; v].
    export_format = "raytrain-lm/gpt-2"
    export_notes = {"qkv_layout": "head-interleaved"}
    # every GPT trained before `gelu` existed used GPT-2's tanh GELU: its runs resume, export and
    # sample with it
    saved_before = {"gelu": "tanh"}

    def tied(self, m: GPTSettings) -> bool:
        return True

    def check(self, m: GPTSettings) -> None:
        """The Llama skeleton's settings are not the GPT's: set, they would be ignored; the
        GELU is one of GELUS."""
        for key, default in LLAMA_ONLY.items():
            if getattr(m, key) != default:
                raise UserError(f"model.{key} is a setting of the Llama-skeleton families (llama, "
                                f"qwen2, qwen3, mistral), not of the gpt: drop it or choose "
                                f"--arch")
        if m.gelu not in GELUS:
            raise UserError(f"model.gelu must be one of {', '.join(GELUS)}, got {m.gelu!r}")

    def counts(self, m: GPTSettings) -> ParamCounts:
        h, V, bias = m.n_embd, m.vocab_size or 256, 1 if m.bias else 0
        block = 12 * h * h + bias * (3 * h + h + 4 * h + h) + (2 + 2 * bias) * h
        root = V * h + m.block_size * h + (1 + bias) * h  # tied embedding, positions, final norm
        return ParamCounts(block, root, m.n_layer * block + root)

    def lookup_params(self, m: GPTSettings) -> int:
        return m.block_size * m.n_embd  # the positions; the tied wte counts once, as the head

    def tp_counts(self, m: GPTSettings, tp: int) -> dict[str, float]:
        # Split: c_attn (3h x h + 3h), c_fc (4h x h + 4h), attn.c_proj (h x h), mlp.c_proj
        # (h x 4h). Whole: the row-parallel biases (h each) and the two LayerNorms.
        h, V, T, bias = m.n_embd, m.vocab_size or 256, m.block_size, 1 if m.bias else 0
        ln = (1 + bias) * h
        block = (12 * h * h + bias * 7 * h) / tp + bias * 2 * h + 2 * ln
        return {"block": block, "wte": V * h / tp, "wpe": T * h / tp, "ln_f": ln}

    def block_matmuls(self, m: GPTSettings) -> list[int]:
        h = m.n_embd
        return [3 * h * h, h * h, 4 * h * h, 4 * h * h]

    def activation_split(self, m: GPTSettings, ac: str) -> tuple[float, float]:
        return AC_SPLIT[ac]

    def fused_mlp_unsaved(self, m: GPTSettings) -> float:
        return 4.0  # GeLU's output over the 4h hidden

    def kernel_bytes(self, m: GPTSettings, kernels: str) -> tuple[tuple[float, float], tuple[float, float]]:
        """nn.LayerNorm and F.gelu are single kernels either way: two norms (2h + 3h each), two
        residual adds (3h + 3h each), GeLU over the 4h hidden (8h + 12h)."""
        h = m.n_embd
        return (2 * 2 * h + 2 * 3 * h, 2 * 3 * h + 2 * 3 * h), (8 * h, 12 * h)
