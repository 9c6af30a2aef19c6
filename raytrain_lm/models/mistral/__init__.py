"""The Mistral family (Mistral 7B and its kind): a Llama whose tokens attend to a sliding window
of the ones before them (v0.1: 4096; none from v0.2 on). Its decoder is llama.py with
`sliding_window`; its Hugging Face names and folders hf_mistral.py."""

from __future__ import annotations

from raytrain_lm.models.llama import LlamaFamily


class MistralFamily(LlamaFamily):
    name = "mistral"
    title = "Mistral"
    summary = "a sliding window, model.sliding_window"
    hf_releases = ("Mistral",)
    defaults = {"arch": "mistral", "bias": False}
    hf_adapter = "raytrain_lm.models.mistral.hf_mistral"
    hf_model_types = ("mistral",)
    export_format = "raytrain-lm/mistral"  # llama.py's names, as they are
