"""How long does a checkpoint stop training, and how long does a resize take?

Part 1, checkpoint uploads, sync against async, side by side: the same run (default: the `small`
preset, 10.8M parameters, ~130 MB of checkpoint with AdamW's states, a checkpoint every 10 steps)
with its checkpoints written to an S3-compatible server (moto's, on 127.0.0.1, in this process),
once with `--checkpoint-upload sync` and once with `async`, alternating the order per repetition.
Figure: `checkpoint_wait_s`, the seconds rank 0's training thread spent in each checkpoint (writing
its files locally, the report barrier and, with sync, the upload), which the loop reports with the
row after each checkpoint. The final checkpoint is left out (at the end every upload is waited
for either way). Also the run's steady tokens/s: an upload in the background shares the CPUs.

Part 2, the cost of a resize: a `--workers 1-2` run of the tiny preset on a multi-node cluster on
this machine (`ray.cluster_utils.Cluster`: a head without CPUs, two 1-CPU worker nodes). One node is
removed (its raylet and workers killed); figure: seconds from the removal to the first step the
one-worker group finishes (its rows' `first_step_unix`). Then a node is added back; figure: seconds
from the addition to the first step at two workers (this includes Ray noticing the new node: the
policy counts every `--resize-interval`, 1 s here, on a fresh view of the cluster, scaling.py).

Run it under the shared Ray lock:

    flock /tmp/ray.lock python bench/checkpoint.py --reps 2
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--reps", type=int, default=2, help="repetitions of the (sync, async) pair [2]")
    p.add_argument("--steps", type=int, default=60, help="optimizer steps per run [60]")
    p.add_argument("--checkpoint-every", type=int, default=10)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--preset", default="small")
    p.add_argument("--set", dest="sets", action="append",
                   default=["batch_size=2", "seq_len=128", "eval_windows=8", "warmup_steps=5"],
                   help="settings for every run; the defaults keep a CPU step short (the "
                        "checkpoint's size depends on the model only)")
    p.add_argument("--skip-resize", action="store_true", help="part 1 only")
    p.add_argument("--skip-uploads", action="store_true", help="part 2 only")
    p.add_argument("--out", default=str(ROOT / "bench" / "results" / "checkpoint.json"))
    return p.parse_args(argv)


def start_s3() -> tuple[object, dict]:
    """moto's S3 server on 127.0.0.1 and the environment that points clients at it."""
    import boto3
    from moto.server import ThreadedMotoServer

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    env = {"AWS_ENDPOINT_URL": f"http://127.0.0.1:{server._server.server_address[1]}",
           "AWS_ACCESS_KEY_ID": "bench", "AWS_SECRET_ACCESS_KEY": "bench",
           "AWS_DEFAULT_REGION": "us-east-1", "AWS_REGION": "us-east-1",
           "AWS_EC2_METADATA_DISABLED": "true"}
    os.environ.update(env)  # Ray, started next in this process, passes it to every worker
    boto3.client("s3").create_bucket(Bucket="bench")
    return server, env


def train(address: str, name: str, storage: str, data: str, args, *extra: str) -> tuple[dict, list[dict]]:
    cmd = [sys.executable, str(ROOT / "cli.py"), "train", "--address", address, "--name", name,
           "--storage", storage, "--data", data, "--preset", args.preset, "--json",
           "--max-steps", str(args.steps), "--log-every", str(args.checkpoint_every),
           "--eval-every", str(args.checkpoint_every), "--checkpoint-every", str(args.checkpoint_every),
           *[a for s in args.sets for a in ("--set", s)], *extra]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=1800)
    if proc.returncode != 0:
        raise SystemExit(f"{name} failed:\n{proc.stderr[-3000:]}")
    from raytrain_lm.store.storage import RunFolder

    return json.loads(proc.stdout), RunFolder(storage, name).read_jsonl("metrics.jsonl")


def part_uploads(args, data: str) -> dict:
    import ray

    server, _ = start_s3()
    ray.init(num_cpus=args.workers + 1, include_dashboard=False, log_to_driver=False)
    address = ray.get_runtime_context().gcs_address
    runs = []
    try:
        for rep in range(args.reps):
            for mode in (("sync", "async") if rep % 2 == 0 else ("async", "sync")):
                name = f"ckpt-{mode}-{rep}-{int(time.time())}"
                load = os.getloadavg()[0]
                summary, rows = train(address, name, "s3://bench/runs", data, args,
                                      "--workers", str(args.workers), "--checkpoint-upload", mode)
                waits = [r["checkpoint_wait_s"] for r in rows if r.get("checkpoint_wait_s") is not None]
                runs.append({"mode": mode, "rep": rep, "name": name, "load_at_start": load,
                             "checkpoint_waits_s": waits, "mean_wait_s": statistics.mean(waits),
                             "tokens_per_second": summary["tokens_per_second"],
                             "wall_seconds": summary["wall_seconds"]})
                print(f"{mode:5s} rep {rep}: waits {['%.2f' % w for w in waits]} s, "
                      f"{summary['tokens_per_second']:,.0f} tok/s, wall {summary['wall_seconds']:.0f} s",
                      flush=True)
        size = checkpoint_bytes("bench", "runs/" + runs[-1]["name"])  # while the server runs
    finally:
        ray.shutdown()
        server.stop()
    by = {m: [w for r in runs if r["mode"] == m for w in r["checkpoint_waits_s"]] for m in ("sync", "async")}
    return {"runs": runs, "checkpoint_mb": size / 1e6,
            "median_wait_s": {m: statistics.median(v) for m, v in by.items()},
            "async_over_sync": statistics.median(by["async"]) / statistics.median(by["sync"])}


