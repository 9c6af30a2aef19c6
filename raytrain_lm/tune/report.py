"""What a sweep shows and leaves behind: the live table of trials while it runs (a Tune callback
in the driver), then the ranked results, the best trial's config as a file `train --config`
accepts, and a plot of every trial's validation curve."""

from __future__ import annotations

import json
import math
import time
from typing import Any, Callable, Optional

from ray import tune

from raytrain_lm.errors import last_line
from raytrain_lm.results.tables import text_table
from raytrain_lm.store.files import BEST_CONFIG, SWEEP_RESULTS, TRANSFER_CONFIG, TRIAL_CONFIG, VAL_CURVES
from raytrain_lm.store.storage import RunFolder
from raytrain_lm.tune.transfer import transfer_yaml

# Where the live table goes. Module-level rather than held by the callback, because Tune pickles
# its callbacks into the sweep's state (tuner.pkl) and a resumed sweep gets them back from there.
SINK: dict[str, Any] = {"print": None, "interval": 10.0}

PARAM_LABELS = {"warmup_steps": "warmup", "weight_decay": "wd", "batch_size": "batch",
                "grad_accum": "accum", "model.dropout": "dropout", "model.n_layer": "layers",
                "model.n_embd": "width", "model.n_head": "heads"}


def _fmt(v: Any, key: str = "") -> str:
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "-"
    if key == "lr" or (isinstance(v, float) and v != 0 and abs(v) < 1e-2):
        return f"{v:.2e}"
    if isinstance(v, float):
        return f"{v:.4f}" if key in ("loss", "val_loss") else f"{v:.4g}"
    return str(v)


def status_label(tune_status: str, step: Optional[int], max_steps: int) -> str:
    if tune_status == "PENDING":
        return "queued"
    if tune_status == "RUNNING":
        return "running" if step else "starting"
    if tune_status == "ERROR":
        return "error"
    if tune_status == "TERMINATED":
        return "done" if (step or 0) >= max_steps else "stopped"
    return tune_status.lower()


class LiveTable(tune.Callback):
    """Redraws a table of all trials when a trial changes state, and at most every
    SINK['interval'] seconds while results come in."""

    def __init__(self, max_steps: int, keys: list[str], total: int):
        self.max_steps = max_steps
        self.keys = keys
        self.total = total  # trials the searcher will create; not yet created ones are "waiting"
        self._val: dict[str, float] = {}
        self._last_states: dict[str, str] = {}
        self._last_print = 0.0
        self._new_results = False

    def __getstate__(self):  # pickled into tuner.pkl: keep the settings only
        return {"max_steps": self.max_steps, "keys": self.keys, "total": self.total}

    def __setstate__(self, state):
        self.__init__(state["max_steps"], state["keys"], state["total"])

    def on_trial_result(self, iteration, trials, trial, result, **info):
        if result.get("val_loss") is not None:
            self._val[trial.trial_id] = result["val_loss"]
        self._new_results = True

    def on_step_end(self, iteration, trials, **info):
        if SINK["print"] is None:
            return
        states = {t.trial_id: status_label(t.status, (t.last_result or {}).get("step"), self.max_steps)
                  for t in trials}
        now = time.time()
        if states != self._last_states or (self._new_results and now - self._last_print >= SINK["interval"]):
            self._last_states, self._last_print, self._new_results = states, now, False
            SINK["print"](self.render(trials))

    def render(self, trials) -> str:
        header = ["trial", "status", "step", "loss", "val loss", "lr now", "tok/s"]
        header += [PARAM_LABELS.get(k, k) for k in self.keys]
        rows = []
        for t in trials:
            r = t.last_result or {}
            step = r.get("step")
            row = [t.trial_id, status_label(t.status, step, self.max_steps),
                   f"{step}/{self.max_steps}" if step else "-", _fmt(r.get("loss"), "loss"),
                   _fmt(self._val.get(t.trial_id), "val_loss"), _fmt(r.get("lr"), "lr"),
                   f"{r['tokens_per_second'] / 1e3:.1f}k" if r.get("tokens_per_second") else "-"]
            row += [_fmt(t.config.get(k), k) for k in self.keys]
            rows.append(row)
        counts: dict[str, int] = {}
        for row in rows:
            counts[row[1]] = counts.get(row[1], 0) + 1
        if self.total > len(rows):  # not created yet by the searcher: queued as well
            counts["queued"] = counts.get("queued", 0) + self.total - len(rows)
        head = (f"[{time.strftime('%H:%M:%S')}] {self.total} trials: "
                + ", ".join(f"{n} {s}" for s, n in counts.items()))
        return head + "\n" + text_table(header, rows)


