"""The coordinate check of muP (Yang et al., Tensor Programs V, section 5 / `mup.coord_check`):
the size of each layer's activations, and of their change since initialisation, over the first
steps of training, across widths, under sp and under mup. Under mup every curve is flat in the
width (each coordinate stays Theta(1)); under sp the updates of the later layers, the logits'
above all, grow with it (Adam's update of a fan_in-wide matrix moves its output by ~fan_in).

The size is the mean absolute coordinate of a module's output on one fixed batch, after step t;
the update size the mean absolute coordinate of (output after step t - output at step 0). One
process, byte-level GPT on the built-in corpus (the Python docs topics), AdamW with the run's own
optimizer (worker/optim.py: muP's per-parameter groups) at one lr, no warmup, no clipping.

    PYTHONPATH=. nice -n 10 python bench/mup_coord_check.py --out bench/results/mup_coord_check.json
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

LAYERS = ("embed", "block0.attn", "block0.mlp", "block_last", "logits")


def corpus_bytes():
    """The built-in corpus as bytes (a torch uint8 tensor): the Python docs topics."""
    from pydoc_data.topics import topics

    import torch

    text = "\n\n".join(topics[k] for k in sorted(topics)).encode("utf-8")
    return torch.frombuffer(bytearray(text), dtype=torch.uint8).long()


def batch_of(data, batch: int, seq: int, generator):
    """(x, y) windows of `seq` bytes at random places of `data`."""
    import torch

    starts = torch.randint(0, len(data) - seq - 1, (batch,), generator=generator)
    x = torch.stack([data[s:s + seq] for s in starts.tolist()])
    y = torch.stack([data[s + 1:s + seq + 1] for s in starts.tolist()])
    return x, y


def model_config(width: int, param: str, base: int, depth: int = 2, heads: int = 4, seq: int = 64,
                 init_std: float = 0.02):
    from raytrain_lm.models.family import ModelConfig

    return ModelConfig(vocab_size=256, block_size=seq, n_layer=depth, n_head=heads, n_embd=width,
                       dropout=0.0, bias=True, arch="gpt", param=param,
                       mup_base_width=base if param == "mup" else None, init_std=init_std)


def train_config(m, lr: float, steps: int, warmup: int = 0, weight_decay: float = 0.0):
    from raytrain_lm.config.settings import TrainConfig

    return TrainConfig(model=m, lr=lr, max_steps=steps, warmup_steps=warmup,
                       weight_decay=weight_decay, min_lr_ratio=0.1)


def set_lr(optimizer, lr: float) -> None:
    """The schedule's lr times each group's muP multiplier, as worker/step.TrainStep does."""
    for group, mult in zip(optimizer.param_groups, optimizer.lr_mults):
        group["lr"] = lr * mult


def watch(model):
    """Forward hooks keeping the outputs of LAYERS' modules; returns the dict they fill."""
    seen = {}

    def keep(name):
        return lambda _m, _i, out: seen.__setitem__(name, (out[0] if isinstance(out, tuple)
                                                           else out).detach().clone())
    model.drop.register_forward_hook(keep("embed"))
    model.h[0].attn.register_forward_hook(keep("block0.attn"))
    model.h[0].mlp.register_forward_hook(keep("block0.mlp"))
    model.h[-1].register_forward_hook(keep("block_last"))
    model.lm_head.register_forward_hook(keep("logits"))
    return seen


def coord_sizes(width: int, param: str, base: int, steps: int, lr: float, seed: int = 0,
                batch: int = 8, seq: int = 64, depth: int = 2, data=None) -> dict:
    """{layer: {"size": [per step], "update": [per step]}} of one model: step 0 is the
    initialisation, step t after t AdamW steps (each on a fresh batch; sizes on a fixed one)."""
    import torch

    from raytrain_lm.models import build_model
    from raytrain_lm.worker.optim import build_optimizer

    data = corpus_bytes() if data is None else data
    m = model_config(width, param, base, depth=depth, seq=seq)
    model = build_model(m, seed=seed)
    optimizer = build_optimizer(model, train_config(m, lr, steps), torch.device("cpu"))
    set_lr(optimizer, lr)
    seen = watch(model)
    g = torch.Generator().manual_seed(seed)
    probe = batch_of(data, batch, seq, g)
    out = {name: {"size": [], "update": []} for name in LAYERS}
    first = {}
    for t in range(steps + 1):
        with torch.no_grad():
            model(*probe)
        for name in LAYERS:
            x = seen[name]
            first.setdefault(name, x)
            out[name]["size"].append(x.abs().mean().item())
            out[name]["update"].append((x - first[name]).abs().mean().item())
        if t == steps:
            break
        _, loss = model(*batch_of(data, batch, seq, g))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return out


