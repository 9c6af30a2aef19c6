"""The gradient noise scale as the worker measures it (parallel/noise.py + plan/noise_scale.py) against
a brute-force estimate on the same frozen model and data, and what measuring it costs per step.

1. A small GPT (2 layers, 64 wide, bytes) trained for --warm steps on the built-in pydoc corpus,
   then frozen. A fixed population of --population windows of it.
2. Brute force: every window's own gradient (batch 1), so the population's mean gradient G and
   per-sample covariance Sigma are exact for sampling with replacement from it:
   B_simple = tr(Sigma) / |G|^2.
3. The worker's estimate: TrainStep on one worker with accumulation (b = one micro-batch of
   --micro windows, B = the step of --accum of them), batches drawn with replacement from the
   population, lr 1e-12 (frozen up to 1e-12), --steps steps; the Meter's smoothed B_simple
   (decay 0.95) at the end, and the ratio of the two estimates averaged over all steps.
4. Cost: the same step with and without the small-batch norm, alternated (ABBA) in blocks of
   --block steps, median seconds per step of each arm.

    nice -n 10 python bench/noise_scale.py [--steps 1200] [--out bench/results/noise_scale.json]
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from raytrain_lm.config.load import build_config  # noqa: E402
from raytrain_lm.plan.noise_scale import NoiseScale, two_batch_estimates  # noqa: E402
from raytrain_lm.worker.step import TrainStep  # noqa: E402

SEQ = 64
SETS = ["model.n_layer=2", "model.n_head=2", "model.n_embd=64", f"model.block_size={SEQ}",
        "model.vocab_size=256", "model.dropout=0"]


def corpus_windows(data: Path, count: int, seed: int) -> torch.Tensor:
    import pyarrow as pa

    with pa.memory_map(str(data / "train-00000.arrow")) as src:
        tokens = pa.ipc.open_file(src).get_batch(0).column(0).to_numpy().astype(np.int64)
    starts = np.random.default_rng(seed).integers(0, len(tokens) - SEQ - 1, count)
    return torch.from_numpy(np.stack([tokens[s:s + SEQ + 1] for s in starts]))


class Draws:
    """Micro-batches of `size` windows drawn with replacement from `pool`."""

    def __init__(self, pool: torch.Tensor, size: int, seed: int):
        self.pool, self.size = pool, size
        self.g = torch.Generator().manual_seed(seed)

    def next(self):
        w = self.pool[torch.randint(0, len(self.pool), (self.size,), generator=self.g)]
        return w[:, :-1], w[:, 1:]


def brute_force(model, pool: torch.Tensor) -> dict:
    """Per-window gradients of the frozen model: G, tr(Sigma) of the population, exactly."""
    model.eval()
    total, total_sq = None, 0.0
    for w in pool:
        model.zero_grad()
        model(w[None, :-1], w[None, 1:])[1].backward()
        g = torch.cat([p.grad.reshape(-1).double() for p in model.parameters() if p.grad is not None])
        total = g if total is None else total + g
        total_sq += float(g @ g)
    mean = total / len(pool)
    g2 = float(mean @ mean)
    trace = total_sq / len(pool) - g2  # E|g_i|^2 - |G|^2 (population covariance)
    model.train()
    return {"grad_sq": g2, "trace": trace, "b_simple": trace / g2}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", default="/tmp/h52/pydoc")
    ap.add_argument("--warm", type=int, default=150)
    ap.add_argument("--population", type=int, default=512)
    ap.add_argument("--micro", type=int, default=4)
    ap.add_argument("--accum", type=int, default=4)
    ap.add_argument("--steps", type=int, default=1200)
    ap.add_argument("--block", type=int, default=20)
    ap.add_argument("--blocks", type=int, default=10)
    ap.add_argument("--out", default=str(ROOT / "bench/results/noise_scale.json"))
    a = ap.parse_args()
    torch.set_num_threads(1)
    data = Path(a.data)
    if not (data / "manifest.json").exists():
        from raytrain_lm.data.prepare import prepare_dataset

        prepare_dataset("pydoc", data)

    # 1. a model worth measuring: trained a little (the noise scale grows as the loss falls)
    cfg = build_config(sets=SETS, flags={"workers": 1, "lr": 3e-3, "seq_len": SEQ, "batch_size": 16,
                                         "grad_accum": 1, "warmup_steps": 10, "max_steps": a.warm})
    torch.manual_seed(0)
    warm = TrainStep(cfg, torch.device("cpu"), ddp_wrap=lambda m: m)
    train = Draws(corpus_windows(data, 20000, 1), 16, 1)
    warm.train()
    for _ in range(a.warm):
        loss, _ = warm(train, 3e-3)
    state = {k: v.clone() for k, v in warm.parts[0].state_dict().items()}
    pool = corpus_windows(data, a.population, 2)

    # 2. brute force on the frozen model
    t0 = time.perf_counter()
    truth = brute_force(warm.parts[0], pool)
    truth["seconds"] = time.perf_counter() - t0

    # 3. the worker's estimator on the same model and population
    cfg = build_config(sets=SETS, flags={"workers": 1, "lr": 1e-12, "seq_len": SEQ,
                                         "batch_size": a.micro, "grad_accum": a.accum,
                                         "warmup_steps": 0, "max_steps": a.steps, "weight_decay": 0.0})
    step = TrainStep(cfg, torch.device("cpu"), ddp_wrap=lambda m: m)
    step.parts[0].load_state_dict(state)
    b, big = step.noise_batches
    draws = Draws(pool, a.micro, 3)
    ema, g2s, traces = NoiseScale(), [], []
    step.train()
    for _ in range(a.steps):
        _, norm = step(draws, 1e-12)
        small, large = step.small_sq[0].item(), norm.item() ** 2
        ema.update(small, large, b, big)
        g2, tr = two_batch_estimates(small, large, b, big)
        g2s.append(g2)
        traces.append(tr)
    mean_ratio = float(np.mean(traces) / np.mean(g2s))
    # the run-mean's standard error (delta method on the ratio of two means)
    rel_se = float(np.sqrt((np.std(traces) / np.mean(traces)) ** 2 + (np.std(g2s) / np.mean(g2s)) ** 2)
                   / np.sqrt(a.steps))
    estimate = {"b": b, "B": big, "steps": a.steps, "ema_b_simple": ema.b_simple,
                "mean_b_simple": mean_ratio, "mean_rel_standard_error": rel_se,
                "ema_vs_truth": ema.b_simple / truth["b_simple"] - 1,
                "mean_vs_truth": mean_ratio / truth["b_simple"] - 1}

    # 4. cost per step, with and without the small-batch norm, alternated
    times: dict[str, list[float]] = {"with": [], "without": []}
    saved = step.small_batch.batches
    for i in range(2 * a.blocks):
        arm = ("with", "without", "without", "with")[i % 4]  # ABBA: neither arm always first
        step.small_batch.batches = saved if arm == "with" else None
        step.small_batch.micro = arm == "with"
        t0 = time.perf_counter()
        for _ in range(a.block):
            step(draws, 1e-12)
        times[arm].append((time.perf_counter() - t0) / a.block)
    cost = {arm: {"median_s": statistics.median(v), "min_s": min(v), "max_s": max(v)}
            for arm, v in times.items()}
    cost["overhead"] = cost["with"]["median_s"] / cost["without"]["median_s"] - 1

    out = {"what": "gradient noise scale: worker estimator vs brute force; cost per step",
           "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="minutes"),
           "model": SETS, "seq_len": SEQ, "population": a.population, "warm_steps": a.warm,
           "warm_loss": float(loss), "brute_force": truth, "estimate": estimate, "cost": cost}
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(out, indent=2))
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
