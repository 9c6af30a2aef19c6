"""Which tokenizer learns the stdlib corpus best in the same number of steps? The `small` preset
trained with the byte tokenizer and with byte-level BPEs of 2k, 8k and 32k tokens, compared on
validation bits per byte (val_bpb: comparable across tokenizers, a loss per token is not).

Every run has the same steps, the same tokens per step (2 workers x batch x seq_len), the same
model body, optimizer and schedule; only the tokenizer (and with it the embedding's size) differs.
A BPE token stands for ~3-4 bytes, so a BPE run sees 3-4 times more text in the same steps; a
larger vocabulary also costs more FLOPs per token in the output layer (recorded per run). Each
BPE is trained by `prepare` on a 10 MB sample of the corpus; datasets are prepared on Ray.
It starts its own local Ray, so run it alone:

    flock /tmp/ray.lock python bench/tokenizer_bpb.py --steps 200

Prints a table, writes JSON to --out and the plot to --plot.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

TOKENIZERS = [("byte", None), ("bpe", 2048), ("bpe", 8192), ("bpe", 32768)]


def label(kind: str, vocab) -> str:
    return "byte" if kind == "byte" else f"BPE {vocab // 1024}k"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--eval-every", type=int, default=50)
    p.add_argument("--eval-windows", type=int, default=128)
    p.add_argument("--out", default=str(ROOT / "bench" / "results" / "tokenizer_bpb.json"))
    p.add_argument("--plot", default=str(ROOT / "docs" / "img" / "tokenizer_bpb.png"))
    p.add_argument("--plot-only", action="store_true", help="Redraw the plot from --out's JSON.")
    args = p.parse_args()
    if args.plot_only:
        saved = json.loads(Path(args.out).read_text())
        plot(saved["runs"], argparse.Namespace(**saved["settings"]))
        return

    import ray

    from raytrain_lm.config.load import build_config
    from raytrain_lm.data.prepare import prepare_dataset
    from raytrain_lm.models import flops_per_token
    from raytrain_lm.run.driver import run_training

    ray.init(num_cpus=3, include_dashboard=False, log_to_driver=False)  # 2 workers + Ray's own
    results = []
    with tempfile.TemporaryDirectory(prefix="bench-bpb-") as tmp:
        for kind, vocab in TOKENIZERS:
            name = label(kind, vocab).replace(" ", "-").lower()
            t0 = time.perf_counter()
            m = prepare_dataset("stdlib", Path(tmp) / name, tokenizer=kind, vocab_size=vocab,
                                tokenizer_sample_mb=10, use_ray=True, cpus=2)
            prepare_s = time.perf_counter() - t0
            cfg = build_config(preset="small", flags=dict(
                workers=2, max_steps=args.steps, batch_size=args.batch_size, seq_len=args.seq_len,
                log_every=10, eval_every=args.eval_every, checkpoint_every=0,
                data=str(Path(tmp) / name), storage=str(Path(tmp) / "runs"), name=name),
                sets=[f"eval_windows={args.eval_windows}", "warmup_steps=30"])
            rows: list[dict] = []
            load = os.getloadavg()[0]
            summary = run_training(cfg, say=lambda s: None, on_metrics=rows.append)
            fpt = flops_per_token(cfg.model, cfg.seq_len)
            bytes_per_token = m["train"]["bytes"] / m["train"]["tokens"]
            evals = [r for r in rows if r.get("val_bpb") is not None]
            results.append({
                "tokenizer": label(kind, vocab), "vocab_size": m["vocab_size"],
                "model_vocab": cfg.model.vocab_size, "parameters": summary["num_parameters"],
                "flops_per_token": fpt, "train_bytes_per_token": bytes_per_token,
                "train_tokens_in_dataset": m["train"]["tokens"], "prepare_s": prepare_s,
                "steps": summary["steps"], "tokens_seen": summary["tokens"],
                "text_mb_seen": summary["tokens"] * bytes_per_token / 1e6,
                "final_val_loss": summary["final_val_loss"], "final_val_bpb": summary["final_val_bpb"],
                "final_train_loss": summary["final_train_loss"],
                "tokens_per_second": summary["tokens_per_second"], "wall_s": summary["wall_seconds"],
                "loadavg_1m_at_start": load,
                "val_curve": [(r["step"], r["val_bpb"]) for r in evals],
                # training loss per byte via the split's bytes per token (an approximation: the
                # exact count is taken for validation only)
                "train_curve_bpb": [(r["step"], r["loss"] / bytes_per_token / math.log(2)) for r in rows],
            })
            r = results[-1]
            print(f"{r['tokenizer']:<8} val_bpb {r['final_val_bpb']:.4f}  val_loss {r['final_val_loss']:.4f}  "
                  f"{r['text_mb_seen']:.1f} MB of text  {r['parameters'] / 1e6:.1f}M params  "
                  f"{r['tokens_per_second']:,.0f} tok/s  {r['wall_s']:.0f} s", flush=True)
    ray.shutdown()
    out = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
           "command": " ".join(["python", "bench/tokenizer_bpb.py", *sys.argv[1:]]),
           "settings": vars(args), "runs": results}
    Path(args.out).write_text(json.dumps(out, indent=2) + "\n")
    plot(results, args)


def plot(results: list[dict], args) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.2))
    for r in results:
        line, = ax.plot(*zip(*r["val_curve"]), marker="o", label=f"{r['tokenizer']} (validation)")
        ax.plot(*zip(*r["train_curve_bpb"]), color=line.get_color(), alpha=0.35, linewidth=1)
    ax.set_xlabel("step")
    ax.set_ylabel("bits per byte")
    ax.set_title(f"small preset on the stdlib corpus, 2 CPU workers, "
                 f"{2 * args.batch_size}x{args.seq_len} tokens/step")
    ax.grid(alpha=0.3)
    ax.legend(title="faint: training loss per byte")
    fig.tight_layout()
    Path(args.plot).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(args.plot, dpi=110)


if __name__ == "__main__":
    main()
