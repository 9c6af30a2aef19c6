"""Where does the time to the first training step go? Timestamps of every phase of `train`.

Runs the same path as `python cli.py train` (raytrain_lm's driver functions, the real
TorchTrainer, the real per-worker loop) with timestamps taken
  - in the driver, around each step of `run_training`;
  - in Ray Train's controller, by a (developer-API) controller/worker-group callback;
  - in each worker, by wrapping the functions `train_loop_per_worker` calls (the real ones run)
    and the first `ray.train.report`.
Nothing is changed in the library. It starts its own local Ray, so run it under the lock:

    flock /tmp/raytrain-ray.lock python bench/startup.py --steps 20

Prints a timeline (seconds since the process started) and writes JSON to --out.
"""

from __future__ import annotations

import time

T_SCRIPT = time.time()

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def process_start_unix(pid: str = "self") -> float:
    """When this process was created (Linux /proc), so interpreter start-up is counted too."""
    with open(f"/proc/{pid}/stat") as f:
        start_ticks = int(f.read().rsplit(")", 1)[1].split()[19])
    with open("/proc/stat") as f:
        btime = next(int(line.split()[1]) for line in f if line.startswith("btime"))
    return btime + start_ticks / os.sysconf("SC_CLK_TCK")


def _append(path: str, record: dict) -> None:
    with open(path, "a") as f:
        f.write(json.dumps(record) + "\n")


def timed_loop(loop_config) -> None:
    """Runs in each Ray Train worker: timestamps around the real loop's set-up calls."""
    t_entry = time.time()
    import ray.train

    events_path = loop_config.events_path
    rank = ray.train.get_context().get_world_rank()
    marks = {"worker_process_start": process_start_unix(), "train_fn_entry": t_entry,
             "torch_imported_before_entry": "torch" in sys.modules}
    t0 = time.time()
    import raytrain_lm.worker.loop as L  # the loop module's own imports (data, model, checkpoint, ...)
    marks["import_loop_module"] = (t0, time.time())

    import torch

    marks["torch_threads"] = torch.get_num_threads()
    marks["omp_num_threads_env"] = os.environ.get("OMP_NUM_THREADS")

    def wrap(name, fn):
        def inner(*a, **k):
            s = time.time()
            out = fn(*a, **k)
            marks.setdefault(name, (s, time.time()))
            return out
        return inner

    from raytrain_lm.data.sampler import BatchStream

    for name in ("resolve_dataset", "dataset_tokenizer", "TrainStep", "train_stream", "Validation"):
        setattr(L, name, wrap(name, getattr(L, name)))  # the loop's phases, as it names them
    real_next, nexts = BatchStream.next, []

    def next_(self):
        nexts.append(time.time())
        return real_next(self)

    BatchStream.next = next_
    real_report = ray.train.report

    def report(*a, **k):
        if "first_report" not in marks:
            s = time.time()
            out = real_report(*a, **k)
            marks["first_report"] = (s, time.time())
            marks["first_step"] = (nexts[0], nexts[1]) if len(nexts) > 1 else None
            _append(events_path, {"where": f"rank{rank}", "marks": marks})
            return out
        return real_report(*a, **k)

    ray.train.report = report
    L.train_loop_per_worker(loop_config)


