"""How fast does `prepare` tokenize with a BPE on Ray, against the same tokenizer in one process,
side by side in one run, the order rotated each repetition. Three sides (`--sides`; the first
two by default):

  one_process  `prepare --no-ray`: read, tokenize and write in one process
  ray_tasks    `prepare --ray` as it is: plain Ray tasks of one CPU, one ~1 MiB unit each
  ray_data     the same units as Ray Data tasks (how `prepare` ran until 2026-12-01, kept here
               as the alternative it was measured against)
  ray_actor    the units as calls to one threaded actor per run (N CPUs, N calls at once in its
               threads, one tokenizer shared by them): the alternative to one process per CPU
               (measured 2026-12-02, not adopted)
  threads      `prepare --no-ray --cpus N`: one process, N tokenizing threads (what `prepare`
               does without Ray since 2026-12-01; the one_process side is its --cpus 1)

The tokenizer is trained once (an 8k BPE on a 10 MB sample of the corpus) and every side is
given its tokenizer.json (`--tokenizer PATH`), so only what differs is timed: planning, reading,
tokenizing, writing the shards and the manifest. The Ray sides run on a local Ray of 2 CPUs
started once before the repetitions (its start-up, ~5 s, is timed separately and reported).
All sides must write byte-identical shards (checked).

Ray runs its worker processes at nice 15 (RAY_worker_niceness). On a machine shared with other
work at nice 0 that alone decides who gets the cores, so the one-process side runs in a child
process at nice 15 as well: both sides tokenize at the same priority. It starts its own local
Ray, so run it alone:

    flock /tmp/ray.lock python bench/prepare.py --corpus stdlib --reps 3

Prints a table and writes JSON to --out.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


RAY_WORKER_NICENESS = 15  # Ray's default for its worker processes
SIDES = ["one_process", "ray_tasks", "ray_data", "ray_actor", "threads"]


def one_process_run(corpus: str, tokenizer: str, out: Path, side: str, cpus: int) -> dict:
    """one_run of the one_process side (one thread) or the threads side (`cpus` threads) in a
    child process at Ray's worker niceness."""
    import subprocess

    res = subprocess.run([sys.executable, __file__, "--cpus", str(cpus), "--one-process-run", corpus,
                          tokenizer, str(out), side],
                         capture_output=True, text=True, check=True)
    return json.loads(res.stdout)


def _tokenize_batch(batch: dict, raw_ref: list) -> dict:
    """A Ray Data task: the units of `batch` (one) -> their tokens, as bytes; each unit as the
    plain task `prepare` submits does it."""
    from raytrain_lm.data.tokenize import _tokenize_task

    tokens, _, opens = zip(*(_tokenize_task(unit, raw_ref) for unit in batch["unit"]))
    return {"tokens": np.array(tokens, dtype=object), "opens": np.array(opens, dtype=bool)}


def tokenize_on_ray_data(units, tok, cpus=None):
    """The `ray_data` side: what `prepare` did on Ray Data until 2026-12-01 (the same units, one
    per Ray Data task, results in order), measured against the plain tasks it uses now."""
    import logging

    import ray
    import ray.data

    from raytrain_lm.data.tokenize import tasks_at_once

    ctx = ray.data.DataContext.get_current()
    ctx.execution_options.preserve_order = True
    ctx.enable_progress_bars = False
    ctx.print_on_execution_start = False
    ctx.op_resource_reservation_enabled = False  # with it on, one of 2 CPUs sat idle
    logging.getLogger("ray.data").setLevel(logging.ERROR)
    tasks = tasks_at_once(cpus, len(units))
    raw_ref = [ray.put((tok.raw, tok.doc_begin, tok.doc_end))]
    ds = ray.data.from_items([{"unit": u.to_json()} for u in units], override_num_blocks=len(units))
    ds = ds.map_batches(_tokenize_batch, fn_kwargs={"raw_ref": raw_ref}, batch_size=1, num_cpus=1,
                        compute=ray.data.TaskPoolStrategy(size=tasks))
    for batch in ds.iter_batches(batch_size=None, batch_format="numpy"):
        for data, opens in zip(batch["tokens"], batch["opens"]):
            yield np.frombuffer(data, dtype=tok.dtype), None, bool(opens)


class _ThreadedTokenizer:
    """The `ray_actor` side's actor: calls run in its threads (max_concurrency), a BPE's encode
    releases the GIL, and the tokenizer is built once for them all."""

    def __init__(self):
        import threading

        self._lock = threading.Lock()  # the first calls arrive together: build the tokenizer once

    def tokenize(self, unit_json: str, raw_ref: list) -> tuple[bytes, bool]:
        from raytrain_lm.data.sources import Unit
        from raytrain_lm.data.tokenize import task_tokenizer, tokenize_unit

        with self._lock:
            tok = task_tokenizer(raw_ref)
        ids, _, opens = tokenize_unit(Unit.from_json(unit_json), tok)
        return ids.tobytes(), opens


def tokenize_on_ray_actor(units, tok, cpus=None):
    """The `ray_actor` side: the same units and order as `prepare --ray`, as calls to one actor of
    `cpus` CPUs that runs `cpus` of them at once in threads of one process."""
    import ray

    from raytrain_lm.data.tokenize import results_in_order, tasks_at_once

    threads = tasks_at_once(cpus, len(units))
    raw_ref = [ray.put((tok.raw, tok.doc_begin, tok.doc_end))]
    actor = ray.remote(num_cpus=threads, max_concurrency=threads)(_ThreadedTokenizer).remote()
    try:
        for data, opens in results_in_order(lambda i: actor.tokenize.remote(units[i].to_json(), raw_ref),
                                            len(units), threads):
            yield np.frombuffer(data, dtype=tok.dtype), None, opens
    finally:
        ray.kill(actor)


