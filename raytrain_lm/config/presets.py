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
    # A mixture of experts for this machine: llama-tiny's attention, 4 experts of 256 hidden units
    # per block, 2 per token: 1.84M parameters with bytes, 1.05M active (a Llama of ffn_dim 512,
    # the two experts' units, has as many less the routers' 2,048: bench/moe.py's dense twin).
    "moe-tiny": dict(model=dict(arch="moe", bias=False, block_size=256, n_layer=4, n_head=4,
                                n_kv_head=2, n_embd=128, ffn_dim=256, n_experts=4, top_k=2),
                     batch_size=16, seq_len=128, lr=3e-3, warmup_steps=30),
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
# of meta-llama/Llama-2-{7b,13b,70b}-hf, Meta-Llama-3-{8B,70B} and Llama-3.1-405B. llama3-405b
# plans at Llama 3's 8192 without Llama 3.1's rope scaling (llama3.1-8b below has it).
PRESETS.update({
    "llama2-7b": _llama(32000, 4096, 32, 32, 32, 4096, 256, 10000.0, lr=3e-4),
    "llama2-13b": _llama(32000, 4096, 40, 40, 40, 5120, 256, 10000.0, lr=3e-4),
    "llama2-70b": _llama(32000, 4096, 80, 64, 8, 8192, 4096, 10000.0, 1.3, lr=1.5e-4),
    "llama3-8b": _llama(128256, 8192, 32, 32, 8, 4096, 1024, 500000.0, 1.3, lr=3e-4),
    "llama3-70b": _llama(128256, 8192, 80, 64, 8, 8192, 4096, 500000.0, 1.3, lr=1.5e-4),
    "llama3-405b": _llama(128256, 8192, 126, 128, 8, 16384, 4096, 500000.0, 1.2, lr=8e-5),
})


def _hub(arch, vocab, context, layers, heads, kv_heads, width, ffn, theta, eps, seq_len, **model):
    """A released checkpoint's shape, as its config.json gives it (ffn_dim: intermediate_size)."""
    return dict(model=dict(arch=arch, bias=False, vocab_size=vocab, block_size=context,
                           n_layer=layers, n_head=heads, n_kv_head=kv_heads, n_embd=width,
                           ffn_dim=ffn, rope_theta=theta, norm_eps=eps, **model),
                batch_size=1, seq_len=seq_len, lr=3e-4, warmup_steps=2000, strategy="fsdp",
                activation_checkpointing="full")


LLAMA31_ROPE = dict(rope_type="llama3", rope_low_freq_factor=1.0, rope_high_freq_factor=4.0,
                    rope_original_context=8192)
