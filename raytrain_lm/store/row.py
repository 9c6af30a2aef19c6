"""`MetricsRow`, one metrics row as a worker reports it (`worker/metrics.Meter.row`, completed by
the loop and the checkpointer), the controller's callbacks pass it on, and the driver writes it
to metrics.jsonl, TensorBoard and summary.json, which `report` and `runs` read back. A TypedDict:
on the wire and on disk it stays the plain dict with these exact keys (old runs' files still
read), and a type checker sees a misspelt key. Torch-free; below both the driver and the workers.
"""

from __future__ import annotations

from typing import Optional, TypedDict


class MetricsRow(TypedDict, total=False):
    # the step and its optimisation (Meter.row)
    step: int
    loss: float  # mean over the interval's steps, all data-parallel groups
    step_losses: list[float]  # each step's global loss (exact-resume checks)
    lr: float
    grad_norm: float  # before clipping
    # speed and memory (Meter.row); GB = 1e9 bytes
    tokens_per_second: float
    step_time: float  # seconds per step, this interval
    data_wait_frac: float
    mfu: Optional[float]  # None without a known peak
    peak_mem_gb: float
    peak_mem_reserved_gb: Optional[float]  # None on CPU
    model_state_gb: float  # params + grads + optimizer states, max over ranks
    mem_above_baseline_gb: float
    build_mem_gb: float
    param_fraction: float  # of the model's parameters rank 0 holds
    bubble: Optional[float]  # the pipeline's idle share, None without pp
    comm_bytes: dict[str, int]  # rank 0's bytes per step, per mesh dim
    elapsed: float  # seconds since this worker group's loop started
    train_start_unix: float
    first_step_unix: Optional[float]
    num_parameters: int
    # a mixture of experts' (parallel/ep.moe_summary), over the interval's training forwards
    aux_loss: float  # load-balancing loss, mean over MoE layers; 1.0 when balanced
    z_loss: float  # router z-loss, mean over MoE layers
    expert_load: list[float]  # each MoE layer's max / mean tokens per expert; 1.0 when balanced
    # the gradient noise scale (plan/noise_scale.py), smoothed over the run's steps so far; only
    # where the layout gives two batch sizes (parallel/noise.py)
    noise_scale: Optional[float]  # B_simple in sequences; None while |G|^2 is not yet positive
    noise_grad_sq: float  # the smoothed |G|^2
    noise_trace: float  # the smoothed tr(Sigma), per sequence
    # the loop's
    tokens: int  # seen so far
    epoch: int
    workers: int
    threads: int  # torch threads per worker
    preemption: str  # a node of the run about to go: why this checkpoint was taken
    # --checkpoint-every auto's choice, on the first row after it (plan/goodput.CheckpointChoice:
    # every, step_s, stop_s, mtbf_s, restart_s, goodput, optimum_s; at: the step it was made at)
    checkpoint_auto: dict[str, float]
    val_loss: float  # nats per token, validation rows only
    val_ppl: float
    val_bpb: float  # bits per byte of text
    replica_spread: float  # checkpoint rows of replicated layouts: 0.0 when replicas agree
    # the checkpointer's
    resumed_from_step: Optional[int]
    checkpoint_wait_s: float  # how long training stood still for the previous checkpoint
    resumed_rows: list[dict]  # rows re-sent after a resume (the driver unpacks them)
    earlier_rows: list[dict]  # the rows made since the previous report (the driver unpacks them)
    # the controller's and the driver's
    checkpoint: str  # the checkpoint this row's step saved (its path, or its name)
    event: str  # "worker_failure": a failed worker group; "nonfinite": the workers stopped
    # (error: "loss became nan at step N"), having saved nothing after the last good checkpoint
    error: str


ROW_KEYS = frozenset(MetricsRow.__annotations__)

# The metrics of a row that charts show, each under one name wherever it is charted (TensorBoard,
# MLflow, Weights & Biases): metrics key -> chart name; the prefix groups the charts.
CHART_NAMES: dict[str, str] = {
    "loss": "loss/train",
    "val_loss": "loss/val",
    "val_ppl": "loss/val_perplexity",
    "val_bpb": "loss/val_bits_per_byte",
    "lr": "optim/lr",
    "grad_norm": "optim/grad_norm",
    "tokens_per_second": "perf/tokens_per_second",
    "mfu": "perf/mfu",
    "step_time": "perf/step_time_s",
    "data_wait_frac": "perf/data_wait_frac",
    "peak_mem_gb": "perf/peak_mem_gb",
    "peak_mem_reserved_gb": "perf/peak_mem_reserved_gb",
    "bubble": "perf/pipeline_bubble",
    "noise_scale": "optim/noise_scale",
    "checkpoint_wait_s": "perf/checkpoint_wait_s",
    "tokens": "progress/tokens",
    "epoch": "progress/epoch",
    "workers": "progress/workers",
}


def chart_values(row: dict) -> dict[str, float]:
    """The charted metrics of `row` that it has as numbers: chart name -> value."""
    return {name: float(row[key]) for key, name in CHART_NAMES.items()
            if isinstance(row.get(key), (int, float)) and not isinstance(row.get(key), bool)}
