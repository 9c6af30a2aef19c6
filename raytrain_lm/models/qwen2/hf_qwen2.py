"""Our Qwen2 (llama.py with q/k/v biases) as Hugging Face's Qwen2ForCausalLM: the Llama's names
(hf_llama.py), Qwen2's config.json. Its sliding window (use_sliding_window, off in every
released Qwen2 and Qwen2.5) is not imported."""

from __future__ import annotations

from typing import Any

from raytrain_lm.models.family import ModelConfig
from raytrain_lm.models.llama.hf_llama import LlamaAdapter, config_value


def sliding_layers(c: dict[str, Any], where: str) -> bool:
    """Whether a Qwen config.json slides a window over some layers (use_sliding_window, or a
    layer_types list naming sliding_attention)."""
    types = c.get("layer_types")
    return config_value(c, "use_sliding_window", "bool", where, False) or \
        (isinstance(types, list) and "sliding_attention" in types)


class Qwen2Adapter(LlamaAdapter):
    model_type = "qwen2"
    architecture = "Qwen2ForCausalLM"
    family = "qwen2"
    defaults = {"num_key_value_heads": 32, "head_dim": None, "max_position_embeddings": 32768,
                "rms_norm_eps": 1e-6, "tie_word_embeddings": False}

    def _own_fields(self, c: dict[str, Any], problems: list[str], where: str) -> dict[str, Any]:
        if sliding_layers(c, where):
            problems.append("use_sliding_window=true (Qwen2's window is not built here)")
        return {"qkv_bias": True}

    def _own_config(self, m: ModelConfig) -> dict[str, Any]:
        return {"use_sliding_window": False}

    def _cannot_hold(self, m: ModelConfig) -> list[str]:
        return [f"model.{k}" for k in ("qk_norm", "sliding_window") if getattr(m, k)]

    def hf_zeros(self, m: ModelConfig) -> dict[str, tuple[int, ...]]:
        """Qwen2 always has q/k/v biases: a model without them has zero ones."""
        if m.qkv_bias:
            return {}
        q, kv = m.n_head * m.head_dim, m.kv_heads * m.head_dim
        return {f"model.layers.{i}.self_attn.{p}_proj.bias": (q if p == "q" else kv,)
                for i in range(m.n_layer) for p in "qkv"}


ADAPTER = Qwen2Adapter()
