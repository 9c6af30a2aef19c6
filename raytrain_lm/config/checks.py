"""Checks of a TrainConfig that need no cluster and no dataset: the values, the parallel layout,
what a resumed run may change, names. Every failure is one line (UserError). Also the sampling
flags of `generate` (checked before torch is imported)."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Optional

from raytrain_lm.config.sizes import check_elastic, pipeline_microbatches, pipeline_stages
from raytrain_lm.errors import UserError
from raytrain_lm.store.files import NAME_RULE, is_plain_name

if TYPE_CHECKING:
    from raytrain_lm.config.settings import TrainConfig

# The most tokens a vocabulary may have: a size from a flag, a manifest or a tokenizer.json sizes
# tables by it (the BPE trainer's, the tokenizer's byte table, the model's embedding), so an id of
# 1e9 would allocate until memory runs out. 2^20 is four times the largest released LM's (Gemma's
# 262,144) and fits the uint32 shards.
MAX_VOCAB = 1 << 20
SCHEDULES = ("cosine", "wsd", "exp_range")  # of the learning rate (optim.lr_at)
UPLOAD_MODES = ("auto", "sync", "async")  # of checkpoints (checkpointer.py)


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


def check_name(name: Optional[str]) -> None:
    """A run or sweep name is a folder inside --storage, never a path out of it."""
    if name is not None and not is_plain_name(name):
        raise UserError(f"--name {name!r} is not a valid name: use {NAME_RULE}")


PP_SCHEDULES = ("gpipe", "1f1b", "interleaved-1f1b")
STRATEGIES = ("ddp", "zero1", "zero2", "fsdp")


def check_layout(cfg: TrainConfig) -> None:
    """What a (dp, pp, tp) layout needs, checked before any worker starts; one line each."""
    m = cfg.model
    if cfg.tp < 1 or cfg.pp < 1:
        raise UserError(f"--tp and --pp must be at least 1, got {cfg.tp} and {cfg.pp}")
    if cfg.workers % (cfg.tp * cfg.pp):
        raise UserError(f"--workers {cfg.workers} must be a multiple of --tp x --pp = "
                        f"{cfg.tp * cfg.pp}: the data-parallel size is workers / (tp x pp)")
    if m.n_head % cfg.tp:
        raise UserError(f"model.n_head ({m.n_head}) must be divisible by --tp {cfg.tp}: each "
                        f"tensor-parallel rank holds whole attention heads")
    if m.arch == "llama" and m.kv_heads % cfg.tp:
        raise UserError(f"model.n_kv_head ({m.kv_heads}) must be divisible by --tp {cfg.tp}: each "
                        f"tensor-parallel rank holds whole key/value heads")
    if m.block_size % cfg.tp:
        raise UserError(f"model.block_size ({m.block_size}) must be divisible by --tp {cfg.tp}")
    if cfg.sequence_parallel and cfg.tp == 1:
        raise UserError("--sequence-parallel needs --tp 2 or more")
    if cfg.sequence_parallel and cfg.seq_len % cfg.tp:
        raise UserError(f"--seq-len {cfg.seq_len} must be divisible by --tp {cfg.tp} with "
                        f"--sequence-parallel")
    if cfg.compile and (cfg.tp > 1 or cfg.pp > 1):
        raise UserError("--compile works with --tp 1 --pp 1 (ddp or fsdp) for now")
    if cfg.pp_schedule not in PP_SCHEDULES:
        raise UserError(f"--pp-schedule must be one of {', '.join(PP_SCHEDULES)}, got {cfg.pp_schedule!r}")
    if cfg.microbatches < 0:
        raise UserError(f"--microbatches must be >= 0 (0: twice the stages), got {cfg.microbatches}")
    if cfg.virtual_stages < 0 or cfg.virtual_stages == 1:
        raise UserError(f"--virtual-stages must be 0 (2) or at least 2, got {cfg.virtual_stages}")
    if cfg.virtual_stages and cfg.pp_schedule != "interleaved-1f1b":
        raise UserError(f"--virtual-stages needs --pp-schedule interleaved-1f1b (--pp-schedule "
                        f"{cfg.pp_schedule} runs one stage per worker)")
    if cfg.strategy == "zero1" and (cfg.tp > 1 or cfg.pp > 1):
        raise UserError("--strategy zero1 works with --tp 1 --pp 1; use zero2 or fsdp with --tp/--pp")
    if cfg.pp == 1:
        return
    stages, micro = pipeline_stages(cfg), pipeline_microbatches(cfg)
    if m.n_layer < stages:
        raise UserError(f"model.n_layer ({m.n_layer}) is fewer than the {stages} pipeline stages "
                        f"of --pp {cfg.pp} --pp-schedule {cfg.pp_schedule}")
    if micro < cfg.pp:
        raise UserError(f"--microbatches {micro} is fewer than the {cfg.pp} pipeline stages: the "
                        f"pipeline would never fill")
    if cfg.pp_schedule == "interleaved-1f1b" and micro % cfg.pp:
        raise UserError(f"interleaved-1f1b needs --microbatches ({micro}) to be a multiple of "
                        f"--pp ({cfg.pp})")
    if cfg.batch_size % micro:
        raise UserError(f"--batch-size {cfg.batch_size} must be divisible by --microbatches "
                        f"{micro}: each microbatch is batch-size / microbatches sequences")
    if cfg.grad_accum != 1:
        raise UserError("with --pp, the pipeline's --microbatches accumulate gradients: use them "
                        "instead of --grad-accum")
    if cfg.precision == "fp16":
        raise UserError("--precision fp16 (a gradient scaler) is not supported with --pp; use bf16")


def check_tp_in_node(tp: int, workers_on_node: int) -> None:
    """On a GPU worker: its tp group (tp consecutive ranks, and Ray gives a node's workers
    consecutive ranks) stays inside its node only if the node runs a multiple of tp workers.
    Tensor parallelism all-reduces activations in every layer: across nodes it crawls."""
    if tp > 1 and (workers_on_node < tp or workers_on_node % tp):
        raise UserError(f"--tp {tp} needs each tensor-parallel group's {tp} GPUs on one node, but "
                        f"a node runs {workers_on_node} of this run's workers; use nodes with a "
                        f"multiple of {tp} GPUs (cluster.yaml: gpu_8x) or a smaller --tp")


def check_tp_fits_nodes(tp: int, gpus_per_node: list[float]) -> None:
    """Before launch, where the cluster's nodes are known: some node holds tp GPUs."""
    most = int(max(gpus_per_node, default=0))
    if tp > 1 and most and most < tp:
        raise UserError(f"--tp {tp} needs {tp} GPUs on one node (tensor parallelism all-reduces "
                        f"activations in every layer) but the cluster's nodes have at most {most}; "
                        f"use nodes with {tp} or more GPUs (cluster.yaml: gpu_8x) or a smaller --tp")


