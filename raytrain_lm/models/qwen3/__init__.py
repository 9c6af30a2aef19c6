"""The Qwen3 family (dense Qwen3): a Llama with an RMSNorm of each query and key head before the
rotary embedding, and often a head size other than width / heads (Qwen3 0.6B and 4B: 128). Its
decoder is llama.py with `qk_norm`; its Hugging Face names and folders hf_qwen3.py."""

from __future__ import annotations

from raytrain_lm.models.llama import LlamaFamily


class Qwen3Family(LlamaFamily):
    name = "qwen3"
    title = "Qwen3"
    summary = "per-head q/k norms"
    hf_releases = ("Qwen3",)
    defaults = {"arch": "qwen3", "bias": False, "qk_norm": True}
    hf_adapter = "raytrain_lm.models.qwen3.hf_qwen3"
    hf_model_types = ("qwen3",)
    export_format = "raytrain-lm/qwen3"  # llama.py's names, as they are