# ---------------------------------------------------------------- after the sweep


def collect_trials(grid, max_steps: int, keys: list[str], metric: str = "val_loss") -> list[dict]:
    """One dict per trial from Tune's ResultGrid, ranked by the final value of `metric`
    (val_loss or val_bpb); `val_curve` is that metric's curve."""
    trials = []
    for res in grid:
        m = res.metrics or {}
        df = res.metrics_dataframe
        curves: dict[str, list[tuple[int, float]]] = {"val_loss": [], "val_bpb": []}
        losses: list[float] = []
        if df is not None and "step" in df:
            for key in curves:
                if key in df:
                    evals = df[df[key].notna()]
                    curves[key] = [(int(s), float(v)) for s, v in zip(evals["step"], evals[key])]
            losses = [float(v) for v in df["loss"].dropna()] if "loss" in df else []
        curve = curves[metric]
        steps = int(df["step"].max()) if df is not None and "step" in df and len(df) else 0
        status = "error" if res.error else "done" if steps >= max_steps else "stopped"
        trials.append({
            "trial": m.get("trial_id") or res.path.rstrip("/").rsplit("/", 1)[-1],
            "dir": res.path.rstrip("/").rsplit("/", 1)[-1],
            "status": status,
            "steps": steps,
            "metric": metric,
            **{f"final_{k}": c[-1][1] if c else None for k, c in curves.items()},
            **{f"best_{k}": min(v for _, v in c) if c else None for k, c in curves.items()},
            "final_train_loss": losses[-1] if losses else None,
            "params": {k: res.config.get(k) for k in keys},
            "val_curve": curve,
            "wall_seconds": m.get("time_total_s"),
            "error": last_line(res.error) if res.error else None,
        })
    final = f"final_{metric}"
    trials.sort(key=lambda t: (t["status"] == "error", t[final] is None,
                               t[final] if t[final] is not None else 0.0))
    for i, t in enumerate(trials, 1):
        t["rank"] = i
    return trials


def ranked_table(trials: list[dict], keys: list[str], max_steps: int) -> str:
    header = ["rank", "trial", "status", "steps", "val loss", "val bpb", "train loss"]
    header += [PARAM_LABELS.get(k, k) for k in keys] + ["time"]
    rows = []
    for t in trials:
        wall = t.get("wall_seconds")
        rows.append([str(t["rank"]), t["trial"], t["status"], f"{t['steps']}/{max_steps}",
                     _fmt(t["final_val_loss"], "val_loss"), _fmt(t.get("final_val_bpb"), "val_loss"),
                     _fmt(t["final_train_loss"], "loss")]
                    + [_fmt(t["params"].get(k), k) for k in keys]
                    + [f"{wall:.0f}s" if wall is not None else "-"])
    return text_table(header, rows)


def best_config_yaml(trial_cfg: dict, trial: dict, sweep: str) -> str:
    """The best trial's full config, minus where it ran: `train --config` gives the same settings."""
    import yaml

    cfg = {k: v for k, v in trial_cfg.items() if k not in ("name", "storage", "address")}
    metric = trial.get("metric", "val_loss")
    head = (f"# best trial of sweep {sweep}: {trial['trial']}, {metric} {trial['final_' + metric]:.4f} "
            f"after {trial['steps']} steps\n"
            f"# tuned: {json.dumps(trial['params'])}\n"
            f"# use: python cli.py train --config best.yaml  (add --scale-lr sqrt if --workers changes)\n")
    return head + yaml.safe_dump(cfg, sort_keys=False)


