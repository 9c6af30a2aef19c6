"""What a run is, typed: TrainConfig (each setting's default and help beside it; its `model` is the
family's ModelConfig, models/family.py),
and `apply_overrides`, the one way a layer of settings (a preset, a file, flags, --set, a saved
config.json) is applied: it rejects unknown keys and wrong types, so a typo never silently trains
the wrong model. Presets: presets.py; layering the sources: load.py; checks: checks.py."""

from __future__ import annotations

import dataclasses
import math
import types
import typing
from dataclasses import dataclass, field
from typing import Any, Optional

from raytrain_lm import env
from raytrain_lm.env import STORAGE_ENV
from raytrain_lm.errors import UserError, brief
from raytrain_lm.models.family import ModelConfig, setting

DEFAULT_DATA = "data/pydoc"  # the built-in corpus, prepared on first use


def default_storage() -> str:
    """Where runs live when --storage is not given: a cluster sets RAYTRAIN_LM_STORAGE on every
    node (cluster.yaml: s3://...), so the driver, the workers and the read commands agree."""
    return env.storage() or "runs"


# What a saved model config that lacks a setting meant: every GPT trained before `gelu` existed
# used GPT-2's tanh GELU, so its runs resume, export and sample with it.
SAVED_BEFORE: dict[str, Any] = {"gelu": "tanh"}


