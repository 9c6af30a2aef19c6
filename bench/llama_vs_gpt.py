"""Training throughput of the GPT and the Llama at equal parameters: tokens per second of the step
a worker runs (forward, backward, global-norm clip, AdamW) for the `tiny` preset (GPT) and
`llama-tiny` with its SwiGLU hidden size chosen so that both have the same parameter count
(within a fraction of a percent), byte vocabulary, fp32 on the CPU.

One process, no Ray (Ray adds orchestration, not compute), torch on --threads threads (1: a
worker with one CPU). The two models alternate in blocks of --steps steps, --reps times, so
both see the same machine noise; the figure is each model's median block and the ratio of the
medians, with the spread of the blocks.

    PYTHONPATH=. python bench/llama_vs_gpt.py --out bench/results/llama_vs_gpt.json
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def matched_llama(gpt_params: int, vocab: int):
    """llama-tiny's ModelConfig with the ffn_dim that brings its parameter count closest to
    `gpt_params`."""
    from raytrain_lm.config.presets import preset_config
    from raytrain_lm.models import family

    m = preset_config("llama-tiny").model
    m.vocab_size = vocab

    def count(f):
        m.ffn_dim = f
        return family(m).counts(m).total

    m.ffn_dim = min(range(1, 8 * m.n_embd), key=lambda f: abs(count(f) - gpt_params))
    return m


def build(m, seed: int):
    import torch

    from raytrain_lm.config.presets import preset_config
    from raytrain_lm.models import build_model
    from raytrain_lm.worker.optim import build_optimizer

    torch.manual_seed(seed)
    model = build_model(m, seed=seed)
    return model, build_optimizer(model, preset_config("tiny"), torch.device("cpu"))


def block(model, optimizer, batches, steps: int) -> float:
    """Seconds for `steps` training steps."""
    import torch

    t0 = time.perf_counter()
    for i in range(steps):
        x, y = batches[i % len(batches)]
        _, loss = model(x, y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return time.perf_counter() - t0


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=10, help="Steps per timed block.")
    p.add_argument("--reps", type=int, default=7, help="Blocks per model (alternating).")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--batch-size", type=int, default=None, help="Sequences per step (default: the "
                                                                  "tiny preset's).")
    p.add_argument("--out", default=str(ROOT / "bench" / "results" / "llama_vs_gpt.json"))
    args = p.parse_args(argv)

    import torch

    from raytrain_lm.config.presets import preset_config

    torch.set_num_threads(args.threads)
    tiny = preset_config("tiny")
    gpt_cfg = tiny.model
    gpt_cfg.vocab_size = 256
    models = {"gpt tiny": build(gpt_cfg, 0)}
    llama_cfg = matched_llama(models["gpt tiny"][0].num_params(), 256)
    models["llama tiny"] = build(llama_cfg, 0)
    B, T = args.batch_size or tiny.batch_size, tiny.seq_len
    g = torch.Generator().manual_seed(0)
    batches = [(lambda w: (w[:, :-1], w[:, 1:]))(torch.randint(0, 256, (B, T + 1), generator=g))
               for _ in range(4)]
    for model, opt in models.values():  # warm up: allocator, kernels, AdamW state
        block(model, opt, batches, 2)
    seconds = {name: [] for name in models}
    for _ in range(args.reps):
        for name, (model, opt) in models.items():
            seconds[name].append(block(model, opt, batches, args.steps))
    tokens = args.steps * B * T
    rows = {}
    for name, times in seconds.items():
        tps = sorted(tokens / s for s in times)
        model = models[name][0]
        rows[name] = {"parameters": model.num_params(), "tokens_per_s_median": statistics.median(tps),
                      "tokens_per_s_min": tps[0], "tokens_per_s_max": tps[-1],
                      "block_seconds": times, "model": vars(model.cfg)}
    ratio = rows["llama tiny"]["tokens_per_s_median"] / rows["gpt tiny"]["tokens_per_s_median"]
    result = {"what": __doc__.splitlines()[0], "settings": vars(args), "batch": [B, T],
              "machine": f"{platform.node()}, {platform.processor() or platform.machine()}, torch "
                         f"{torch.__version__}", "date": time.strftime("%Y-%m-%d %H:%M"),
              "rows": rows, "llama_over_gpt": ratio}
    print(f"{'model':<12}{'parameters':>12}{'tokens/s (median)':>20}{'min':>9}{'max':>9}")
    for name, r in rows.items():
        print(f"{name:<12}{r['parameters']:>12,}{r['tokens_per_s_median']:>20,.0f}"
              f"{r['tokens_per_s_min']:>9,.0f}{r['tokens_per_s_max']:>9,.0f}")
    print(f"llama / gpt: {ratio:.3f} (SwiGLU hidden {llama_cfg.ffn_dim}, 2 kv heads)")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