def validate(cfg: TrainConfig) -> None:
    """Checks that need no cluster and no dataset."""
    check_name(cfg.name)
    m = cfg.model
    positive = dict(workers=cfg.workers, max_steps=cfg.max_steps, batch_size=cfg.batch_size,
                    seq_len=cfg.seq_len, grad_accum=cfg.grad_accum,
                    eval_every=cfg.eval_every,
                    keep_checkpoints=cfg.keep_checkpoints, **{"model.n_layer": m.n_layer,
                    "model.n_head": m.n_head, "model.n_embd": m.n_embd,
                    "model.block_size": m.block_size})
    for k, v in positive.items():
        if v < 1:
            raise UserError(f"--{k.replace('_', '-')} must be at least 1, got {v}")
    check_finite(cfg)
    if cfg.lr <= 0:
        raise UserError(f"--lr must be positive, got {cfg.lr}")
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
    if cfg.warmup_steps < 0 or cfg.checkpoint_every < -1 or cfg.max_failures < -1 or cfg.eval_windows < 0:
        raise UserError("warmup_steps and eval_windows must be >= 0, checkpoint_every and max_failures >= -1")
    if cfg.max_preemptions < -1 or cfg.resize_interval < 0:
        raise UserError("max_preemptions must be >= -1 and resize_interval >= 0")
    if cfg.checkpoint_upload not in UPLOAD_MODES:
        raise UserError(f"--checkpoint-upload must be one of {', '.join(UPLOAD_MODES)}, got "
                        f"{cfg.checkpoint_upload!r}")
    if cfg.horizon is not None and cfg.horizon < 1:
        raise UserError(f"horizon must be at least 1, got {cfg.horizon}")
    if not 0.0 < cfg.decay_fraction <= 1.0:
        raise UserError(f"decay_fraction must be in (0, 1], got {cfg.decay_fraction}")
    if not 0.0 <= cfg.min_lr_ratio <= 1.0:
        raise UserError(f"min_lr_ratio must be in [0, 1], got {cfg.min_lr_ratio}")
    if not 0.0 <= m.dropout < 1.0:
        raise UserError(f"model.dropout must be in [0, 1), got {m.dropout}")
    if m.n_embd % m.n_head:
        raise UserError(f"model.n_embd ({m.n_embd}) must be divisible by model.n_head ({m.n_head})")
    check_arch(m)
    if cfg.seq_len > m.block_size:
        raise UserError(f"--seq-len {cfg.seq_len} is larger than the model's context "
                        f"(model.block_size={m.block_size}); lower it or --set model.block_size=...")
    if cfg.precision not in ("auto", "fp32", "bf16", "fp16"):
        raise UserError(f"precision must be auto, fp32, bf16 or fp16, got {cfg.precision!r}")
    check_layout(cfg)
    check_elastic(cfg)
    if cfg.layout not in (None, "auto"):
        raise UserError(f"--layout must be auto (or left out), got {cfg.layout!r}")
    if cfg.gpus_per_node is not None and cfg.gpus_per_node < 1:
        raise UserError(f"--gpus-per-node must be at least 1, got {cfg.gpus_per_node}")
    if cfg.layout == "auto" and cfg.min_workers is not None and cfg.min_workers != cfg.workers:
        raise UserError("--layout auto plans one worker count: give --workers N, not MIN-MAX")
    if cfg.strategy not in STRATEGIES:
        raise UserError(f"--strategy must be one of {', '.join(STRATEGIES)}, got {cfg.strategy!r}")
    if cfg.activation_checkpointing not in ("none", "selective", "op", "full"):
        raise UserError("--activation-checkpointing must be none, selective, op or full, got "
                        f"{cfg.activation_checkpointing!r}")
    if cfg.schedule not in SCHEDULES:
        raise UserError(f"--schedule must be one of {', '.join(SCHEDULES)}, got {cfg.schedule!r}")
    if cfg.schedule == "exp_range" and cfg.min_lr_ratio <= 0:
        raise UserError("the exp_range schedule starts at lr * min_lr_ratio, which must be > 0")
    if cfg.ref_batch_tokens is not None and cfg.ref_batch_tokens < 1:
        raise UserError(f"ref_batch_tokens must be at least 1, got {cfg.ref_batch_tokens}")
    if cfg.model.vocab_size is not None and not 1 <= cfg.model.vocab_size <= MAX_VOCAB:
        raise UserError(f"model.vocab_size must be between 1 and {MAX_VOCAB:,}, got "
                        f"{cfg.model.vocab_size:,}")


