"""Our Mistral (llama.py with a sliding window) as Hugging Face's MistralForCausalLM: the Llama's
names (hf_llama.py), Mistral's config.json (a folder without "sliding_window" gets the class's
4096, as transformers reads it)."""

from __future__ import annotations

from typing import Any

from raytrain_lm.models.family import ModelConfig
from raytrain_lm.models.llama.hf_llama import LlamaAdapter, config_value


class MistralAdapter(LlamaAdapter):
    model_type = "mistral"
    architecture = "MistralForCausalLM"
    family = "mistral"
    defaults = {"num_key_value_heads": 8, "head_dim": None, "max_position_embeddings": 131072,
                "rms_norm_eps": 1e-6, "tie_word_embeddings": False, "sliding_window": 4096}

    def _own_fields(self, c: dict[str, Any], problems: list[str], where: str) -> dict[str, Any]:
        window = c["sliding_window"]  # null: no window (Mistral 7B v0.2 on)
        return {"sliding_window": None if window is None else config_value(c, "sliding_window", "count", where)}

    def _own_config(self, m: ModelConfig) -> dict[str, Any]:
        return {"sliding_window": m.sliding_window}

    def _cannot_hold(self, m: ModelConfig) -> list[str]:
        return [f"model.{k}" for k in ("qkv_bias", "qk_norm") if getattr(m, k)]


ADAPTER = MistralAdapter()
