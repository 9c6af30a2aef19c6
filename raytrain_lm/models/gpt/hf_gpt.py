"""The GPT (gpt.py) as Hugging Face's GPT2LMHeadModel: its weight names and config.json, and the
c_attn row order both ways. Our GPT is GPT-2's architecture (pre-LayerNorm, GELU (exact, or
GPT-2's tanh form: model.gelu), learned positions, tied embeddings, fused qkv), so the weights need
only names, the Conv1D transpose and the q/k/v row order; a Hugging Face GPT-2 brought in here
must keep its tanh GELU (model.gelu=tanh). No torch import: the tensors' own methods do the work."""

from __future__ import annotations

from typing import Any, Optional

from raytrain_lm.models.family import ModelConfig
from raytrain_lm.models.hf import HFAdapter

# nn.Linear weights (out, in) that GPT-2 keeps in its Conv1D modules as (in, out)
_CONV1D = ("attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj")


def qkv_gpt2_to_interleaved(t, n_head: int):
    """A c_attn weight (3C, C) or bias (3C,) from GPT-2's [q; k; v] row order to the
    head-interleaved order of gpt.py (GPT-2 weights, and checkpoints of format 2)."""
    three_c = t.shape[0]
    hd = three_c // (3 * n_head)
    return t.reshape(3, n_head, hd, *t.shape[1:]).transpose(0, 1).reshape(three_c, *t.shape[1:])


def qkv_interleaved_to_gpt2(t, n_head: int):
    """c_attn's weight (3C, C) or bias (3C,) with its output rows in GPT-2's order: [q | k | v],
    each split by head. Ours are head-interleaved ([h0: q,k,v][h1: q,k,v]..., so that tensor
    parallelism's contiguous row split hands each rank whole heads); GPT-2 reads the same rows as
    q, k, v one after another, so without this permutation transformers would load the weights
    silently (same shapes) and compute something else."""
    three_c = t.shape[0]
    hd = three_c // (3 * n_head)
    return t.reshape(n_head, 3, hd, *t.shape[1:]).transpose(0, 1).reshape(three_c, *t.shape[1:])


class GPTAdapter(HFAdapter):
    """Our GPT as GPT2LMHeadModel. Export only (GPT-2 folders are not imported here)."""

    model_type = "gpt2"
    architecture = "GPT2LMHeadModel"

    def hf_name(self, name: str, m: ModelConfig) -> Optional[str]:
        if name in ("wte.weight", "lm_head.weight"):  # tied: the head is the embedding
            return "transformer.wte.weight"
        if name.startswith(("wpe.", "h.", "ln_f.")):
            return f"transformer.{name}"
        raise ValueError(f"no Hugging Face name for {name}")

    def to_hf_tensor(self, name: str, t, m: ModelConfig):
        if ".attn.c_attn." in name:
            t = qkv_interleaved_to_gpt2(t, m.n_head)
        if name.endswith(".weight") and any(f".{mod}." in name for mod in _CONV1D):
            t = t.t()  # Conv1D: (in, out)
        return t

    def sliceable(self, name: str, m: ModelConfig) -> bool:
        return not any(f".{mod}." in name for mod in _CONV1D)

    def hf_zeros(self, m: ModelConfig) -> dict[str, tuple[int, ...]]:
        """GPT-2 always has biases: a bias=False model's are zero (exactly what it computes)."""
        if m.bias:
            return {}
        C = m.n_embd
        out = {"transformer.ln_f.bias": (C,)}
        for i in range(m.n_layer):
            p = f"transformer.h.{i}."
            out.update({p + "ln_1.bias": (C,), p + "ln_2.bias": (C,), p + "attn.c_attn.bias": (3 * C,),
                        p + "attn.c_proj.bias": (C,), p + "mlp.c_fc.bias": (4 * C,),
                        p + "mlp.c_proj.bias": (C,)})
        return out

    def hf_config(self, cfg: ModelConfig, vocab_size: int, eot: Optional[int]) -> dict[str, Any]:
        """GPT2LMHeadModel's config.json for `cfg` with the tokenizer's vocabulary."""
        return {
            "architectures": [self.architecture],
            "model_type": self.model_type,
            "vocab_size": vocab_size,
            "n_positions": cfg.block_size,
            "n_embd": cfg.n_embd,
            "n_layer": cfg.n_layer,
            "n_head": cfg.n_head,
            "n_inner": None,  # 4 * n_embd, as our MLP
            # transformers' gelu is F.gelu (exact); gelu_new GPT-2's tanh form, F.gelu(approximate="tanh")
            "activation_function": "gelu_new" if cfg.gelu == "tanh" else "gelu",
            "layer_norm_epsilon": 1e-5,  # torch.nn.LayerNorm's default, which our model uses
            "resid_pdrop": cfg.dropout, "embd_pdrop": cfg.dropout, "attn_pdrop": cfg.dropout,
            "scale_attn_weights": True,  # 1/sqrt(head_dim), as scaled_dot_product_attention
            "tie_word_embeddings": True,
            # GPT2Config defaults both to 50256 (GPT-2's <|endoftext|>): wrong for any other
            # vocabulary, and generate() would stop on it. None where the tokenizer has no EOT.
            "bos_token_id": eot, "eos_token_id": eot,
        }


ADAPTER = GPTAdapter()
