"""Held-out prediction of a scaling law fitted on small runs (plan/scaling_law.py): an IsoFLOP grid of
small GPTs on the built-in pydoc corpus (bytes), each trained to its own end with the product's
step (worker/step.TrainStep, one worker, in this process: the arithmetic of `tune --scaling`'s
trials without Ray's start-up), the law fitted on runs of at most C FLOPs, then a run of about
--holdout x C trained for the check and compared with the law's prediction.

Every run: 2 layers, heads 16 wide (one head below 32), batch --batch x 64 tokens, AdamW lr --lr with 10% warmup and
a cosine to 10% at its own last step, seed 0; its final loss is the mean over --val-windows
validation windows. N: matmul parameters; D: steps x tokens per step; C = 6ND.

    nice -n 10 python bench/scaling_holdout.py [--out bench/results/scaling_holdout.json]
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
    import pyarrow as pa

    with pa.memory_map(str(data / f"{split}-00000.arrow")) as src:
        return pa.ipc.open_file(src).get_batch(0).column(0).to_numpy().astype(np.int64)


class Stream:
    def __init__(self, toks: np.ndarray, batch: int, seed: int):
        self.toks, self.batch = toks, batch
        self.rng = np.random.default_rng(seed)

    def next(self):
        s = self.rng.integers(0, len(self.toks) - SEQ - 1, self.batch)
        w = torch.from_numpy(np.stack([self.toks[i:i + SEQ + 1] for i in s]))
        return w[:, :-1], w[:, 1:]


def config(width: int, steps: int, a):
    return build_config(sets=["model.n_layer=2", f"model.n_head={max(1, width // 16)}",
                              f"model.n_embd={width}", f"model.block_size={SEQ}",
                              "model.vocab_size=256", "model.dropout=0"],
                        flags={"workers": 1, "lr": a.lr, "seq_len": SEQ, "batch_size": a.batch,
                               "grad_accum": 1, "warmup_steps": max(1, steps // 10),
                               "max_steps": steps, "seed": 0})


def matmul_params(width: int, a) -> int:
    cfg = config(width, 10, a)
    return family(cfg.model).matmul_params(cfg.model)


def run(width: int, steps: int, train: np.ndarray, val: torch.Tensor, a) -> dict:
    cfg = config(width, steps, a)
    torch.manual_seed(0)
    step = TrainStep(cfg, torch.device("cpu"), ddp_wrap=lambda m: m)
    stream = Stream(train, a.batch, 0)
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


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", default="/tmp/h52/pydoc")
    ap.add_argument("--widths", default="8,16,24,32")
    ap.add_argument("--levels", default="2e10,4e10,8e10", help="the grid's compute levels (FLOPs)")
    ap.add_argument("--holdout", type=float, default=6.0, help="the held-out run's compute / the grid's largest")
    ap.add_argument("--holdout-width", type=int, default=32)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--val-windows", type=int, default=1024)
    ap.add_argument("--out", default=str(ROOT / "bench/results/scaling_holdout.json"))
    a = ap.parse_args()
    torch.set_num_threads(1)
    data = Path(a.data)
    train, val_tokens = tokens(data, "train"), tokens(data, "val")
    starts = np.random.default_rng(9).integers(0, len(val_tokens) - SEQ - 1, a.val_windows)
    val = torch.from_numpy(np.stack([val_tokens[s:s + SEQ + 1] for s in starts]))
    widths = [int(w) for w in a.widths.split(",")]
    levels = [float(c) for c in a.levels.split(",")]
    runs = []
    for c in levels:
        for w in widths:
            steps = max(10, round(c / (6 * matmul_params(w, a) * a.batch * SEQ)))
            runs.append(run(w, steps, train, val, a))
            print(json.dumps(runs[-1]), flush=True)
    n, d, loss = (np.array([r[k] for r in runs], dtype=float) for k in ("n", "d", "val_loss"))
    law = fit(n, d, loss)
    spread = bootstrap(n, d, loss, samples=50, law=law)
    levels_fit, iso = isoflop_optima(n, d, loss)
    c_max = max(r["flops"] for r in runs)
    hw = a.holdout_width
    h_steps = round(a.holdout * c_max / (6 * matmul_params(hw, a) * a.batch * SEQ))
    held = run(hw, h_steps, train, val, a)
    predicted = float(law.loss(held["n"], held["d"]))
    out = {
        "what": "scaling law fitted on an IsoFLOP grid, predicting a held-out larger run",
        "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="minutes"),
        "settings": vars(a), "runs": runs, "law": law.as_dict(), "spread": spread,
        "law_exponent_a": law.beta / (law.alpha + law.beta),
        "isoflop": [{"flops": g.flops, "n_opt": g.n_opt} for g in levels_fit],
        "isoflop_exponent_a": iso[1] if iso else None,
        "fit_residuals": (loss / law.loss(n, d) - 1).tolist(),
        "holdout": {**held, "compute_ratio": held["flops"] / c_max, "predicted": predicted,
                    "error": predicted / held["val_loss"] - 1},
    }
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(out, indent=2))
    print(json.dumps({k: out[k] for k in ("law", "spread", "law_exponent_a", "isoflop_exponent_a",
                                          "holdout")}, indent=2))


if __name__ == "__main__":
    main()
