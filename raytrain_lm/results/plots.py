"""The report's figure: train/val loss, tokens/s and learning rate against step, one colour per run."""

from __future__ import annotations

import io
from typing import Sequence

import matplotlib

matplotlib.use("Agg")  # files only: no display needed, safe in headless jobs and tests
import matplotlib.pyplot as plt  # noqa: E402

from raytrain_lm.results.figure_file import MARK  # noqa: E402


def png_bytes(fig) -> bytes:
    """Render a finished figure to PNG bytes, marked as report's (figure_file.MARK), and free it."""
    buf = io.BytesIO()
    fig.savefig(buf, format="png", metadata=dict([MARK]))
    plt.close(fig)
    return buf.getvalue()


def _series(rows: list[dict], key: str) -> tuple[list[int], list[float]]:
    pts = [(r["step"], r[key]) for r in rows if r.get(key) is not None]
    return [p[0] for p in pts], [p[1] for p in pts]


def plot_runs(runs: Sequence[tuple[str, list[dict]]], dpi: int = 110) -> bytes:
    """PNG bytes of the curves of `runs`: (name, metrics rows) pairs."""
    noise = any(r.get("noise_scale") is not None for _, rows in runs for r in rows)
    fig, axes = plt.subplots(1, 4 if noise else 3, figsize=(20 if noise else 15, 4.4), dpi=dpi)
    ax_loss, ax_tps, ax_lr = axes[:3]
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    several = len(runs) > 1
    for i, (name, rows) in enumerate(runs):
        c = colors[i % len(colors)]
        tag = f"{name} " if several else ""
        s, v = _series(rows, "loss")
        ax_loss.plot(s, v, color=c, lw=1.6, label=f"{tag}train")
        s, v = _series(rows, "val_loss")
        if s:  # one run: val in its own colour; several: each run's colour, dashed
            ax_loss.plot(s, v, color=c if several else colors[1], lw=1.2, ls="--", marker="o", ms=4,
                         label=f"{tag}val")
        s, v = _series(rows, "tokens_per_second")
        ax_tps.plot(s, v, color=c, lw=1.6, label=name)
        s, v = _series(rows, "lr")
        ax_lr.plot(s, v, color=c, lw=1.6, label=name)
        if noise:
            s, v = _series(rows, "noise_scale")
            axes[3].plot(s, v, color=c, lw=1.6, label=name)
    ax_loss.set(title="loss (nats/token)", xlabel="step")
    ax_tps.set(title="throughput (tokens/s, all workers)", xlabel="step", ylim=(0, None))
    ax_lr.set(title="learning rate", xlabel="step")
    ax_lr.ticklabel_format(axis="y", style="sci", scilimits=(-2, 3))
    ax_loss.legend(fontsize=8)
    if several:
        ax_tps.legend(fontsize=8)
    if noise:  # McCandlish et al.'s B_simple, from the moving averages of |G|^2 and tr(Sigma)
        axes[3].set(title="gradient noise scale B_simple (sequences)", xlabel="step", yscale="log")
    for ax in axes:
        ax.grid(alpha=0.3)
    if not several and runs:
        fig.suptitle(runs[0][0], fontsize=10)
    fig.tight_layout()
    return png_bytes(fig)