def checkpoint_bytes(bucket: str, prefix: str) -> int:
    import boto3

    pages = boto3.client("s3").get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix)
    sizes: dict[str, int] = {}
    for page in pages:
        for o in page.get("Contents", []):
            parts = o["Key"][len(prefix) + 1:].split("/")
            if parts[0].startswith("checkpoint_"):
                sizes[parts[0]] = sizes.get(parts[0], 0) + o["Size"]
    return max(sizes.values())


def part_resize(data: str) -> dict:
    from ray.cluster_utils import Cluster

    from raytrain_lm.cluster.connect import free_port
    from raytrain_lm.store.storage import RunFolder

    cluster = Cluster(initialize_head=True, head_node_args=dict(
        num_cpus=0, include_dashboard=False, dashboard_agent_listen_port=free_port()))
    storage = tempfile.mkdtemp(prefix="bench-resize-")
    try:
        nodes = [cluster.add_node(num_cpus=1) for _ in range(2)]
        cluster.wait_for_nodes()
        proc = subprocess.Popen(
            [sys.executable, str(ROOT / "cli.py"), "train", "--address", cluster.address,
             "--name", "resize", "--storage", storage, "--data", data, "--workers", "1-2",
             "--max-steps", "100000", "--log-every", "5", "--eval-every", "100000",
             "--checkpoint-every", "20", "--max-failures", "2", "--resize-interval", "1", "-q"],
            cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        run = RunFolder(storage, "resize")

        def first_row(pred, timeout=300):
            deadline = time.time() + timeout
            while time.time() < deadline:
                found = next((r for r in run.read_jsonl("metrics.jsonl") if pred(r)), None)
                if found:
                    return found
                if proc.poll() is not None:
                    raise SystemExit(f"the run ended: {proc.stderr.read()[-3000:]}")
                time.sleep(0.1)
            raise SystemExit("timed out waiting for the run")

        first_row(lambda r: r.get("workers") == 2 and r["step"] >= 20)
        lost = time.time()
        cluster.remove_node(nodes[0])
        shrunk = first_row(lambda r: r.get("workers") == 1)
        first_row(lambda r: r.get("workers") == 1 and r["step"] >= shrunk["step"] + 20)
        added = time.time()
        cluster.add_node(num_cpus=1)
        grown = first_row(lambda r: r.get("workers") == 2 and r["train_start_unix"] > added)
        proc.kill()
        proc.wait()
        return {"node_lost_to_first_step_s": shrunk["first_step_unix"] - lost,
                "node_added_to_first_step_s": grown["first_step_unix"] - added,
                "lost_resumed_from_step": shrunk["resumed_from_step"],
                "added_resumed_from_step": grown["resumed_from_step"]}
    finally:
        import ray

        ray.shutdown()
        cluster.shutdown()


def main(argv=None) -> None:
    args = parse_args(argv)
    from raytrain_lm.config.load import build_config
    from raytrain_lm.run.preflight import ensure_dataset

    data = str(ROOT / "data" / "pydoc")
    ensure_dataset(build_config(flags={"data": data}), print)
    started = _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")
    result = {"started": started, "machine": platform.processor() or platform.machine(),
              "cpus": os.cpu_count(), "args": vars(args), "load_at_start": os.getloadavg()[0]}
    if not args.skip_uploads:
        result["uploads"] = u = part_uploads(args, data)
        print(f"checkpoint {u['checkpoint_mb']:.0f} MB; median seconds blocked per checkpoint: "
              f"sync {u['median_wait_s']['sync']:.2f}, async {u['median_wait_s']['async']:.2f} "
              f"(async/sync {u['async_over_sync']:.2f})", flush=True)
    if not args.skip_resize:
        result["resize"] = part_resize(data)
        r = result["resize"]
        print(f"resize: node lost -> first step at 1 worker {r['node_lost_to_first_step_s']:.1f} s; "
              f"node added -> first step at 2 workers {r['node_added_to_first_step_s']:.1f} s",
              flush=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(f"results: {args.out}")


if __name__ == "__main__":
    main()