def make_callbacks(events_path: str):
    from ray.train.v2._internal.execution.callback import ControllerCallback, WorkerGroupCallback

    class Timestamps(ControllerCallback, WorkerGroupCallback):
        def _mark(self, name):
            _append(events_path, {"where": "controller", "event": name, "t": time.time()})

        def after_controller_start(self, train_run_context):
            self._mark("controller_started")

        def before_worker_group_start(self, worker_group_context):
            self._mark("worker_group_start_begins")

        def after_worker_group_start(self, worker_group):
            self._mark("worker_group_started")

        def after_worker_group_training_start(self, worker_group):
            self._mark("training_fn_launched")

    return [Timestamps()]


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--preset", default="tiny")
    p.add_argument("--data", default=str(ROOT / "data" / "pydoc"))
    p.add_argument("--out", default=str(ROOT / "bench" / "results" / "startup.json"))
    args = p.parse_args(argv)

    t = {"process_start": process_start_unix(), "script_start": T_SCRIPT}
    t["import_launch"] = time.time()
    import typer  # noqa: F401  (cli.py imports it first; counted as the CLI's own import cost)

    from raytrain_lm.cluster import connect
    from raytrain_lm.config.load import build_config
    from raytrain_lm.run import driver, follower, preflight
    from raytrain_lm.store.storage import RunFolder
    t["import_launch_done"] = time.time()

    storage = tempfile.mkdtemp(prefix="raytrain-startup-")
    events_path = os.path.join(storage, "events.jsonl")
    cfg = build_config(preset=args.preset, flags=dict(
        workers=args.workers, max_steps=args.steps, data=os.path.abspath(args.data),
        storage=storage, name="startup", eval_every=args.steps, checkpoint_every=0))
    t["t_launch"] = time.time()  # where run_training's clock starts
    manifest = preflight.ensure_dataset(cfg, print)
    preflight.fit_model_to_data(cfg, manifest)
    t["dataset_checked"] = time.time()
    import ray
    t["import_ray_done"] = time.time()
    connect.connect_ray(None, cfg.workers * cfg.worker_cpus)
    t["ray_init_done"] = time.time()
    preflight.check_resources(cfg)
    t["queue_actor_created"] = time.time()  # (no queue since 2026-12-01: kept for the timeline)
    import raytrain_lm.ray_compat.trainer
    from raytrain_lm.ray_compat.callbacks import ForwardMetrics, HeldRows

    def timed_fit(name: str, events: str) -> dict:
        """Build and fit a trainer whose workers run `timed_loop`; driver-side timestamps."""
        marks = {}
        cfg.name = name
        real_loop = raytrain_lm.ray_compat.trainer.train_loop
        raytrain_lm.ray_compat.trainer.train_loop = timed_loop  # build_trainer imports it from there
        try:
            trainer = driver.build_trainer(cfg, RunFolder(cfg.storage, name),
                                           callbacks=[ForwardMetrics(HeldRows())] + make_callbacks(events))
        finally:
            raytrain_lm.ray_compat.trainer.train_loop = real_loop
        trainer.train_loop_config.events_path = events  # WorkerInputs, one more for the bench
        marks["trainer_built"] = time.time()
        th = threading.Thread(target=trainer.fit, daemon=True)
        marks["fit_called"] = time.time()
        th.start()
        rows = 0  # taken from the controller as the driver does (follower.Follower.follow)
        while th.is_alive():
            th.join(timeout=follower.ROWS_POLL_S)
            controller = getattr(trainer, "controller", None)
            try:
                new = len(ray.get(controller.take_rows.remote())) if controller else 0
            except Exception:
                break
            if new and not rows:
                marks["first_metrics_at_driver"] = time.time()
            if new:
                marks["last_metrics_at_driver"] = time.time()
            rows += new
        th.join()
        marks["fit_returned"] = time.time()
        return marks

    import threading

    t.update(timed_fit("startup", events_path))
    # The same run again on the Ray cluster that is now up: what a persistent cluster saves.
    second_events = os.path.join(storage, "events-2.jsonl")
    second = timed_fit("startup-2", second_events)
    second_workers = [json.loads(line)["marks"] for line in open(second_events)
                      if json.loads(line)["where"].startswith("rank")]
    second["controller"] = {json.loads(line)["event"]: json.loads(line)["t"] for line in open(second_events)
                            if json.loads(line)["where"] == "controller"}
    second["workers"] = second_workers
    second["time_to_first_step_from_fit"] = min(m["first_step"][0] for m in second_workers) - second["fit_called"]
    ray.shutdown()
    t["ray_shutdown_done"] = time.time()

    events = [json.loads(line) for line in open(events_path)]
    controller = {e["event"]: e["t"] for e in events if e["where"] == "controller"}
    workers = {e["where"]: e["marks"] for e in events if e["where"].startswith("rank")}
    t0 = t["process_start"]

    def rel(x):
        return round(x - t0, 3)

    timeline = [("process start (python interpreter)", t["process_start"], None),
                ("script imports done", t["import_launch"], None),
                ("imports: typer + raytrain_lm.run.driver", t["import_launch"], t["import_launch_done"]),
                ("dataset manifest checked", t["t_launch"], t["dataset_checked"]),
                ("import ray", t["dataset_checked"], t["import_ray_done"]),
                ("ray.init (local cluster)", t["import_ray_done"], t["ray_init_done"]),
                ("(no metrics queue since 2026-12-01)", t["ray_init_done"], t["queue_actor_created"]),
                ("build TorchTrainer (imports ray.train)", t["queue_actor_created"], t["trainer_built"]),
                ("fit() -> controller started", t["fit_called"], controller.get("controller_started")),
                ("controller -> worker group start begins", controller.get("controller_started"),
                 controller.get("worker_group_start_begins")),
                ("worker group start (actors, torch, gloo)", controller.get("worker_group_start_begins"),
                 controller.get("worker_group_started")),
                ("-> train fn launched on workers", controller.get("worker_group_started"),
                 controller.get("training_fn_launched"))]
    for rank in sorted(workers):
        m = workers[rank]
        timeline.append((f"{rank}: worker process created", m["worker_process_start"], None))
        timeline.append((f"{rank}: train fn entered", m["train_fn_entry"], None))
        for key in ("import_loop_module", "resolve_dataset", "dataset_tokenizer", "TrainStep",
                    "train_stream", "Validation", "first_step", "first_report"):
            if m.get(key):
                timeline.append((f"{rank}:   {key}", m[key][0], m[key][1]))
    timeline += [("first metrics row at the driver", t["first_metrics_at_driver"], None),
                 ("last metrics row at the driver", t["last_metrics_at_driver"], None),
                 ("fit() returned", t["fit_returned"], None),
                 ("ray.shutdown() done", t["ray_shutdown_done"], None)]
    print(f"{'phase':48s}{'start s':>9s}{'end s':>9s}{'took s':>9s}")
    for name, a, b in timeline:
        if a is None:
            continue
        took = f"{b - a:9.2f}" if b is not None else ""
        end = f"{rel(b):9.2f}" if b is not None else f"{'':9s}"
        print(f"{name:48s}{rel(a):9.2f}{end}{took}")
    first_step = min(m["first_step"][0] for m in workers.values() if m.get("first_step"))
    print(f"time to first step (process start -> first step begins): {first_step - t0:.2f} s; "
          f"worker torch threads: {[m['torch_threads'] for m in workers.values()]}")
    print(f"a second run on the same, already running Ray: fit() -> first step "
          f"{second['time_to_first_step_from_fit']:.2f} s")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({
        "benchmark": "startup", "command": "python bench/startup.py " + " ".join(argv or sys.argv[1:]),
        "time_to_first_step": first_step - t0,
        "timeline": [{"phase": n, "start": rel(a), "end": rel(b) if b else None} for n, a, b in timeline if a],
        "driver": t, "controller": controller, "workers": workers, "second_run": second,
        "load_avg": os.getloadavg(),
    }, indent=2) + "\n")
    print(f"written: {out}")


if __name__ == "__main__":
    main()
