"""Presets: the model shape and the training defaults that suit it, by name."""

from __future__ import annotations

from typing import Any

from raytrain_lm.config.settings import TrainConfig, apply_overrides
from raytrain_lm.errors import UserError

# Presets set the model shape and the training defaults that suit it.
PRESETS: dict[str, dict[str, Any]] = {
    # ~0.8M parameters: a CPU run of a few minutes on 2 cores.
    "tiny": dict(model=dict(block_size=256, n_layer=4, n_head=4, n_embd=128),
                 batch_size=16, seq_len=128, lr=3e-3, warmup_steps=30),
    # ~10.7M parameters.
    "small": dict(model=dict(block_size=512, n_layer=6, n_head=6, n_embd=384),
                  batch_size=16, seq_len=256, lr=1e-3, warmup_steps=100),
    # GPT-2 (124M) and GPT-2 medium (350M) shapes; the vocabulary comes from the dataset's tokenizer
    # (GPT-2's BPE: 50257, padded to 50304).
    # GPT-2's tanh GELU: its published weights (and Hugging Face's GPT-2) are exact with it.
    "gpt2": dict(model=dict(block_size=1024, n_layer=12, n_head=12, n_embd=768, bias=False,
                            gelu="tanh"),
                 batch_size=16, seq_len=1024, lr=6e-4, warmup_steps=700, weight_decay=0.1),
    "gpt2-medium": dict(model=dict(block_size=1024, n_layer=24, n_head=16, n_embd=1024, bias=False,
                                   gelu="tanh"),
                        batch_size=8, seq_len=1024, lr=3e-4, warmup_steps=700),
    # 69.7B parameters in this GPT's shape: for `plan` (what it takes to train one), not for a laptop.
    "gpt-70b": dict(model=dict(block_size=4096, n_layer=86, n_head=64, n_embd=8192, bias=False),
                    batch_size=1, seq_len=4096, lr=1.5e-4, warmup_steps=2000, strategy="fsdp",
                    activation_checkpointing="full"),
    # Small Llamas for this machine: tiny's and small's shapes with GQA (2 kv heads: tp up to 2).
    # llama-tiny: 0.80M parameters with bytes (tiny: 0.86M).
    "llama-tiny": dict(model=dict(arch="llama", bias=False, block_size=256, n_layer=4, n_head=4,
                                  n_kv_head=2, n_embd=128, multiple_of=32),
                       batch_size=16, seq_len=128, lr=3e-3, warmup_steps=30),
    "llama-small": dict(model=dict(arch="llama", bias=False, block_size=512, n_layer=6, n_head=6,
                                   n_kv_head=2, n_embd=384, multiple_of=64),
                        batch_size=16, seq_len=256, lr=1e-3, warmup_steps=100),
}


def _llama(vocab, context, layers, heads, kv_heads, width, multiple_of, theta, multiplier=None,
           **train):
    return dict(model=dict(arch="llama", bias=False, vocab_size=vocab, block_size=context,
                           n_layer=layers, n_head=heads, n_kv_head=kv_heads, n_embd=width,
                           multiple_of=multiple_of, ffn_multiplier=multiplier, rope_theta=theta),
                batch_size=1, seq_len=context, warmup_steps=2000, strategy="fsdp",
                activation_checkpointing="full", **train)


# The released Llamas' shapes, for `plan` (and for --init-from their Hugging Face folders): the
# values of Meta's params.json / Hugging Face's config.json (hidden_size, intermediate_size via
# Meta's multiple_of rule, heads, key/value heads, layers, vocabulary, rope_theta), the context
# of their pretraining and the peak learning rates of the Llama 2 and Llama 3 papers. Parameter
# counts (tests/test_llama.py checks them): 6,738,415,616; 13,015,864,320; 68,976,648,192;
# 8,030,261,248; 70,553,706,496; 405,853,388,800, the Hugging Face Hub's safetensors totals
# of meta-llama/Llama-2-{7b,13b,70b}-hf, Meta-Llama-3-{8B,70B} and Llama-3.1-405B. Llama 3.1's
# 128k context needs its rope scaling (not built here): llama3-405b plans at 8192.
PRESETS.update({
    "llama2-7b": _llama(32000, 4096, 32, 32, 32, 4096, 256, 10000.0, lr=3e-4),
    "llama2-13b": _llama(32000, 4096, 40, 40, 40, 5120, 256, 10000.0, lr=3e-4),
    "llama2-70b": _llama(32000, 4096, 80, 64, 8, 8192, 4096, 10000.0, 1.3, lr=1.5e-4),
    "llama3-8b": _llama(128256, 8192, 32, 32, 8, 4096, 1024, 500000.0, 1.3, lr=3e-4),
    "llama3-70b": _llama(128256, 8192, 80, 64, 8, 8192, 4096, 500000.0, 1.3, lr=1.5e-4),
    "llama3-405b": _llama(128256, 8192, 126, 128, 8, 16384, 4096, 500000.0, 1.2, lr=8e-5),
})


def preset_config(name: str) -> TrainConfig:
    if name not in PRESETS:
        raise UserError(f"unknown preset {name!r}; choose one of: {', '.join(PRESETS)}")
    cfg = TrainConfig(preset=name)
    apply_overrides(cfg, PRESETS[name], source=f"preset {name}")
    return cfg