# The checkpoints most continued pretraining starts from, for `plan` (a run starts from the
# folder itself: `train --init-from FOLDER` takes its config.json). Each is its config.json on
# the Hugging Face Hub (meta-llama/Llama-3.2-1B, Llama-3.2-3B, Llama-3.1-8B, Qwen/Qwen2.5-7B,
# Qwen/Qwen3-8B, mistralai/Mistral-7B-v0.1); their parameter counts (tests/test_families.py
# checks them, and transformers' own count of each config): 1,235,814,400; 3,212,749,824;
# 8,030,261,248; 7,615,616,512; 8,190,735,360; 7,241,732,096. seq_len: the context of their
# main pretraining (Llama 3: 8192, Qwen2.5/3: 4096, Mistral: 8192); lr: a continued
# pretraining's, not theirs.
PRESETS.update({
    "llama3.2-1b": _hub("llama", 128256, 131072, 16, 32, 8, 2048, 8192, 500000.0, 1e-5, 8192,
                        tie_embeddings=True, rope_factor=32.0, **LLAMA31_ROPE),
    "llama3.2-3b": _hub("llama", 128256, 131072, 28, 24, 8, 3072, 8192, 500000.0, 1e-5, 8192,
                        tie_embeddings=True, rope_factor=32.0, **LLAMA31_ROPE),
    "llama3.1-8b": _hub("llama", 128256, 131072, 32, 32, 8, 4096, 14336, 500000.0, 1e-5, 8192,
                        rope_factor=8.0, **LLAMA31_ROPE),
    "qwen2.5-7b": _hub("qwen2", 152064, 131072, 28, 28, 4, 3584, 18944, 1000000.0, 1e-6, 4096,
                       qkv_bias=True),
    "qwen3-8b": _hub("qwen3", 151936, 40960, 36, 32, 8, 4096, 12288, 1000000.0, 1e-6, 4096,
                     qk_norm=True),
    "mistral-7b": _hub("mistral", 32000, 32768, 32, 32, 8, 4096, 14336, 10000.0, 1e-5, 8192,
                       sliding_window=4096),
    # Released mixtures of experts (models/moe/): Mixtral 8x7B and 8x22B (mistralai/Mixtral-8x7B-v0.1,
    # Mixtral-8x22B-v0.1), Qwen3-30B-A3B and Qwen3-235B-A22B (Qwen/...): ffn_dim is each expert's
    # intermediate size (Qwen3's moe_intermediate_size). Counts (tests/test_moe.py): Mixtral 8x7B
    # 46,702,792,704 with 12,879,925,248 active (Mistral's 46.7B / 12.9B), 8x22B 140,630,071,296 with
    # 39,161,468,928 (141B / 39B); Qwen3 30.5B / 3.3B and 235B / 22B as Qwen publishes them.
    # aux_loss_coef: config.json's router_aux_loss_coef x top_k (models/moe/hf_moe.py): Mixtral 8x7B
    # ships 0.02, Qwen3-30B-A3B 0.001 (a folder's own value is what a run from it trains with).
    "mixtral-8x7b": _hub("moe", 32000, 32768, 32, 32, 8, 4096, 14336, 1000000.0, 1e-5, 4096,
                         n_experts=8, top_k=2, aux_loss_coef=0.04),
    "mixtral-8x22b": _hub("moe", 32768, 65536, 56, 48, 8, 6144, 16384, 1000000.0, 1e-5, 4096,
                          n_experts=8, top_k=2),
    "qwen3-30b-a3b": _hub("moe", 151936, 40960, 48, 32, 4, 2048, 768, 1000000.0, 1e-6, 4096,
                          head_size=128, qk_norm=True, n_experts=128, top_k=8, aux_loss_coef=0.008),
    "qwen3-235b-a22b": _hub("moe", 151936, 40960, 94, 64, 4, 4096, 1536, 1000000.0, 1e-6, 4096,
                            head_size=128, qk_norm=True, n_experts=128, top_k=8),
})


# A run that continues a released model (--init-from a Hugging Face folder) trains, unless a config
# file, flag or --set gives these, at a tenth of the peak learning rates such models were
# pretrained at (Llama 2 7B and Llama 3 8B: 3e-4; Llama 3 70B: 1.5e-4), after a short warmup
# (5% of the steps, at most 100), cosine down to 10%: re-warming from zero and decaying again is
# what continued pretraining needs (Gupta et al. 2023, "Continual Pre-Training of Large
# Language Models: How to (re)warm your model?"; Ibrahim et al. 2024, "Simple and Scalable
# Strategies to Continually Pre-train Large Language Models"), and a peak well below the
# original's limits the forgetting of what the model knew, at the cost of adapting more slowly.
# A preset's lr is one for training from random weights (tiny's 3e-3 wrecks a pretrained model).
CONTINUED = {"lr": 3e-5, "schedule": "cosine", "min_lr_ratio": 0.1}
CONTINUED_WARMUP_FRACTION, CONTINUED_WARMUP_MAX = 0.05, 100


def continued_defaults(max_steps: int) -> dict:
    """The schedule of a run continuing a released model of `max_steps` steps (CONTINUED)."""
    warmup = min(CONTINUED_WARMUP_MAX, max(1, round(CONTINUED_WARMUP_FRACTION * max_steps)))
    return {**CONTINUED, "warmup_steps": warmup}


def preset_help() -> str:
    """--preset's help: every preset, by family, from PRESETS (a new one names itself)."""
    by_arch: dict[str, list[str]] = {}
    for name, preset in PRESETS.items():
        by_arch.setdefault(preset["model"].get("arch", "gpt"), []).append(name)
    groups = "; ".join(f"{', '.join(names)} ({arch})" for arch, names in by_arch.items())
    return (f"Model preset: {groups}. The released models' shapes (7B and up) are for `plan`, "
            f"and for --init-from their Hugging Face folders.")


def preset_config(name: str) -> TrainConfig:
    if name not in PRESETS:
        raise UserError(f"unknown preset {name!r}; choose one of: {', '.join(PRESETS)}")
    cfg = TrainConfig(preset=name)
    apply_overrides(cfg, PRESETS[name], source=f"preset {name}")
    return cfg