@dataclass
class TrainConfig:
    preset: str = setting("tiny", help="Model preset: tiny, small, gpt2, gpt2-medium (GPT); "
                          "llama-tiny, llama-small; llama2-7b/13b/70b, llama3-8b/70b/405b (for plan).")
    model: ModelConfig = field(default_factory=ModelConfig)
    # data and run location
    data: str = setting(DEFAULT_DATA, help="Prepared dataset: a folder or s3://... / gs://... "
                        "(the default is prepared on first use).")
    name: Optional[str] = setting(None, help="Run name [default: <preset>-<date>-<time>].")
    storage: str = setting(factory=default_storage, help="Where runs live: a folder or s3://... "
                           f"[default: ${STORAGE_ENV}, else runs].")
    address: Optional[str] = setting(None, help="Ray cluster to use [default: RAY_ADDRESS, else a running "
                                     "`cluster local-up` cluster, else start a local one; `local`: always "
                                     "start one].")
    # scaling
    workers: int = setting(2, help="Ray Train workers (one process each); MIN-MAX: elastic, "
                           "from MIN up to MAX as the cluster allows (see min_workers).")
    min_workers: Optional[int] = setting(None, help="Elastic: the fewest workers the run trains "
                                         "on (`--workers MIN-MAX` sets it); it starts when MIN "
                                         "fit and grows and shrinks with the cluster. None or "
                                         "--workers: a fixed size.")
    resize_interval: float = setting(60.0, help="Elastic: seconds between checks whether the "
                                     "cluster holds more (or fewer) workers than are training.")
    use_gpu: bool = setting(False, help="One GPU per worker, NCCL.")
    cpus_per_worker: Optional[float] = setting(None, help="CPUs Ray reserves for each worker, "
                                               "and so its torch threads [default: on a Ray the "
                                               "command starts, the machine's cores shared among "
                                               "the workers; on a cluster, 1].")
    scale_timeout: float = setting(900.0, help="Seconds to wait for an autoscaler to add the nodes "
                                   "training needs.")
    # optimisation
    max_steps: int = setting(300, help="Optimizer steps.")
    batch_size: int = setting(16, help="Sequences per worker per micro-step.")
    seq_len: int = setting(128, help="Tokens per sequence (<= model.block_size).")
    grad_accum: int = setting(1, help="Micro-steps per optimizer step.")
    lr: float = setting(3e-3, help="Peak learning rate (after warmup).")
    min_lr_ratio: float = setting(0.1, help="The schedule decays to lr x this (exp_range starts there).")
    schedule: str = setting("cosine", help="cosine: warmup, then cosine decay to the end; wsd: "
                            "warmup, stable, then a linear decay over the last --decay-fraction of "
                            "the steps (a resumed run can add steps while still stable); "
                            "exp_range: lr-find's exponential ramp.")
    decay_fraction: float = setting(0.2, help="wsd: the share of the steps spent decaying.")
    horizon: Optional[int] = setting(None, help="Step at which the schedule reaches its minimum "
                                     "[default: max_steps]. A resumed run given more --max-steps "
                                     "keeps its horizon where moving it would change the learning "
                                     "rate, and holds the minimum after it.")
    ref_batch_tokens: Optional[int] = setting(None, help="Tokens per step `lr` was chosen at "
                                              "(--scale-lr) [default: the preset's].")
    warmup_steps: int = setting(30, help="Steps of linear warmup.")
    weight_decay: float = setting(0.1, help="AdamW weight decay (matrices and embeddings only).")
    beta1: float = setting(0.9, help="AdamW beta1.")
    beta2: float = setting(0.95, help="AdamW beta2.")
    grad_clip: float = setting(1.0, help="Clip the global gradient norm to this.")
    precision: str = setting("auto", help="fp32, bf16 or fp16 (with a gradient scaler); auto: bf16 "
                             "on a GPU with bf16 units, fp16 on one without (T4, V100; fp32 with "
                             "--pp), fp32 on CPU. FSDP computes in it by its mixed-precision "
                             "policy, other layouts by autocast.")
    compile: bool = setting(False, help="torch.compile the model.")
    strategy: str = setting("ddp", help="The data-parallel dimension: ddp (a full replica per "
                            "data-parallel rank), zero1 (ZeRO-1: gradients reduce-scattered, "
                            "parameters gathered once per step; --tp 1 --pp 1), zero2 (gathered "
                            "once per micro-step, kept from forward to backward) or fsdp (gathered "
                            "for each use); all three hold parameters, gradients and AdamW's "
                            "states sharded over the ranks between steps (FSDP2).")
    tp: int = setting(1, help="Tensor-parallel degree: each layer's matrices split over this many "
                      "workers (keep it within a node).")
    pp: int = setting(1, help="Pipeline-parallel degree: the layers split into this many stages.")
    ep: int = setting(1, help="Expert-parallel degree (model.arch moe): each block's experts split "
                      "over this many of the data-parallel ranks, tokens sent to them by all-to-all "
                      "(it divides the experts and the data-parallel size).")
    microbatches: int = setting(0, help="Pipeline microbatches per step (--pp); they split "
                                "--batch-size. 0: 2 x the stages.")
    pp_schedule: str = setting("1f1b", help="Pipeline schedule: gpipe, 1f1b or interleaved-1f1b "
                               "(--virtual-stages stages per worker).")
    virtual_stages: int = setting(0, help="Stages per worker of --pp-schedule interleaved-1f1b "
                                  "(a smaller bubble, more sends); 0: 2.")
    layout: Optional[str] = setting(None, help="auto: let the planner choose --tp, --pp, "
                                    "--strategy, checkpointing, sequence parallelism, the "
                                    "schedule and the micro-batches for --workers on the "
                                    "cluster Ray reports (GPUs per node, GPU memory; or "
                                    "--gpus-per-node, --gpu-memory-gb); the global batch stays "
                                    "workers x batch-size x grad-accum.")
    gpus_per_node: Optional[int] = setting(None, help="GPUs (workers) per node for --layout auto "
                                           "[default: what Ray reports].")
    sequence_parallel: bool = setting(False, help="With --tp: shard LayerNorm and dropout "
                                      "activations over the sequence too.")
    activation_checkpointing: str = setting("none", help="Recompute activations in backward: none; "
                                            "selective (all but matmul and attention outputs); "
                                            "op (torchtitan's per-op policy: all but attention "
                                            "outputs and every other matmul's); full (each "
                                            "block from its input).")
    seed: int = setting(1337, help="Random seed.")
    # cadence
    log_every: int = setting(0, help="Steps between metrics rows, exactly (1: every step); 0: a "
                             "row per report. Rows are sent together about every --log-seconds, "
                             "so metrics.jsonl has every one without a report per row (a barrier "
                             "that waits for Ray's poll of the workers, every 0.5 s).")
    log_seconds: float = setting(1.0, help="Seconds between metric reports; each report sets the "
                                 "step of the next from the measured step time (the same on every "
                                 "rank).")
    eval_every: int = setting(100, help="Steps between validations.")
    eval_windows: int = setting(256, help="Validation windows (the first ones of the split, the "
                                "same whatever the worker count); 0: all of them.")
    checkpoint_every: int = setting(100, help="Steps between checkpoints; 0: only at the end; "
                                  "-1: none, not even at the end (a benchmark, a smoke run).")
    keep_checkpoints: int = setting(2, help="Checkpoints to keep.")
    checkpoint_upload: str = setting("auto", help="sync: training waits while a checkpoint "
                                     "uploads; async: it trains on while it uploads; auto: async "
                                     "where --storage is remote (s3://, gs://).")
    max_failures: int = setting(0, help="Worker-group restarts after failures allowed (-1: any).")
    max_preemptions: int = setting(-1, help="Worker-group restarts after node preemptions "
                                   "(spot reclaims) allowed, apart from --max-failures; -1: any.")
    # metrics
    peak_tflops: Optional[float] = setting(None, help="GPU peak TFLOP/s for MFU [default: from the "
                                           "GPU's name].")
    gpu_memory_gb: Optional[float] = setting(None, help="Memory per GPU in GiB as cards are sold "
                                             "(80: an 80 GB card), for the pre-launch memory "
                                             "check [default: the GPU's].")
    # torchrun (`--workers 0` under torchrun; issue 48)
    rendezvous_timeout: float = setting(300.0, help="--workers 0 under torchrun: seconds each rank "
                                        "waits for every other to arrive before it gives up, "
                                        "naming the ranks that did not.")
    # long sequences (docs/parallelism.md, "Long sequences")
    cp: int = setting(1, help="Context-parallel degree: each window split over this many workers "
                      "in 2 x cp chunks (worker i takes chunks i and 2cp-1-i), keys and values "
                      "all-gathered over them in every attention; they share the batch.")
    doc_mask: bool = setting(False, help="Block-causal attention: a packed window's tokens attend "
                             "only within their own document (a dataset whose documents are "
                             "separated by <|endoftext|>); positions restart at each document.")
    # the width `lr` was chosen at (tune/lr_scaling.py: --scale-lr under sp)
    ref_width: Optional[int] = setting(None, help="Width (model.n_embd) `lr` was chosen at "
                                       "(--scale-lr: under sp lr x sqrt(ref_width / width); under mup "
                                       "nothing, its groups carry the width) [default: the "
                                       "preset's].")

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "TrainConfig":
        """A config as saved (config.json, a checkpoint's, a sweep's base). A saved model without
        a setting added since means what the code did before it existed (SAVED_BEFORE)."""
        cfg = cls()
        if isinstance(d.get("model"), dict) and d["model"].get("arch", "gpt") == "gpt":
            d = {**d, "model": {**SAVED_BEFORE, **d["model"]}}
        apply_overrides(cfg, d, source="config")
        return cfg

    @property
    def worker_cpus(self) -> float:
        """The CPUs Ray reserves for each worker: cpus_per_worker, else (before the launch
        decides it: run/cpus.py) Ray's own default, 1."""
        return 1.0 if self.cpus_per_worker is None else self.cpus_per_worker

    @property
    def tokens_per_step(self) -> int:
        return self.workers * self.batch_size * self.grad_accum * self.seq_len


