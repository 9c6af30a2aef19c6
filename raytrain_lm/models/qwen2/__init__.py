"""The Qwen2 family (Qwen2, Qwen2.5): a Llama with biases on its q/k/v projections (tensor
parallelism splits each bias with its rows). Its decoder is llama.py with `qkv_bias`; its Hugging
Face names and folders hf_qwen2.py."""

from __future__ import annotations

from raytrain_lm.models.llama import LlamaFamily


class Qwen2Family(LlamaFamily):
    name = "qwen2"
    title = "Qwen2"
    summary = "a Llama with q/k/v biases"
    hf_releases = ("Qwen2",)
    defaults = {"arch": "qwen2", "bias": False, "qkv_bias": True}
    hf_adapter = "raytrain_lm.models.qwen2.hf_qwen2"
    hf_model_types = ("qwen2",)
    export_format = "raytrain-lm/qwen2"  # llama.py's names, as they are
