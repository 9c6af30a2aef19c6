"""Held-out prediction of a scaling law fitted on small runs (plan/scaling_law.py): an IsoFLOP grid of
small GPTs on the built-in stdlib corpus (the standard library's sources as bytes, 29.9M training
tokens: no run reads a third of it, so none repeats data), each trained to its own end with the
product's step (worker/step.TrainStep, one worker, in this process: the arithmetic of `tune
--scaling`'s trials without Ray's start-up), the law fitted on runs of at most C FLOPs, then a run
of --holdout x C trained for the check and compared with the law's prediction.

Every run: --layers layers, heads --head-width wide, batch --batch x 64 tokens, AdamW lr --lr with
10% warmup and a cosine to 10% at its own last step, seed --seed, one thread; its final loss is the
mean over --val-windows validation windows (the same windows for every run). N: matmul
parameters; D: steps x tokens per step; C = 6ND. Every run's result is appended to --cache, so a
rerun trains only what is missing; --only grid / --only holdout train one part (two processes at
once), and the command without --only then fits from the cache.

    python cli.py prepare --corpus stdlib --out /tmp/h52a/stdlib
    nice -n 10 python bench/scaling_holdout.py --only grid &
    nice -n 10 python bench/scaling_holdout.py --only holdout --holdout-width 48
    nice -n 10 python bench/scaling_holdout.py --holdout-width 48   # the fit, the check, --out
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import sys
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from raytrain_lm.config.load import build_config  # noqa: E402
from raytrain_lm.models import family  # noqa: E402
from raytrain_lm.plan.scaling_law import bootstrap, fit, isoflop_optima  # noqa: E402
from raytrain_lm.worker.optim import lr_at  # noqa: E402
from raytrain_lm.worker.step import TrainStep  # noqa: E402

SEQ = 64


def tokens(data: Path, split: str) -> np.ndarray:
    """Every token of a prepared dataset's split (its manifest's shards, in order)."""
    import pyarrow as pa

    parts = []
    for shard in json.loads((data / "manifest.json").read_text())[split]["shards"]:
        with pa.memory_map(str(data / shard["file"])) as src:
            f = pa.ipc.open_file(src)
            parts += [f.get_batch(i).column(0).to_numpy().astype(np.int64) for i in range(f.num_record_batches)]
    return np.concatenate(parts)


class Stream:
    def __init__(self, toks: np.ndarray, batch: int, seed: int):
        self.toks, self.batch = toks, batch
        self.rng = np.random.default_rng(seed)

    def next(self):
        s = self.rng.integers(0, len(self.toks) - SEQ - 1, self.batch)
        w = torch.from_numpy(np.stack([self.toks[i:i + SEQ + 1] for i in s]))
        return w[:, :-1], w[:, 1:]


def config(width: int, steps: int, a):
    return build_config(sets=[f"model.n_layer={a.layers}", f"model.n_head={max(1, width // a.head_width)}",
                              f"model.n_embd={width}", f"model.block_size={SEQ}",
                              "model.vocab_size=256", "model.dropout=0"],
                        flags={"workers": 1, "lr": a.lr, "seq_len": SEQ, "batch_size": a.batch,
                               "grad_accum": 1, "warmup_steps": max(1, steps // 10),
                               "max_steps": steps, "seed": a.seed})


def matmul_params(width: int, a) -> int:
    cfg = config(width, 10, a)
    return family(cfg.model).matmul_params(cfg.model)


def run(width: int, steps: int, train: np.ndarray, val: torch.Tensor, a) -> dict:
    cfg = config(width, steps, a)
    torch.manual_seed(a.seed)
    step = TrainStep(cfg, torch.device("cpu"), ddp_wrap=lambda m: m)
    stream = Stream(train, a.batch, a.seed)
    step.train()
    t0 = time.perf_counter()
    for i in range(steps):
        step(stream, lr_at(i, cfg))
    model = step.parts[0]
    model.eval()
    with torch.no_grad():  # each window's mean loss, 64 windows per forward
        losses = [model(w[None, :-1], w[None, 1:])[1].item() for w in val] if len(val) <= 64 else [
            v for chunk in val.split(64) for v in _window_losses(model, chunk)]
    n = family(cfg.model).matmul_params(cfg.model)
    d = steps * a.batch * SEQ
    return {"width": width, "steps": steps, "n": n, "d": d, "flops": 6 * n * d,
            "val_loss": float(np.mean(losses)),
            "val_loss_se": float(np.std(losses) / np.sqrt(len(losses))),
            "seconds": time.perf_counter() - t0}


def _window_losses(model, chunk: torch.Tensor) -> list[float]:
    """Each window's mean token loss (the model's logits, one cross-entropy per window)."""
    logits = model(chunk[:, :-1], chunk[:, 1:])[0]  # with targets: every position's logits
    loss = torch.nn.functional.cross_entropy(logits.transpose(1, 2), chunk[:, 1:], reduction="none")
    return loss.mean(1).tolist()


def cached_run(width: int, steps: int, train, val, a, cache: dict) -> dict:
    """run(), or its result from --cache (the same width, steps and every setting): a benchmark
    stopped half-way resumes without retraining what it has."""
    key = json.dumps([width, steps, a.layers, a.head_width, a.batch, a.lr, a.val_windows, a.data, a.seed])
    if key not in cache and a.cache and Path(a.cache).exists():  # another process's run (--only)
        cache.update(read_cache(a.cache))
    if key not in cache:
        cache[key] = run(width, steps, train, val, a)
        if a.cache:
            with open(a.cache, "a") as f:
                f.write(json.dumps({"key": key, "run": cache[key]}) + "\n")
    print(json.dumps(cache[key]), flush=True)
    return cache[key]


def read_cache(path: str) -> dict:
    return {r["key"]: r["run"] for r in map(json.loads, Path(path).read_text().splitlines())}


def steps_for(flops: float, width: int, a) -> int:
    return max(10, round(flops / (6 * matmul_params(width, a) * a.batch * SEQ)))


def holdout_width(law, flops: float, a) -> int:
    """The width (a multiple of --head-width) whose model comes nearest the law's compute-optimal
    N at `flops`: the run one would train with the fit."""
    n_opt, _ = law.optimum(flops)
    widths = range(a.head_width, 64 * a.head_width + 1, a.head_width)
    return min(widths, key=lambda w: abs(np.log(matmul_params(w, a) / n_opt)))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", default="/tmp/h52a/stdlib",
                    help="a byte-level dataset: python cli.py prepare --corpus stdlib --out DIR")
    ap.add_argument("--grid", default="1e11:16,24,32,48;3e11:16,24,32,48;1e12:16,24,32,48",
                    help="compute levels (FLOPs) and the widths run at each: C:w,w,...;C:w,...")
    ap.add_argument("--holdout", type=float, default=6.0, help="the held-out run's compute / the grid's largest")
    ap.add_argument("--holdout-width", type=int, default=0,
                    help="the held-out run's width [default: the fit's compute-optimal N at its compute]")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--head-width", type=int, default=16)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--lr", type=float, default=6e-3)
    ap.add_argument("--val-windows", type=int, default=1024)
    ap.add_argument("--seed", type=int, default=0, help="every run's initialisation and data order")
    ap.add_argument("--bootstrap", type=int, default=200)
    ap.add_argument("--cache", default="/tmp/h52a/scaling_runs.jsonl",
                    help="every run's result, appended: a rerun trains only what is not there")
    ap.add_argument("--only", choices=["grid", "holdout"],
                    help="train only these runs into --cache and stop (the held-out one needs "
                         "--holdout-width): two processes at once, then the command without it fits")
    ap.add_argument("--out", default=str(ROOT / "bench/results/scaling_holdout.json"))
    a = ap.parse_args()
    torch.set_num_threads(1)
    data = Path(a.data)
    train, val_tokens = tokens(data, "train"), tokens(data, "val")
    starts = np.random.default_rng(9).integers(0, len(val_tokens) - SEQ - 1, a.val_windows)
    val = torch.from_numpy(np.stack([val_tokens[s:s + SEQ + 1] for s in starts]))
    cache = read_cache(a.cache) if a.cache and Path(a.cache).exists() else {}
    t0 = time.perf_counter()
    grid = [(float(c), [int(w) for w in ws.split(",")])
            for c, ws in (level.split(":") for level in a.grid.split(";"))]
    c_held = a.holdout * max(c for c, _ in grid)  # the grid's top level's, as its steps are rounded
    if a.only == "holdout":
        cached_run(a.holdout_width, steps_for(c_held, a.holdout_width, a), train, val, a, cache)
        return
    runs = [cached_run(w, steps_for(c, w, a), train, val, a, cache) for c, widths in grid for w in widths]
    if a.only == "grid":
        return
    n, d, loss = (np.array([r[k] for r in runs], dtype=float) for k in ("n", "d", "val_loss"))
    law = fit(n, d, loss)
    c_max = max(r["flops"] for r in runs)
    levels_fit, iso = isoflop_optima(n, d, loss)
    hw = a.holdout_width or holdout_width(law, c_held, a)
    held = cached_run(hw, steps_for(c_held, hw, a), train, val, a, cache)
    spread = bootstrap(n, d, loss, flops=c_held, samples=a.bootstrap, law=law, at=(held["n"], held["d"]))
    predicted = float(law.loss(held["n"], held["d"]))
    tokens_per_epoch = len(train)
    out = {
        "what": "scaling law fitted on an IsoFLOP grid, predicting a held-out larger run",
        "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="minutes"),
        "settings": vars(a), "train_tokens": tokens_per_epoch, "runs": runs, "law": law.as_dict(),
        "spread": spread, "law_exponent_a": law.beta / (law.alpha + law.beta),
        "law_optimum_at_holdout": law.optimum(c_held),
        "isoflop": [{"flops": g.flops, "n_opt": g.n_opt} for g in levels_fit],
        "isoflop_exponent_a": iso[1] if iso else None,
        "fit_residuals": (loss / law.loss(n, d) - 1).tolist(),
        "max_epochs": max(r["d"] for r in runs + [held]) / tokens_per_epoch,
        "holdout": {**held, "compute_ratio": held["flops"] / c_max, "predicted": predicted,
                    "error": predicted / held["val_loss"] - 1},
        "wall_seconds": time.perf_counter() - t0,
    }
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(out, indent=2))
    print(json.dumps({k: out[k] for k in ("law", "spread", "law_exponent_a", "isoflop_exponent_a",
                                          "fit_residuals", "max_epochs", "holdout")}, indent=2))


if __name__ == "__main__":
    main()