def plot_curves(trials: list[dict], keys: list[str], title: str, metric: str = "val_loss") -> bytes:
    from raytrain_lm.results.plots import plt, png_bytes

    fig, ax = plt.subplots(figsize=(8, 5), dpi=110)
    # A diverged trial would squash every other curve into a line: the axis stops at 1.5x the best
    # trial's first validation loss, and points above it sit on the top edge as triangles.
    firsts = [t["val_curve"][0][1] for t in trials if t["val_curve"]]  # trials come ranked
    top = min(max(firsts), 1.5 * firsts[0]) if firsts else 1.0
    low = min((v for t in trials for _, v in t["val_curve"]), default=0.0)
    for t in trials:
        if not t["val_curve"]:
            continue
        steps, vals = zip(*t["val_curve"])
        label = f"{t['trial']} " + " ".join(f"{PARAM_LABELS.get(k, k)}={_fmt(t['params'].get(k), k)}"
                                            for k in keys)
        style = dict(lw=2.5) if t["rank"] == 1 else dict(lw=1.2, ls="--" if t["status"] == "stopped" else "-")
        line, = ax.plot(steps, [min(v, top) for v in vals], marker="o", ms=3,
                        label=f"{label} ({t['status']})", **style)
        over = [(s, v) for s, v in zip(steps, vals) if v > top]
        for s, v in over:
            ax.plot([s], [top], marker="^", ms=8, color=line.get_color(), clip_on=False)
            ax.annotate(f"{v:.3g}", (s, top), textcoords="offset points", xytext=(6, -10), fontsize=7,
                        color=line.get_color())
    pad = 0.05 * (top - low + 1e-9)
    ax.set_ylim(low - pad, top + pad)
    ax.set_xlabel("step")
    ax.set_ylabel("validation bits per byte" if metric == "val_bpb" else "validation loss (nats/token)")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    return png_bytes(fig)


def write_outputs(folder: RunFolder, cfg, space, settings, trials: list[dict], wall: float) -> dict:
    keys = space.keys
    metric = settings.metric
    best = trials[0] if trials and trials[0][f"final_{metric}"] is not None else None
    summary: dict[str, Any] = {
        "name": cfg.name, "dir": folder.display_path(), "search": settings.search,
        "grace_steps": settings.grace_steps, "reduction_factor": settings.reduction_factor,
        "metric": metric,
        "max_steps": cfg.max_steps, "workers_per_trial": cfg.workers, "wall_seconds": wall,
        "space": {d.key: d.describe() for d in space.dims}, "trials": trials,
        "best": best, "best_config": None, "plot": None,
    }
    if best is not None:
        trial_cfg = RunFolder(folder.storage_uri, f"{cfg.name}/{best['dir']}").read_json(TRIAL_CONFIG)
        folder.write_text(BEST_CONFIG, best_config_yaml(trial_cfg, best, cfg.name))
        summary["best_config"] = folder.display_path(BEST_CONFIG)
        if getattr(settings, "target_width", None):  # muTransfer (tune/transfer.py)
            folder.write_text(TRANSFER_CONFIG, transfer_yaml(trial_cfg, settings.target_width,
                                                             cfg.name, best["trial"]))
            summary["transfer_config"] = folder.display_path(TRANSFER_CONFIG)
    if any(t["val_curve"] for t in trials):
        what = "validation bits per byte" if metric == "val_bpb" else "validation loss"
        folder.write_bytes(VAL_CURVES, plot_curves(trials, keys, f"sweep {cfg.name}: {what}", metric))
        summary["plot"] = folder.display_path(VAL_CURVES)
    folder.write_json(SWEEP_RESULTS, summary)
    summary["table"] = ranked_table(trials, keys, cfg.max_steps)
    return summary


def watch(printer: Optional[Callable[[str], None]], interval: float) -> None:
    SINK["print"], SINK["interval"] = printer, interval
