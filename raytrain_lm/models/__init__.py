"""The model families, by `model.arch`: each a folder (its Family, torch-free, beside its decoder),
listed once (models/family.py's FAMILIES); the one FLOPs count and building a model go through this registry."""

from __future__ import annotations

import importlib
from typing import Optional

from raytrain_lm.errors import UserError
from raytrain_lm.models.family import FAMILIES, ModelConfig, family
from raytrain_lm.models.hf import HFAdapter

__all__ = ["FAMILIES", "ModelConfig", "build_model", "decoder_class", "describe", "family",
           "flops_per_token", "hf_adapter", "hf_importer"]


def decoder_class(m: ModelConfig):
    """The family's decoder class (imports torch)."""
    module, _, name = family(m).decoder.partition(":")
    return getattr(importlib.import_module(module), name)


def build_model(m: ModelConfig, seed: Optional[int] = None):
    """The family's decoder for `m`: initialised with `seed` (default: torch's current seed), or
    left uninitialised when built under `torch.device("meta")` (decoder.Decoder)."""
    return decoder_class(m)(m, seed=seed)


def hf_adapter(m: ModelConfig) -> HFAdapter:
    """The family's Hugging Face adapter (models/hf.py); a UserError where it has none."""
    f = family(m)
    if f.hf_adapter is None:
        raise UserError(f"model.arch {f.name} has no Hugging Face format: export it with --format native")
    return importlib.import_module(f.hf_adapter).ADAPTER


def hf_importer(model_type: object, where: str) -> HFAdapter:
    """The adapter of the family that imports Hugging Face folders of `model_type`; a
    UserError, in one line, for a folder no family here imports."""
    for f in FAMILIES.values():
        if model_type in f.hf_model_types:
            return importlib.import_module(f.hf_adapter).ADAPTER
    kinds = ", ".join(t for f in FAMILIES.values() for t in f.hf_model_types)
    raise UserError(f"{where} holds a {model_type!r} model; --init-from takes Hugging Face folders "
                    f"of model_type {kinds} or this project's checkpoints")


def describe(m: ModelConfig) -> str:
    """"a qwen2 of 7,615,616,512 parameters": the family and the count (Family.counts)."""
    return f"a {m.arch} of {family(m).counts(m).total:,} parameters"


def flops_per_token(m: ModelConfig, seq_len: int) -> float:
    """Training FLOPs per token, PaLM appendix B: 6N + 12·L·H·Q·T.

    N counts the parameters used in matrix multiplies (Family.matmul_params: the GPT's all but
    the position embeddings, the tied token embedding counting once, as the output projection;
    the Llama's all but the token embedding, a lookup). L layers, H (query) heads, Q head size,
    T sequence length: the 12·L·H·Q·T term is attention's QK^T and AV products (forward +
    backward), counted over the whole context as PaLM does (a sliding window shorter than T
    computes fewer: not subtracted)."""
    L, H, Q, T = m.n_layer, m.n_head, m.head_dim, seq_len
    return 6.0 * family(m).matmul_params(m) + 12.0 * L * H * Q * T