ALTERNATIVES = {"ray_data": tokenize_on_ray_data, "ray_actor": tokenize_on_ray_actor}


def one_run(corpus: str, tokenizer: str, out: Path, side: str, cpus: int) -> dict:
    from raytrain_lm.data import tokenize
    from raytrain_lm.data.prepare import prepare_dataset

    saved = tokenize.tokenize_on_ray
    if side in ALTERNATIVES:
        tokenize.tokenize_on_ray = ALTERNATIVES[side]
    load = os.getloadavg()[0]
    t0 = time.perf_counter()
    try:
        m = prepare_dataset(corpus, out, tokenizer=tokenizer, use_ray=side.startswith("ray"), cpus=cpus,
                            force=True)
    finally:
        tokenize.tokenize_on_ray = saved
    wall = time.perf_counter() - t0
    text_mb = (m["train"]["bytes"] + m["val"]["bytes"]) / 1e6
    return {"side": side, "wall_s": wall, "text_mb": text_mb,
            "mb_per_s": text_mb / wall, "tokens": m["train"]["tokens"] + m["val"]["tokens"],
            "shards": [s["sha256"] for s in m["train"]["shards"] + m["val"]["shards"]],
            "loadavg_1m_at_start": load}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--corpus", default="stdlib")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--cpus", type=int, default=2)
    p.add_argument("--vocab-size", type=int, default=8192)
    p.add_argument("--sides", default="one_process,ray_tasks",
                   help="which sides to run, of " + ",".join(SIDES) + " [one_process,ray_tasks]: Ray "
                        "Data's side leaves two actors of its own running beside the sides after it "
                        "(its stats actor and its autoscaling coordinator)")
    p.add_argument("--out", default=str(ROOT / "bench" / "results" / "prepare.json"))
    p.add_argument("--one-process-run", nargs=4, metavar=("CORPUS", "TOKENIZER", "OUT", "SIDE"),
                   help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.one_process_run:
        os.nice(RAY_WORKER_NICENESS)
        corpus, tokenizer, out, side = args.one_process_run
        threads = 1 if side == "one_process" else args.cpus
        print(json.dumps(one_run(corpus, tokenizer, Path(out), side, cpus=threads)))
        return

    sides = [s for s in SIDES if s in args.sides.split(",")]
    if "one_process" not in sides or len(sides) < 2 or len(sides) != len(args.sides.split(",")):
        p.error(f"--sides: one_process and at least one of {', '.join(SIDES[1:])}")
    import ray

    from raytrain_lm.data.sources import plan_units, read_unit, sample_units
    from raytrain_lm.data.tokenizer import train_bpe

    with tempfile.TemporaryDirectory(prefix="bench-prepare-") as tmp:
        t0 = time.perf_counter()
        units = plan_units([args.corpus])
        tok = train_bpe((t for u in sample_units(units, 10_000_000) for t in read_unit(u)),
                        args.vocab_size)
        train_s = time.perf_counter() - t0
        tok_path = Path(tmp) / "tokenizer.json"
        tok_path.write_bytes(tok.raw)
        t0 = time.perf_counter()
        ray.init(num_cpus=args.cpus, include_dashboard=False, log_to_driver=False)
        ray_start_s = time.perf_counter() - t0
        rows = []
        for rep in range(args.reps):
            order = sides[rep % len(sides):] + sides[:rep % len(sides)]
            for side in order:
                row = (one_process_run(args.corpus, str(tok_path), Path(tmp) / "out", side, args.cpus)
                       if side in ("one_process", "threads")
                       else one_run(args.corpus, str(tok_path), Path(tmp) / "out", side, args.cpus))
                row["rep"] = rep
                rows.append(row)
                print(f"rep {rep} {row['side']:<12} {row['wall_s']:6.1f} s  {row['mb_per_s']:5.2f} MB/s  "
                      f"load {row['loadavg_1m_at_start']:.1f}", flush=True)
        ray.shutdown()
    assert len({tuple(r["shards"]) for r in rows}) == 1, "the two sides wrote different shards"
    by = {side: [r for r in rows if r["side"] == side] for side in sides}
    med = {side: statistics.median(r["mb_per_s"] for r in rs) for side, rs in by.items()}
    ratios = {side: [b["mb_per_s"] / a["mb_per_s"] for a, b in zip(by["one_process"], by[side])]
              for side in sides[1:]}
    result = {
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "command": " ".join(["python", "bench/prepare.py", *sys.argv[1:]]),
        "corpus": args.corpus, "text_mb": rows[0]["text_mb"], "tokens": rows[0]["tokens"],
        "tokenizer": f"BPE {tok.vocab_size}", "bpe_train_s": train_s, "ray_cpus": args.cpus,
        "ray_start_s": ray_start_s, "one_process_niceness": RAY_WORKER_NICENESS,
        "median_mb_per_s": med,
        "speedup_per_rep": ratios,
        "median_speedup": {side: statistics.median(r) for side, r in ratios.items()},
        "runs": [{k: v for k, v in r.items() if k != "shards"} for r in rows],
    }
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(f"one process {med['one_process']:.2f} MB/s; Ray start {ray_start_s:.1f} s")
    for side, r in ratios.items():
        print(f"{side} on {args.cpus} CPUs {med[side]:.2f} MB/s: {result['median_speedup'][side]:.2f}x "
              f"(median of per-rep ratios {', '.join(f'{x:.2f}' for x in r)})")


if __name__ == "__main__":
    main()
