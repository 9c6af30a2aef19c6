"""Text the user reads: progress lines while training, the results table at the end, and the
`report` command (tables and a PNG of the curves of one or several runs)."""

from __future__ import annotations

from typing import Any, Optional

from raytrain_lm.errors import UserError
from raytrain_lm.store import files
from raytrain_lm.store.row import MetricsRow


def _fmt_seconds(s: Optional[float]) -> str:
    if s is None:
        return "-"
    s = int(round(s))
    if s >= 3600:
        return f"{s // 3600}h{s % 3600 // 60:02d}m"
    return f"{s // 60}m{s % 60:02d}s" if s >= 60 else f"{s}s"


def _fmt_rate(x: Optional[float]) -> str:
    if x is None:
        return "-"
    return f"{x / 1e6:.2f}M" if x >= 1e6 else f"{x / 1e3:.1f}k" if x >= 1e3 else f"{x:.0f}"


def progress_line(row: MetricsRow, max_steps: int) -> str:
    step = row["step"]
    eta = (max_steps - step) * row["step_time"]
    parts = [
        f"step {step:>{len(str(max_steps))}}/{max_steps}",
        # the group's size (elastic runs resize)
        f"{row['workers']} worker{'s' if row['workers'] != 1 else ''}" if row.get("workers") else None,
        f"loss {row['loss']:.4f}",
        f"val {row['val_loss']:.4f}" if row.get("val_loss") is not None else None,
        f"{row['val_bpb']:.3f} bpb" if row.get("val_bpb") is not None else None,
        f"lr {row['lr']:.2e}",
        # the gradient noise scale B_simple, in sequences (plan/noise_scale.py)
        f"B_noise {row['noise_scale']:.3g}" if row.get("noise_scale") is not None else None,
        # a mixture of experts: its most imbalanced layer (max / mean tokens per expert)
        f"load {max(row['expert_load']):.2f}" if row.get("expert_load") else None,
        f"{_fmt_rate(row['tokens_per_second'])} tok/s",
        f"mfu {row['mfu'] * 100:.1f}%" if row.get("mfu") is not None else None,
        f"data-wait {row['data_wait_frac'] * 100:.1f}%",
        f"mem {row['peak_mem_gb']:.2f} GB" + (f" ({row['peak_mem_reserved_gb']:.2f} reserved)"
                                              if row.get("peak_mem_reserved_gb") is not None else ""),
        f"ETA {_fmt_seconds(eta)}",
        "ckpt" if row.get("checkpoint") else None,
    ]
    return " | ".join(p for p in parts if p)


def _fmt_value(key: str, v: Any) -> str:
    if v is None:
        return "-"
    if key == "resizes":
        return "; ".join(f"{r['from']} -> {r['to']} at step {r['step']} ({r['why']})" for r in v) or "none"
    if key in ("mfu", "data_wait_frac"):
        return f"{v * 100:.2f}%"
    if key in ("wall_seconds", "time_to_first_step"):
        return f"{v:.1f} s"
    if key == "tokens_per_second":
        return f"{v:,.0f}"
    if key in ("peak_mem_gb", "peak_mem_reserved_gb"):
        return f"{v:.2f} GB"
    if isinstance(v, float):
        return f"{v:.4f}"
    if isinstance(v, int) and not isinstance(v, bool):
        return f"{v:,}"
    return str(v)


TABLE_KEYS = [
    ("name", "run"), ("status", "status"), ("preset", "preset"), ("num_parameters", "parameters"),
    ("workers", "workers"), ("use_gpu", "gpu"), ("steps", "steps"), ("tokens", "tokens"),
    ("final_train_loss", "train loss"), ("final_val_loss", "val loss"),
    ("val_perplexity", "val perplexity"), ("final_val_bpb", "val bits/byte"),
    ("tokens_per_second", "tokens/s (median)"),
    ("mfu", "MFU"), ("data_wait_frac", "data wait"), ("peak_mem_gb", "peak memory / worker"),
    ("time_to_first_step", "time to first step"), ("wall_seconds", "wall time"),
    ("restarts", "restarts"), ("resizes", "resizes"), ("resumed_from_step", "resumed from step"),
    ("checkpoint", "checkpoint"),
]


def results_table(summary: dict[str, Any]) -> str:
    rows = [(label, _fmt_value(key, summary.get(key))) for key, label in TABLE_KEYS]
    rows += eval_rows(summary.get("eval") or {})
    width = max(len(label) for label, _ in rows)
    return "\n".join(f"  {label:<{width}}  {value}" for label, value in rows)


def eval_rows(evals: dict[str, dict]) -> list[tuple[str, str]]:
    """`evaluate`'s scores (summary.json's `eval`): one row per task and metric, with its
    standard error where lm-eval gave one, and the step evaluated."""
    rows = []
    for task, metrics in sorted(evals.items()):
        for name, value in metrics.items():
            if name == "step" or name.endswith("_stderr") or not isinstance(value, (int, float)):
                continue
            err = metrics.get(f"{name}_stderr")
            text = f"{value:.4f}" + (f" ± {err:.4f}" if isinstance(err, (int, float)) else "")
            step = metrics.get("step")
            rows.append((f"{task} {name}", text + (f" (step {step})" if step is not None else "")))
    return rows


