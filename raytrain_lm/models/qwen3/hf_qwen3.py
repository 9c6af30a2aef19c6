"""Our Qwen3 (llama.py with q/k norms) as Hugging Face's Qwen3ForCausalLM: the Llama's names
(hf_llama.py), Qwen3's config.json (its head_dim defaults to 128, not width / heads)."""

from __future__ import annotations

from typing import Any

from raytrain_lm.models.family import ModelConfig
from raytrain_lm.models.llama.hf_llama import LlamaAdapter, config_value
from raytrain_lm.models.qwen2.hf_qwen2 import sliding_layers


class Qwen3Adapter(LlamaAdapter):
    model_type = "qwen3"
    architecture = "Qwen3ForCausalLM"
    family = "qwen3"
    defaults = {"num_key_value_heads": 32, "head_dim": 128, "max_position_embeddings": 32768,
                "rms_norm_eps": 1e-6, "tie_word_embeddings": False}

    def _own_fields(self, c: dict[str, Any], problems: list[str], where: str) -> dict[str, Any]:
        if config_value(c, "attention_bias", "bool", where, False):
            problems.append("attention_bias=true (biases on q/k/v and o)")
        if sliding_layers(c, where):
            problems.append("use_sliding_window=true (Qwen3's window is not built here)")
        return {"qk_norm": True}

    def _own_config(self, m: ModelConfig) -> dict[str, Any]:
        return {"attention_bias": False, "use_sliding_window": False}

    def _cannot_hold(self, m: ModelConfig) -> list[str]:
        return [f"model.{k}" for k in ("qkv_bias", "sliding_window") if getattr(m, k)] + \
            ([] if m.qk_norm else ["model.qk_norm=false"])


ADAPTER = Qwen3Adapter()
