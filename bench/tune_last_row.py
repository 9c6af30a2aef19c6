"""Does a trial's last row reach Tune when its run ends right after reporting it? Ray's route
(`TuneReportCallback`: another process puts each row into the trial session's queue) against a
sweep's (tune/trial_rows.py: the trial's own thread reports every row it takes from the run's
controller), on one local Ray, one sweep per route, the routes alternated.

Each trial stands in for a Train run: a helper actor (Ray's route: the controller; ours: the
controller holding the rows) gets five rows `gap` seconds apart and the trial's function returns
right after the fifth, as a run does after its final report. Counted: trials whose result.json
does not end at row 5, and trials that had not ended on their own when the sweep's time budget
ran out (Tune then stops them: their function had returned, but the trial hung).

    flock /tmp/ray.lock python bench/tune_last_row.py --trials 24 --reps 1
"""

from __future__ import annotations

import argparse
import datetime as _dt
import glob
import json
import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

ROWS = 5
GAPS = (0.0, 0.05, 0.1, 0.15)


def ray_route(config):
    """Rows through the trial session's queue, put by another process (TuneReportCallback's way)."""
    import ray
    from ray.train._internal.session import get_session

    @ray.remote(num_cpus=0)
    class Putter:
        def put(self, queue, row):
            queue.put(row)

    queue = get_session()._get_or_create_inter_actor_queue()
    putter = Putter.remote()
    for step in range(1, ROWS + 1):
        ray.get(putter.put.remote(queue, {"step": step}))
        time.sleep(config["gap"])


def our_route(config):
    """Rows held by a controller actor, taken and reported by the trial's thread (follow_trial)."""
    import ray
    from ray import tune

    from raytrain_lm.tune.trial_rows import follow_trial

    @ray.remote(num_cpus=0)
    class Controller:
        def __init__(self):
            self.rows = []

        def put(self, row):
            self.rows.append(row)

        def take_rows(self):
            rows, self.rows = self.rows, []
            return rows

    class Run:
        controller = None

        def fit(self):
            self.controller = Controller.remote()
            for step in range(1, ROWS + 1):
                ray.get(self.controller.put.remote({"step": step}))
                time.sleep(config["gap"])

    follow_trial(Run(), tune.report)


def sweep(fn, trials: int, storage: str, name: str, budget_s: float) -> dict:
    from ray import tune

    ended: dict[str, float] = {}

    class Ended(tune.Callback):
        def on_trial_complete(self, iteration, trials, trial, **info):
            ended[trial.trial_id] = time.time()

    t0 = time.time()
    tuner = tune.Tuner(
        tune.with_resources(fn, {"cpu": 0.01}),
        param_space={"gap": tune.grid_search([GAPS[i % len(GAPS)] for i in range(trials)])},
        tune_config=tune.TuneConfig(time_budget_s=budget_s),
        run_config=tune.RunConfig(storage_path=storage, name=name, verbose=0, callbacks=[Ended()]))
    tuner.fit()
    wall = time.time() - t0
    on_their_own = {t for t, at in ended.items() if at < t0 + budget_s}
    lost = 0
    for result in glob.glob(f"{storage}/{name}/*/result.json"):
        steps = [json.loads(line).get("step") for line in Path(result).read_text().splitlines()]
        lost += steps[-1:] != [ROWS]
    return {"trials": trials, "ended": len(on_their_own), "last_row_lost": lost,
            "hung": trials - len(on_their_own), "wall_s": round(wall, 1)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--trials", type=int, default=24)
    ap.add_argument("--reps", type=int, default=1)
    ap.add_argument("--budget-s", type=float, default=240.0, help="each sweep's time budget")
    ap.add_argument("--out", default=str(ROOT / "bench/results/tune_last_row.json"))
    args = ap.parse_args()

    import ray

    os.environ["RAY_AIR_NEW_OUTPUT"] = "0"
    ray.init(num_cpus=2, include_dashboard=False, runtime_env={"env_vars": {"PYTHONPATH": str(ROOT)}})
    started = _dt.datetime.now(_dt.timezone.utc)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for rep in range(args.reps):
            order = [("ray", ray_route), ("ours", our_route)]
            for route, fn in order if rep % 2 == 0 else order[::-1]:
                r = {"route": route, "rep": rep, **sweep(fn, args.trials, tmp, f"{route}-{rep}", args.budget_s)}
                print(json.dumps(r), flush=True)
                rows.append(r)
    ray.shutdown()
    print("\n| route | trials | ended on their own | last row lost | hung until the budget | wall |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['route']} | {r['trials']} | {r['ended']} | {r['last_row_lost']} | {r['hung']} | {r['wall_s']} s |")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"started": started.isoformat(timespec="minutes"),
                                          "args": vars(args), "rows": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()
