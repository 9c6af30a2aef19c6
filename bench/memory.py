#!/usr/bin/env python
"""Per-worker memory of DDP vs FSDP on 2 CPU workers (gloo), measured, next to `plan`'s prediction.

The model is sized so parameters, gradients and AdamW states dominate (short sequences, small
batch). Measured per worker (max over the 2 ranks):
  model state  bytes of the parameter, gradient and optimizer-state tensors each rank holds
  peak RSS above baseline  the worker's peak resident memory minus its RSS before the model existed

    python bench/memory.py                 # ~25M parameters, 3 steps each
    python bench/memory.py --layers 12 --width 768 --out docs/memory.json
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

from raytrain_lm.config.load import build_config
from raytrain_lm.plan.estimate import estimate
from raytrain_lm.plan.hardware import GB
from raytrain_lm.run.driver import run_training


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--width", type=int, default=512)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--data", default="data/pydoc")
    ap.add_argument("--out", default=None, help="write the results as JSON here")
    args = ap.parse_args()

    sets = [f"model.n_layer={args.layers}", f"model.n_embd={args.width}", "model.n_head=8",
            "batch_size=2", "seq_len=64", "eval_windows=4"]
    results = {}
    with tempfile.TemporaryDirectory() as storage:
        for strategy in ("ddp", "fsdp"):
            cfg = build_config(flags=dict(workers=2, max_steps=args.steps, log_every=args.steps,
                                          eval_every=args.steps, checkpoint_every=0,
                                          strategy=strategy, data=args.data, storage=storage,
                                          name=strategy), sets=sets)
            rows = []
            run_training(cfg, say=lambda m: None, on_metrics=rows.append)
            plan = estimate(cfg.model, cfg.workers, cfg.strategy, cfg.activation_checkpointing,
                            cfg.batch_size, cfg.seq_len, gpu=cfg.use_gpu)
            last = rows[-1]
            results[strategy] = {
                "parameters": last["num_parameters"],
                "measured_model_state_gb": last["model_state_gb"],
                "planned_model_state_gb": plan.model_state / GB,
                "measured_peak_rss_above_baseline_gb": last["mem_above_baseline_gb"],
                "planned_total_gb": plan.total / GB,
                "param_fraction_rank0": last["param_fraction"],
            }
    ddp, fsdp = results["ddp"], results["fsdp"]
    results["fsdp_over_ddp_model_state"] = fsdp["measured_model_state_gb"] / ddp["measured_model_state_gb"]
    for r in (ddp, fsdp):
        r["plan_error_model_state"] = r["planned_model_state_gb"] / r["measured_model_state_gb"] - 1
        r["plan_error_total"] = r["planned_total_gb"] / r["measured_peak_rss_above_baseline_gb"] - 1
    print(f"{'':<6}{'params':>12}{'model state GB':>16}{'plan GB':>9}{'err':>7}"
          f"{'RSS above base GB':>19}{'plan total':>11}{'err':>7}")
    for name in ("ddp", "fsdp"):
        r = results[name]
        print(f"{name:<6}{r['parameters']:>12,}{r['measured_model_state_gb']:>16.3f}"
              f"{r['planned_model_state_gb']:>9.3f}{r['plan_error_model_state']:>7.1%}"
              f"{r['measured_peak_rss_above_baseline_gb']:>19.3f}{r['planned_total_gb']:>11.3f}"
              f"{r['plan_error_total']:>7.1%}")
    print(f"FSDP / DDP model-state memory per worker: {results['fsdp_over_ddp_model_state']:.2f}x")
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
