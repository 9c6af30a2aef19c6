"""`evaluate`: a model scored by lm-evaluation-harness (its `hf` model, on the folder `export
--format hf` writes; made on the fly in a temporary folder for a run or a checkpoint), and the
scores kept where the run's other results are: `eval/<task>.json` in the run's folder, the
`eval` entry of its summary.json (the results table shows it) and its tracking runs
(tracking.json: the same MLflow / W&B runs `train --track` made).

The harness's own tasks (hellaswag, arc_easy, ...) download their data from the Hugging Face Hub;
a task of one's own (a YAML file beside a JSONL, `--include-path`) needs nothing from outside. A
task folder is code, as lm-eval designs it: its YAML runs Python (`!function`) and its Jinja
templates are not sandboxed, so `--include-path` is a script one runs (docs/security.md). A
Hugging Face folder is not: it is read with the checks of `--init-from`
(store/hf_folder.check_folder) before lm-eval loads it, and with transformers' remote code off.
lm-eval is an optional extra (`pip install 'raytrain-lm[eval]'`), imported only here.
"""

from __future__ import annotations

import json
import math
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional

from raytrain_lm import env
from raytrain_lm.errors import UserError
from raytrain_lm.store import files
from raytrain_lm.store.hf_folder import HF_CONFIG, check_folder, is_hf_folder
from raytrain_lm.store.runs import find_checkpoint, is_run, open_run
from raytrain_lm.store.storage import RunFolder
from raytrain_lm.track.tracking import installed

EXTRA = "pip install 'raytrain-lm[eval]'"
PICKLED_WEIGHTS = "pytorch_model.bin"
# What a dataset puts between documents where its tokenizer has no end-of-text token (as text:
# data/prepare.py), so what a model of such a tokenizer saw before every document.
TEXT_SEPARATOR = "\n\n"


@dataclass
class Evaluated:
    """What `evaluate` found and scored."""
    model: str  # what was evaluated, for messages
    step: Optional[int]  # the checkpoint's step (None for a Hugging Face folder)
    run: Optional[RunFolder]  # the run it belongs to, where the results go
    scores: dict[str, dict[str, float]] = field(default_factory=dict)  # task -> metric -> value
    written: list[str] = field(default_factory=list)


def run_of_checkpoint(path: Path) -> Optional[RunFolder]:
    """The run a local checkpoint folder belongs to (its parent folder, if that is a run)."""
    import pyarrow.fs as pafs

    parent = path.resolve().parent
    if is_run(pafs.LocalFileSystem(), str(parent)):
        return RunFolder(str(parent.parent), parent.name)
    return None


def check_tasks(tasks: str, include_path: Optional[str]) -> list[str]:
    """--tasks as a list, the extra installed and --include-path a folder; before any export."""
    if not installed("lm_eval"):
        raise UserError(f"evaluate needs lm-evaluation-harness, which is not installed: {EXTRA}")
    names = [t.strip() for t in tasks.split(",") if t.strip()]
    if not names:
        raise UserError("--tasks needs at least one task name, e.g. --tasks hellaswag,arc_easy")
    if include_path is not None and not Path(include_path).is_dir():
        raise UserError(f"--include-path {include_path}: not a folder of task YAML files")
    return names


def evaluate(model: str, tasks: list[str], *, storage: str, best: bool = False,
             include_path: Optional[str] = None, limit: Optional[float] = None,
             batch_size: int = 8, num_fewshot: Optional[int] = None, device: str = "cpu",
             say: Callable[[str], None] = print) -> Evaluated:
    """Score `model` (a run, a checkpoint, or a Hugging Face folder) on `tasks`; write the results
    next to its run (if it has one)."""
    path = Path(model).expanduser()
    with tempfile.TemporaryDirectory(prefix="raytrain-lm-eval-") as tmp:
        if is_hf_folder(path):
            if best:
                raise UserError("--best chooses among a run's checkpoints; give the run, not a folder")
            check_folder(path, f"evaluate {path}")  # what --init-from checks, before lm-eval reads it
            done, folder = Evaluated(model, None, None), path
        elif (path / HF_CONFIG).is_file() and (path / PICKLED_WEIGHTS).is_file():
            raise UserError(f"{path} holds {PICKLED_WEIGHTS} (pickled weights, which can run code "
                            f"when loaded): evaluate reads safetensors folders")
        else:
            found = find_checkpoint(model, storage, best=best)
            from raytrain_lm.results.hf_export import export_checkpoint_hf  # torch, once there is a model

            try:
                run = run_of_checkpoint(path) if (path / files.META).is_file() else open_run(model, storage)
                folder = Path(tmp, "hf")
                # fp32: the checkpoint's weights as trained (export's default, bf16, rounds them)
                export_checkpoint_hf(found.path, folder, meta=found.meta, dtype="fp32")
            finally:
                found.cleanup()
            done = Evaluated(found.source, found.step, run)
        say(f"evaluating {done.model}{f' (step {done.step})' if done.step is not None else ''} "
            f"on {', '.join(tasks)}")
        results = harness(folder, tasks, include_path, limit, batch_size, num_fewshot, device)
    for task in tasks:
        metrics = results["results"].get(task)
        if metrics is None:
            raise UserError(f"lm-eval returned no results for task {task!r}")
        done.scores[task] = scores(metrics)
    if done.run is not None:
        keep(done, results)
    return done