def compare_table(summaries: list[dict[str, Any]]) -> str:
    """The results table with one column per run (`report RUN --compare RUN2 ...`)."""
    keys = [(k, label) for k, label in TABLE_KEYS if k not in ("name", "checkpoint")]
    header = [("run", [str(s.get("name", "-")) for s in summaries])]
    rows = header + [(label, [_fmt_value(k, s.get(k)) for s in summaries]) for k, label in keys]
    rows = [r for r in rows if any(v != "-" for v in r[1])]
    lw = max(len(label) for label, _ in rows)
    widths = [max(len(vals[i]) for _, vals in rows) for i in range(len(summaries))]
    return "\n".join(f"  {label:<{lw}}  " + "  ".join(f"{v:<{w}}" for v, w in zip(vals, widths)).rstrip()
                     for label, vals in rows)


def _local_time(iso: Optional[str]) -> str:
    import datetime as dt

    if not iso:
        return "-"
    try:
        return dt.datetime.fromisoformat(iso).astimezone().strftime("%Y-%m-%d %H:%M")
    except ValueError:
        return iso


STATUS_COLORS = {"completed": "green", "failed": "red", "unfinished": "yellow", "damaged": "red"}


def text_table(header, rows, paint_cell=None) -> str:
    """Columns padded to their widest cell, two spaces apart, under a header line.
    `paint_cell(column, padded, raw)` may colour a cell (after padding: colour codes take no
    width)."""
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(header)]
    lines = ["  ".join(h.ljust(w) for h, w in zip(header, widths)).rstrip()]
    for row in rows:
        cells = [c.ljust(w) for c, w in zip(row, widths)]
        if paint_cell:
            cells = [paint_cell(i, cell, raw) for i, (cell, raw) in enumerate(zip(cells, row))]
        lines.append("  ".join(cells).rstrip())
    return "\n".join(lines)


def runs_table(runs: list[dict[str, Any]], paint=lambda text, color: text) -> str:
    """`runs`: one line per run. `paint(text, color)` colours the status (or leaves it plain)."""
    header = ("run", "status", "steps", "val loss", "val bpb", "tokens/s", "ckpts", "date")
    table = [(r["name"], r.get("status", "-"),
              f"{r.get('steps', 0)}/{r['max_steps']}" if r.get("max_steps") else str(r.get("steps", 0)),
              f"{r['final_val_loss']:.4f}" if r.get("final_val_loss") is not None else "-",
              f"{r['final_val_bpb']:.4f}" if r.get("final_val_bpb") is not None else "-",
              f"{r['tokens_per_second']:,.0f}" if r.get("tokens_per_second") else "-",
              str(r.get("checkpoints", 0)), _local_time(r.get("finished"))) for r in runs]
    return text_table(header, table, lambda i, cell, raw:
                      paint(cell, STATUS_COLORS.get(raw, "bold")) if i == 1 else cell)


def build_report(refs: list[str], storage: str, out: Optional[str] = None,
                 force: bool = False) -> dict[str, Any]:
    """Summaries of the runs `refs` and a PNG of their curves, written into the first run's folder
    (report.png, or compare.png for several runs) unless `out` is given (figure_file.py: a new
    file, or with `force` a figure of report's). Returns {"runs": [summary, ...], "plot": where
    the PNG went}."""
    from raytrain_lm.results import figure_file
    from raytrain_lm.store.runs import open_run, summary_of
    from raytrain_lm.store.storage import is_remote, path_error

    if out and is_remote(out):  # as a Path it would be a local ./s3:/... file
        raise UserError(f"--out is a local file, not {out}; leave it out to write the PNG into "
                        f"the run's folder (wherever that is)")
    if out:
        figure_file.check_out(out, force)
    runs = [open_run(r, storage) for r in refs]
    curves = [(run.name, run.read_jsonl(files.METRICS)) for run in runs]
    empty = [name for name, rows in curves if not rows]
    if empty:
        raise UserError(f"run {empty[0]!r} has no metrics yet (it never logged a step)")
    from raytrain_lm.results.plots import plot_runs  # matplotlib: ~1 s, not for a refusal

    png = plot_runs(curves)
    if out:
        try:
            figure_file.write(out, png)
        except OSError as e:
            raise path_error(out, e) from None
        where = out
    else:
        rel = "report.png" if len(runs) == 1 else "compare.png"
        runs[0].write_bytes(rel, png)
        where = runs[0].display_path(rel)
    summaries = []
    for run in runs:
        s = summary_of(run)
        s.pop("config", None)
        summaries.append({**s, "run_dir": run.display_path()})
    return {"runs": summaries, "plot": where}