# The sampler slides its window over the context (generate.sample), so a text may be longer
# than the model attends to; the bound keeps what one call holds (every id, the text, --json's
# document) to a few MB, not the model's context.
MAX_NEW_TOKENS = 1 << 20


ARCHS = ("gpt", "llama")


def check_arch(m) -> None:
    """The architecture and its own settings (ModelConfig)."""
    if m.arch not in ARCHS:
        raise UserError(f"model.arch must be one of {', '.join(ARCHS)}, got {m.arch!r}")
    if m.arch != "llama":
        return
    if m.bias:
        raise UserError("the Llama has no biases: drop model.bias=true")
    if m.dropout:
        raise UserError("the Llama has no dropout: drop model.dropout")
    if m.n_kv_head is not None and (m.n_kv_head < 1 or m.n_head % m.n_kv_head):
        raise UserError(f"model.n_kv_head ({m.n_kv_head}) must divide model.n_head ({m.n_head}): "
                        f"each key/value head serves a group of query heads")
    if m.head_dim % 2:
        raise UserError(f"the head size model.n_embd / model.n_head ({m.head_dim}) must be even: "
                        f"rotary embeddings turn pairs of dimensions")
    for key in ("ffn_dim", "multiple_of"):
        if getattr(m, key) is not None and getattr(m, key) < 1:
            raise UserError(f"model.{key} must be at least 1, got {getattr(m, key)}")
    for key in ("ffn_multiplier", "rope_theta", "norm_eps"):
        if getattr(m, key) is not None and not getattr(m, key) > 0:
            raise UserError(f"model.{key} must be positive, got {getattr(m, key)}")


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
