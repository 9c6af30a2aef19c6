"""A run's summary from its metrics rows, built in one place: by the driver as the run goes (and at
its end), and by `runs`/`report` for a run whose driver never wrote summary.json; summary.json's
whole content (build_summary)."""

from __future__ import annotations

import datetime as _dt
import statistics
from typing import Any, Optional

from raytrain_lm.config.settings import TrainConfig
from raytrain_lm.config.sizes import is_elastic, workers_text
from raytrain_lm.store.row import MetricsRow


def _median(values: list) -> Optional[float]:
    return statistics.median(values) if values else None


def from_metrics(rows: list[MetricsRow]) -> dict[str, Any]:
    """What the metrics rows (metrics.jsonl) tell about a run."""
    last = rows[-1] if rows else {}
    evals = [r for r in rows if r.get("val_loss") is not None]
    # Steady state: drop the first interval (compilation, allocator and cache warm-up).
    steady = rows[1:] if len(rows) > 2 else rows
    return {
        "steps": last.get("step", 0),
        "tokens": last.get("tokens", 0),
        "final_train_loss": last.get("loss"),
        "final_val_loss": evals[-1]["val_loss"] if evals else None,
        "val_perplexity": evals[-1]["val_ppl"] if evals else None,
        "best_val_loss": min(r["val_loss"] for r in evals) if evals else None,
        # bits per byte of validation text: comparable between runs of different tokenizers
        "final_val_bpb": evals[-1].get("val_bpb") if evals else None,
        "tokens_per_second": _median([r["tokens_per_second"] for r in steady]),
        "mfu": _median([r["mfu"] for r in steady if r.get("mfu") is not None]),
        "data_wait_frac": _median([r["data_wait_frac"] for r in steady if "data_wait_frac" in r]),
        "peak_mem_gb": max((r["peak_mem_gb"] for r in rows if "peak_mem_gb" in r), default=None),
        "peak_mem_reserved_gb": max((r["peak_mem_reserved_gb"] for r in rows
                                     if r.get("peak_mem_reserved_gb") is not None), default=None),
        "num_parameters": last.get("num_parameters"),
        "resumed_from_step": last.get("resumed_from_step"),
    }


def build_summary(cfg: TrainConfig, rows: list[dict], status: str, wall: float, t_launch: float,
                  checkpoint: Optional[str] = None, error: Optional[str] = None) -> dict:
    last = rows[-1] if rows else {}
    return {
        "status": status,
        "name": cfg.name,
        **from_metrics(rows),
        "max_steps": cfg.max_steps,
        "time_to_first_step": (last["train_start_unix"] - t_launch) if last.get("train_start_unix") else None,
        "wall_seconds": wall,
        "workers": workers_text(cfg) if is_elastic(cfg) else cfg.workers,
        "use_gpu": cfg.use_gpu,
        "preset": cfg.preset,
        "checkpoint": checkpoint,
        "error": error,
        "config": cfg.to_dict(),
        "finished": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
    }