def slope(widths, values) -> float:
    """Least-squares slope of log2(value) against log2(width): 0 flat, 1 proportional."""
    xs = [math.log2(w) for w in widths]
    ys = [math.log2(max(v, 1e-30)) for v in values]
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)


def coord_check(widths, steps: int, lr: float, seeds: int = 1, **kw) -> dict:
    """Per param, layer and step: sizes averaged over `seeds` at each width, and their slopes
    against the width."""
    data = corpus_bytes()
    result = {"widths": list(widths), "steps": steps, "lr": lr, "base": widths[0], "param": {}}
    for param in ("sp", "mup"):
        per_width = []
        for w in widths:
            runs = [coord_sizes(w, param, widths[0], steps, lr, seed=s, data=data, **kw)
                    for s in range(seeds)]
            per_width.append({name: {k: [sum(r[name][k][t] for r in runs) / seeds
                                         for t in range(steps + 1)] for k in ("size", "update")}
                              for name in LAYERS})
        layers = {}
        for name in LAYERS:
            layers[name] = {k: [[pw[name][k][t] for pw in per_width] for t in range(steps + 1)]
                            for k in ("size", "update")}
            layers[name]["slope"] = {k: [slope(widths, layers[name][k][t]) if k == "size" or t
                                         else 0.0 for t in range(steps + 1)]
                                     for k in ("size", "update")}
        result["param"][param] = layers
    return result


def plot(result: dict, path: Path) -> None:
    """One panel per (param, size/update): a line per step, mean |coordinate| against width."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    widths = result["widths"]
    fig, axes = plt.subplots(4, len(LAYERS), figsize=(3.2 * len(LAYERS), 11), sharex=True)
    for row, param in enumerate(("sp", "mup")):
        for i, name in enumerate(LAYERS):
            for j, kind in enumerate(("size", "update")):
                ax = axes[2 * row + j][i]
                for t, values in enumerate(result["param"][param][name][kind]):
                    if kind == "update" and t == 0:
                        continue
                    ax.plot(widths, values, marker="o", ms=3, label=f"step {t}")
                ax.set_xscale("log", base=2)
                ax.set_yscale("log")
                ax.set_title(f"{param}: {name} {kind}", fontsize=9)
                if 2 * row + j == 3:
                    ax.set_xlabel("width")
    axes[0][0].legend(fontsize=7)
    fig.suptitle("coordinate check: mean |x| per layer vs width, a line per step (flat under mup)")
    fig.tight_layout()
    fig.savefig(path, dpi=90)


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--widths", default="64,128,256,512")
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--lr", type=float, default=1e-2)
    p.add_argument("--seeds", type=int, default=2)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out", default=str(ROOT / "bench" / "results" / "mup_coord_check.json"))
    p.add_argument("--plot", default=str(ROOT / "docs" / "img" / "mup_coord_check.png"))
    args = p.parse_args(argv)
    import torch

    torch.set_num_threads(args.threads)
    result = coord_check([int(w) for w in args.widths.split(",")], args.steps, args.lr, args.seeds)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1))
    if args.plot:
        Path(args.plot).parent.mkdir(parents=True, exist_ok=True)
        plot(result, Path(args.plot))
    for param in ("sp", "mup"):
        print(param, {name: (round(result["param"][param][name]["slope"]["size"][-1], 3),
                             round(result["param"][param][name]["slope"]["update"][-1], 3))
                      for name in LAYERS})
    return result


if __name__ == "__main__":
    main()