def harness(folder: Path, tasks: list[str], include_path: Optional[str], limit: Optional[float],
            batch_size: int, num_fewshot: Optional[int], device: str) -> dict:
    """lm-eval's simple_evaluate with its `hf` model on `folder`, in this process."""
    env.set_default("TOKENIZERS_PARALLELISM", "false")  # this process forks no tokenizer
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    manager = TaskManager(include_path=include_path) if include_path else TaskManager()
    unknown = [t for t in tasks if t not in manager.all_tasks]
    if unknown:
        raise UserError(f"unknown lm-eval task{'s' if len(unknown) > 1 else ''}: {', '.join(unknown)} "
                        f"(`lm-eval ls tasks` lists them; a task of your own: --include-path)")
    args = {"pretrained": str(folder), "dtype": "float32", "device": device, "trust_remote_code": False}
    prefix = prefix_token(folder)
    if prefix is not None:
        args["prefix_token_id"] = prefix
    return simple_evaluate(model="hf", model_args=args,
                           tasks=tasks, task_manager=manager, limit=limit, batch_size=batch_size,
                           num_fewshot=num_fewshot, log_samples=False)


def prefix_token(folder: Path) -> Optional[int]:
    """The token lm-eval puts before a text scored from its start (a rolling loglikelihood, an
    empty context): None where the folder's tokenizer has a bos or eos (lm-eval takes it). A
    tokenizer with neither (the byte tokenizer) leaves lm-eval nothing to put there (it fails
    decoding None); its datasets join documents with TEXT_SEPARATOR as text, so the token before
    every document its model saw is that separator's last token."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(folder))
    if tok.bos_token_id is not None or tok.eos_token_id is not None:
        return None
    return tok.encode(TEXT_SEPARATOR, add_special_tokens=False)[-1]


def scores(metrics: dict[str, Any]) -> dict[str, float]:
    """lm-eval's `"acc,none": 0.5` -> `"acc": 0.5` (filter "none" dropped, other filters kept as
    `metric/filter`); numbers only."""
    out = {}
    for key, value in metrics.items():
        name, _, filt = key.partition(",")
        if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
            out[name if filt in ("", "none") else f"{name}/{filt}"] = float(value)
    return out


def keep(done: Evaluated, results: dict) -> None:
    """eval/<task>.json, summary.json's `eval`, and the run's tracking runs."""
    run = done.run
    kept: dict[str, bytes] = {}
    for task, metrics in done.scores.items():
        record = {"task": task, "step": done.step, "model": done.model, "scores": metrics,
                  "n_samples": results.get("n-samples", {}).get(task),
                  "version": results.get("versions", {}).get(task),
                  "config": results.get("configs", {}).get(task)}
        name = f"{files.EVAL_DIR}/{task}.json"
        kept[name] = (json.dumps(record, indent=2, default=str) + "\n").encode()
        run.write_bytes(name, kept[name])
        done.written.append(run.display_path(name))
    if run.exists(files.SUMMARY):
        summary = run.read_json(files.SUMMARY)
        if isinstance(summary, dict):
            summary["eval"] = {**(summary.get("eval") or {}),
                               **{t: {"step": done.step, **m} for t, m in done.scores.items()}}
            run.write_json(files.SUMMARY, summary)
            track(run, done, kept, summary.get("status"))


def track(run: RunFolder, done: Evaluated, kept: dict[str, bytes], status: Optional[str]) -> None:
    """The scores into the run's tracking runs (if `train --track` made any)."""
    from raytrain_lm.track import Tracking, check_trackers

    records = run.read_json(files.TRACKING) if run.exists(files.TRACKING) else {}
    if not isinstance(records, dict) or not records:
        return
    tracking = Tracking(check_trackers(list(records)), run.name, {}, records=records)
    tracking.log_summary({f"eval/{t}/{k}": v for t, m in done.scores.items() for k, v in m.items()}, kept)
    tracking.close(status if status in ("completed", "failed") else "killed")
