"""Checks of a TrainConfig that need no cluster and no dataset: the values, the parallel layout,
what a resumed run may change, names. Every failure is one line (UserError). Also the sampling
flags of `generate` (checked before torch is imported)."""

from __future__ import annotations

import dataclasses
import math
import re
from typing import TYPE_CHECKING, Optional

from raytrain_lm.config.layout import Layout
from raytrain_lm.config.schedule import check_schedule
from raytrain_lm.config.sizes import check_elastic
from raytrain_lm.errors import UserError, brief
from raytrain_lm.models import family, mup

if TYPE_CHECKING:
    from raytrain_lm.config.settings import TrainConfig

# The most tokens a vocabulary may have: a size from a flag, a manifest or a tokenizer.json sizes
# tables by it (the BPE trainer's, the tokenizer's byte table, the model's embedding), so an id of
# 1e9 would allocate until memory runs out. 2^20 is four times the largest released LM's (Gemma's
# 262,144) and fits the uint32 shards.
MAX_VOCAB = 1 << 20
# The most of any count a run or a plan is made of (workers, GPUs, layers, heads, sequences per
# batch, microbatches, ...): 2^20, over a hundred times the largest runs published. A count from a
# flag or a file sizes loops and allocations (`plan --gpus 1e9` searched divisors for minutes,
# `model.n_layer=1e30` overflowed), so one past it is refused, not tried.
MAX_COUNT = 1 << 20
# The most of any width (model.n_embd, ffn_dim, block_size, --seq-len): 2^24, 1,000 times
# today's widest models and 100 times their context.
MAX_WIDTH = 1 << 24

UPLOAD_MODES = ("auto", "sync", "async")  # of checkpoints (checkpointer.py)
PRECISIONS = ("auto", "fp32", "bf16", "fp16")


def check_resumable(was: TrainConfig, cfg: TrainConfig, preset: str) -> None:
    """Settings a resumed run cannot change, because what its checkpoints hold depends on them.
    The layout may change (--workers, --strategy, --tp, --pp): checkpoints load at any layout."""
    if cfg.model != was.model or cfg.preset != preset:
        raise UserError("a resumed run keeps its model: drop those settings, or start a new run "
                        "with --init-from")
    for key, why in (("seq_len", "the saved data position counts windows of that many tokens"),
                     ("seed", "the saved data position is a place in the order this seed shuffles")):
        if getattr(cfg, key) != getattr(was, key):
            raise UserError(f"a resumed run keeps its --{key.replace('_', '-')} "
                            f"({getattr(was, key)}): {why}; drop it, or start a new run with "
                            f"--init-from")


def check_finite(cfg: TrainConfig) -> None:
    """Every number of the config is finite. Setting a field through apply_overrides checks this
    already; a TrainConfig built in code (Tune's trials, tests) is checked here too."""
    for section, prefix in ((cfg, ""), (cfg.model, "model.")):
        for key, value in vars(section).items():
            if isinstance(value, float) and not math.isfinite(value):
                raise UserError(f"{prefix}{key} must be a finite number, got {value}")


# A run's, a sweep's or a shard's name is one plain entry of its folder: never `..`, `/` or a
# hidden name, so neither a flag nor a crafted manifest can reach outside that folder.
NAME_RULE = "letters, digits, '.', '_' and '-', not starting with '.', at most 128 characters"
_NAME = re.compile(r"[A-Za-z0-9_-][A-Za-z0-9._-]{0,127}")


def is_plain_name(name: object) -> bool:
    return isinstance(name, str) and _NAME.fullmatch(name) is not None


def check_name(name: Optional[str]) -> None:
    """A run or sweep name is a folder inside --storage, never a path out of it."""
    if name is not None and not is_plain_name(name):
        raise UserError(f"--name {name!r} is not a valid name: use {NAME_RULE}")


def check_layout(cfg: TrainConfig) -> None:
    """What the parallel layout needs (config/layout.py), checked before any worker starts: the
    first problem, one line."""
    problems = Layout.of(cfg).problems(cfg.model, cfg.precision, cfg.compile)
    if problems:
        raise UserError(problems[0])