def setting_fields() -> dict[str, dataclasses.Field]:
    """TrainConfig's settings, each with its help text: name -> field."""
    return {f.name: f for f in dataclasses.fields(TrainConfig) if "help" in f.metadata}


def _field_types(obj) -> dict[str, Any]:
    hints = typing.get_type_hints(type(obj))
    return {f.name: hints[f.name] for f in dataclasses.fields(obj)}


def _coerce(value: Any, tp: Any, key: str, source: str) -> Any:
    """Convert `value` to type `tp` (a plain type or Optional[...]); raise UserError if it can't be.
    The message shows the value only when it is refused, and only its start (errors.brief)."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if value is None or (isinstance(value, str) and value.lower() in ("none", "null")):
            return None
        return _coerce(value, args[0], key, source)
    converted = _converted(value, tp)
    if converted is None:
        raise UserError(f"{source}: {key} must be {tp.__name__}, got {brief(value)}")
    if isinstance(converted, float) and not math.isfinite(converted):
        # `nan <= 0` is False: no later range check would catch it
        raise UserError(f"{source}: {key} must be a finite number, got {brief(value)}")
    return converted


def _converted(value: Any, tp: Any) -> Any:
    """`value` as `tp` (bool, int, float or str), or None where it is not one."""
    if tp is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("true", "1", "yes", "on", "false", "0", "no", "off"):
            return value.lower() in ("true", "1", "yes", "on")
        return None
    if tp is int:
        if isinstance(value, bool):
            return None
        if isinstance(value, int):
            return value
        if isinstance(value, float) and value.is_integer():
            return int(value)
        if isinstance(value, str):
            try:
                return int(value.replace("_", ""))
            except ValueError:
                try:
                    f = float(value)
                except ValueError:
                    return None
                if f.is_integer():
                    return int(f)
        return None
    if tp is float:
        if isinstance(value, bool):
            return None
        try:  # a number, or its text
            return float(value) if isinstance(value, (int, float, str)) else None
        except (ValueError, OverflowError):
            return None
    if tp is str:
        return value if isinstance(value, str) else None
    return None


def apply_overrides(cfg: Any, overrides: dict[str, Any], source: str, prefix: str = "") -> None:
    """Set fields of a (nested) dataclass from a dict, rejecting unknown keys and wrong types."""
    ftypes = _field_types(cfg)
    for key, value in overrides.items():
        full = f"{prefix}{key}"
        if key not in ftypes:
            known = ", ".join(prefix + k for k in ftypes)
            raise UserError(f"{source}: unknown key {full!r} (known: {known})")
        current = getattr(cfg, key)
        if dataclasses.is_dataclass(current):
            if not isinstance(value, dict):
                raise UserError(f"{source}: {full} must be a mapping of its fields")
            apply_overrides(current, value, source, prefix=f"{full}.")
        else:
            setattr(cfg, key, _coerce(value, ftypes[key], full, source))