def validate(cfg: TrainConfig) -> None:
    """Checks that need no cluster and no dataset."""
    check_name(cfg.name)
    positive = dict(workers=cfg.workers, max_steps=cfg.max_steps, batch_size=cfg.batch_size,
                    seq_len=cfg.seq_len, grad_accum=cfg.grad_accum,
                    eval_every=cfg.eval_every, keep_checkpoints=cfg.keep_checkpoints)
    for k, v in positive.items():
        if v < 1:
            raise UserError(f"--{k.replace('_', '-')} must be at least 1, got {v}")
    check_bounds(cfg)
    check_model(cfg.model)
    check_finite(cfg)
    check_schedule(cfg)
    if cfg.cpus_per_worker is not None and cfg.cpus_per_worker <= 0:
        raise UserError(f"cpus_per_worker must be positive, got {cfg.cpus_per_worker}")
    if cfg.scale_timeout < 0:
        raise UserError(f"--scale-timeout must be >= 0 seconds, got {cfg.scale_timeout:g}")
    for key in ("beta1", "beta2"):
        if not 0.0 <= getattr(cfg, key) < 1.0:
            raise UserError(f"{key} must be in [0, 1), got {getattr(cfg, key)}")
    if cfg.weight_decay < 0:
        raise UserError(f"weight_decay must be >= 0, got {cfg.weight_decay}")
    if cfg.grad_clip <= 0:
        raise UserError(f"grad_clip must be positive (the largest global gradient norm), got "
                        f"{cfg.grad_clip}")
    for key in ("peak_tflops", "gpu_memory_gb"):
        if getattr(cfg, key) is not None and getattr(cfg, key) <= 0:
            raise UserError(f"{key} must be positive, got {getattr(cfg, key)}")
    if cfg.log_every < 0 or not cfg.log_seconds > 0:
        raise UserError(f"--log-every must be >= 0 (0: paced by --log-seconds) and --log-seconds "
                        f"positive, got {cfg.log_every} and {cfg.log_seconds:g}")
    if cfg.warmup_steps < 0 or cfg.max_failures < -1 or cfg.eval_windows < 0:
        raise UserError("warmup_steps and eval_windows must be >= 0, max_failures >= -1")
    if cfg.checkpoint_every != "auto" and (isinstance(cfg.checkpoint_every, str) or cfg.checkpoint_every < -1):
        raise UserError(f"--checkpoint-every must be a number of steps (0: only at the end; -1: "
                        f"none) or auto, got {brief(cfg.checkpoint_every)}")
    if cfg.mtbf is not None and not (cfg.mtbf > 0 and math.isfinite(cfg.mtbf)):
        raise UserError(f"--mtbf must be a positive number of GPU-hours, got {cfg.mtbf!r}")
    if cfg.max_preemptions < -1 or cfg.resize_interval < 0:
        raise UserError("max_preemptions must be >= -1 and resize_interval >= 0")
    if cfg.checkpoint_upload not in UPLOAD_MODES:
        raise UserError(f"--checkpoint-upload must be one of {', '.join(UPLOAD_MODES)}, got "
                        f"{cfg.checkpoint_upload!r}")
    if cfg.seq_len > cfg.model.block_size:
        raise UserError(f"--seq-len {cfg.seq_len} is larger than the model's context "
                        f"(model.block_size={cfg.model.block_size}); lower it or --set "
                        f"model.block_size=...")
    if cfg.precision not in PRECISIONS:
        raise UserError(f"precision must be auto, fp32, bf16 or fp16, got {cfg.precision!r}")
    check_layout(cfg)
    check_elastic(cfg)
    if cfg.layout not in (None, "auto"):
        raise UserError(f"--layout must be auto (or left out), got {cfg.layout!r}")
    if cfg.gpus_per_node is not None and cfg.gpus_per_node < 1:
        raise UserError(f"--gpus-per-node must be at least 1, got {cfg.gpus_per_node}")
    if cfg.layout == "auto" and cfg.min_workers is not None and cfg.min_workers != cfg.workers:
        raise UserError("--layout auto plans one worker count: give --workers N, not MIN-MAX")
    if not cfg.rendezvous_timeout > 0:
        raise UserError(f"rendezvous_timeout must be positive (seconds), got {cfg.rendezvous_timeout:g}")


def check_model(m) -> None:
    """A ModelConfig's own values (a run's, a checkpoint's, a Hugging Face folder's): sizes at
    least 1 and within bounds, each and together (check_size), the family and its settings."""
    for key in ("n_layer", "n_head", "n_embd", "block_size"):
        if getattr(m, key) < 1:
            raise UserError(f"--model.{key.replace('_', '-')} must be at least 1, got {getattr(m, key)}")
    check_size(m)
    if not 0.0 <= m.dropout < 1.0:
        raise UserError(f"model.dropout must be in [0, 1), got {m.dropout}")
    if not m.init_std > 0:
        raise UserError(f"model.init_std must be positive, got {m.init_std}")
    if m.n_embd % m.n_head:
        raise UserError(f"model.n_embd ({m.n_embd}) must be divisible by model.n_head ({m.n_head})")
    family(m).check(m)
    check_parameters(m)
    mup.check(m)


# The counts among a model's whole-number settings; every other one (n_embd, head_size, ffn_dim,
# shared_ffn_dim, block_size, sliding_window, ...: a setting added later too) is a width.
MODEL_COUNTS = ("n_layer", "n_head", "n_kv_head", "n_experts", "top_k")
# The most parameters a model may have: 10^14, a hundred times the largest published (~10^12);
# 400 TB in fp32. Each size within its bound still multiplies into more (2^20 layers of 2^24
# wide), and the planner, the tensor names of a Hugging Face folder and the model itself are
# sized by the product.
MAX_PARAMS = 10 ** 14
# The most experts of all layers together (n_layer x n_experts): 2^18, ten times Kimi K2's (61 x
# 384); a Hugging Face folder holds three tensors per expert per layer, each listed by name.
MAX_LAYER_EXPERTS = 1 << 18


def _number(value: int) -> str:
    """A whole number for a message: 1,048,576, or 10^400 (not its 530 characters)."""
    return f"{value:,}" if abs(value) < 10 ** 18 else f"about 10^{len(str(abs(value))) - 1}"


def check_size(m) -> None:
    """Every whole-number size of the model within its bound (MAX_COUNT, MAX_WIDTH, MAX_VOCAB),
    the experts of all layers too (a folder lists 3 tensors per expert per layer), and every
    number finite: checked before anything is built, counted or listed from them."""
    for f in dataclasses.fields(m):
        value = getattr(m, f.name)
        if isinstance(value, float) and not math.isfinite(value):
            raise UserError(f"model.{f.name} must be a finite number, got {value}")
        if not isinstance(value, int) or isinstance(value, bool) or f.name == "vocab_size":
            continue
        most = MAX_COUNT if f.name in MODEL_COUNTS else MAX_WIDTH
        if value > most:  # (too small: the family's rules say what each may be)
            raise UserError(f"model.{f.name} must be at most {most:,}, got {_number(value)}")
    if m.vocab_size is not None and not 1 <= m.vocab_size <= MAX_VOCAB:
        raise UserError(f"model.vocab_size must be between 1 and {MAX_VOCAB:,}, got {_number(m.vocab_size)}")
    if m.n_layer * m.n_experts > MAX_LAYER_EXPERTS:
        raise UserError(f"model.n_layer x model.n_experts ({m.n_layer:,} x {m.n_experts:,}) must be "
                        f"at most {MAX_LAYER_EXPERTS:,}: the experts of all layers")


def check_parameters(m) -> None:
    """The model's parameters (its family's count, the vocabulary at least 1) within MAX_PARAMS,
    and its derived widths (the MLP's hidden size, the head size) within MAX_WIDTH."""
    for what, value in (("the MLP's hidden size (model.ffn_dim)", m.hidden_dim),
                        ("the head size (model.head_size)", m.head_dim)):
        if value > MAX_WIDTH:
            raise UserError(f"{what} must be at most {MAX_WIDTH:,}, got {_number(value)}")
    total = family(m).counts(m).total
    if total > MAX_PARAMS:
        raise UserError(f"the model would have {_number(total)} parameters ({_bytes(4 * total)} in "
                        f"fp32), more than the {MAX_PARAMS:.0e} this project builds: lower its sizes")


def _bytes(n: int) -> str:
    """Bytes in decimal units: 400 TB."""
    unit = next((u for u in ("PB", "TB", "GB", "MB", "KB") if n >= 10 ** (3 * ("KMGTP".index(u[0]) + 1))), "")
    return f"{n / 10 ** (3 * ('KMGTP'.index(unit[0]) + 1)):,.0f} {unit}" if unit else f"{n} B"


def check_bounds(cfg: TrainConfig) -> None:
    """No count or width of a run past what any cluster runs (MAX_COUNT, MAX_WIDTH)."""
    for key in ("workers", "min_workers", "batch_size", "grad_accum", "tp", "pp", "microbatches",
                "virtual_stages", "gpus_per_node"):
        value = getattr(cfg, key, None)
        if value is not None and value > MAX_COUNT:
            raise UserError(f"--{key.replace('_', '-')} must be at most {MAX_COUNT:,}, got {value:,}")
    if cfg.seq_len > MAX_WIDTH:
        raise UserError(f"--seq-len must be at most {MAX_WIDTH:,}, got {cfg.seq_len:,}")


# The sampler slides its window over the context (generate.sample), so a text may be longer
# than the model attends to; the bound keeps what one call holds (every id, the text, --json's
# document) to a few MB, not the model's context.
MAX_NEW_TOKENS = 1 << 20


def check_sampling(max_new_tokens: int, temperature: float, top_k: Optional[int]) -> None:
    if max_new_tokens < 1:
        raise UserError(f"--max-new-tokens must be at least 1, got {max_new_tokens}")
    if max_new_tokens > MAX_NEW_TOKENS:
        raise UserError(f"--max-new-tokens must be at most {MAX_NEW_TOKENS:,}, got {max_new_tokens:,}")
    if not math.isfinite(temperature):
        raise UserError(f"--temperature must be a finite number, got {temperature}")
    if temperature < 0:
        raise UserError(f"--temperature must be >= 0 (0: always the likeliest token), got {temperature}")
    if top_k is not None and top_k < 1:
        raise UserError(f"--top-k must be at least 1, got {top_k}")
