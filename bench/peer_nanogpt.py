"""Part `nanogpt` of bench/cpu_peer.py: `python cli.py train` against karpathy/nanoGPT's own
train.py, each as the command a user runs, on the same CPU.

nanoGPT's train.py, model.py and configurator.py are read from --nanogpt DIR (a checkout: nothing
is fetched here) and copied unchanged into a work folder beside data/peer/{train,val}.bin and
meta.pkl, written from this project's prepared dataset (the same token ids; a byte vocabulary of
256). Its DDP branch names CUDA in three lines (`device = f'cuda:...'`, `torch.cuda.set_device`,
`DDP(model, device_ids=...)`), so the two-process rows run a copy with exactly those three lines
made CPU's (train_ddp_cpu.py; the diff is in the JSON); everything else is unchanged.

Same shapes (the preset's n_layer, n_head, n_embd, bias; nanoGPT's block_size is the sequence
length, so ours gets model.block_size = seq_len), same batch, fp32, no compile, dropout 0, AdamW
with the same betas, weight decay and clipping, and the same learning rate at every step (our
warmup + cosine is nanoGPT's get_lr: learning_rate, min_lr = lr x 0.1, warmup_iters,
lr_decay_iters = steps). Threads: one process gets the machine's cores on every side (torch's
default for nanoGPT, the launch's choice for ours); under torchrun both get torchrun's
OMP_NUM_THREADS=1.

Per step: steady state, steps after the row's skip: nanoGPT's own per-iteration time (its `time ...ms`
lines, from the end of one iteration to the end of the next), ours from the metrics rows'
`elapsed` (the same span, reports included). Time to first step: from launching the command to
the end of step 1 (nanoGPT: its `iter 0` line, read as printed; ours: the row's first_step_unix),
and the CPU seconds the launched processes had used when it was seen.
Sides alternate within each round, the first side moving each round (A B, B A, ...).

    flock /tmp/ray.lock env PYTHONPATH=. python bench/cpu_peer.py --part nanogpt \\
        --nanogpt /path/to/nanoGPT --rows tiny-1 small-1 tiny-ddp2 --rounds 3 \\
        --out bench/results/cpu_peer_nanogpt.json
"""

from __future__ import annotations

import hashlib
import json
import os
import pickle
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
NANOGPT_FILES = ("train.py", "model.py", "configurator.py")
# nanoGPT's DDP branch, CUDA-only as written: (line, its CPU form) for train_ddp_cpu.py.
DDP_CPU_LINES = [("    device = f'cuda:{ddp_local_rank}'", "    device = 'cpu'"),
                 ("    torch.cuda.set_device(device)", "    pass"),
                 ("    model = DDP(model, device_ids=[ddp_local_rank])", "    model = DDP(model)")]

# rows: preset, ranks, steps, steps skipped before the steady state
ROWS = {"tiny-1": ("tiny", 1, 60, 10), "small-1": ("small", 1, 16, 4), "tiny-ddp2": ("tiny", 2, 60, 10)}


def sides_of(ranks: int) -> dict[str, dict]:
    """The commands compared in a row of `ranks` processes: how each is launched."""
    if ranks == 1:
        return {"nanoGPT": {"nanogpt": "train.py"},
                "--workers 0": {"workers": "0"},
                "--workers 1 (Ray)": {"workers": "1"}}
    return {"nanoGPT torchrun": {"nanogpt": "train_ddp_cpu.py", "torchrun": ranks},
            "torchrun --workers 0": {"workers": "0", "torchrun": ranks},
            f"--workers {ranks} (Ray)": {"workers": str(ranks)}}


# Extra sides (--extra NAME): one suspect each, beside the row's own.
EXTRA = {"--workers 0 tanh": {"workers": "0", "set": ["model.gelu=tanh"]},
         "--workers 0 PASSIVE": {"workers": "0", "env": {"OMP_WAIT_POLICY": "PASSIVE"}},
         "--workers 0 bind": {"workers": "0", "env": {"OMP_PROC_BIND": "true"}},
         "--workers 1 (Ray) PASSIVE": {"workers": "1", "worker_env": ["OMP_WAIT_POLICY=PASSIVE"]},
         "--workers 1 (Ray) bind": {"workers": "1", "worker_env": ["OMP_PROC_BIND=true"]},
         "--workers 1 (Ray) tanh": {"workers": "1", "set": ["model.gelu=tanh"]},
         "--workers 1 (Ray) spin 10k": {"workers": "1", "worker_env": ["GOMP_SPINCOUNT=10000"]},
         "--workers 0 spin 10k": {"workers": "0", "env": {"GOMP_SPINCOUNT": "10000"}},
         "--workers 1 (Ray) poll 2 s": {"workers": "1", "env": {"RAY_TRAIN_HEALTH_CHECK_INTERVAL_S": "2"}},
         "nanoGPT PASSIVE": {"nanogpt": "train.py", "env": {"OMP_WAIT_POLICY": "PASSIVE"}}}


def write_peer_data(data: Path, out: Path) -> None:
    """data/peer/{train,val}.bin (uint16 token ids, nanoGPT's format) and meta.pkl from this
    project's prepared dataset."""
    import pyarrow as pa

    manifest = json.loads((data / "manifest.json").read_text())
    out.mkdir(parents=True, exist_ok=True)
    for split, name in (("train", "train.bin"), ("val", "val.bin")):
        parts = [pa.ipc.open_file(pa.memory_map(str(data / s["file"]), "r")).get_batch(0).column(0)
                 .to_numpy(zero_copy_only=True) for s in manifest[split]["shards"]]
        np.concatenate(parts).astype(np.uint16).tofile(out / name)
    with open(out / "meta.pkl", "wb") as f:
        pickle.dump({"vocab_size": manifest["vocab_size"]}, f)


def workdir(nanogpt: Path, data: Path) -> tuple[Path, dict]:
    """nanoGPT's files, unchanged, with the peer data; train_ddp_cpu.py. Returns (folder, what
    was used: the files' sha256, the DDP copy's changed lines)."""
    work = Path(tempfile.mkdtemp(prefix="nanogpt-peer-"))
    used = {}
    for name in NANOGPT_FILES:
        shutil.copy(nanogpt / name, work / name)
        used[name] = hashlib.sha256((work / name).read_bytes()).hexdigest()
    text = (work / "train.py").read_text()
    for old, new in DDP_CPU_LINES:
        if text.count(old + "\n") != 1:
            raise SystemExit(f"train.py in {nanogpt} is not the one this bench knows: no line {old!r}")
        text = text.replace(old + "\n", new + "\n")
    (work / "train_ddp_cpu.py").write_text(text)
    used["train_ddp_cpu.py changes"] = DDP_CPU_LINES
    write_peer_data(data, work / "data" / "peer")
    return work, used


def preset_shape(preset: str) -> dict:
    sys.path.insert(0, str(ROOT))
    from raytrain_lm.config.presets import preset_config

    cfg = preset_config(preset)
    return dict(n_layer=cfg.model.n_layer, n_head=cfg.model.n_head, n_embd=cfg.model.n_embd,
                bias=cfg.model.bias, seq=cfg.seq_len, batch=cfg.batch_size, lr=cfg.lr,
                warmup=cfg.warmup_steps, min_lr_ratio=cfg.min_lr_ratio, wd=cfg.weight_decay,
                beta1=cfg.beta1, beta2=cfg.beta2, clip=cfg.grad_clip)


def command(side: dict, preset: str, ranks: int, steps: int, work: Path, data: Path, storage: Path,
            name: str) -> tuple[list[str], Path, dict]:
    """(argv, cwd, extra environment) of one side's run."""
    s = preset_shape(preset)
    torchrun = ([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node",
                 str(side["torchrun"])] if side.get("torchrun") else [sys.executable])
    if "nanogpt" in side:
        args = dict(dataset="peer", device="cpu", dtype="float32", compile=False, backend="gloo",
                    n_layer=s["n_layer"], n_head=s["n_head"], n_embd=s["n_embd"], bias=s["bias"],
                    block_size=s["seq"], batch_size=s["batch"], dropout=0.0,
                    gradient_accumulation_steps=ranks, learning_rate=s["lr"],
                    min_lr=s["lr"] * s["min_lr_ratio"], warmup_iters=s["warmup"],
                    lr_decay_iters=steps, max_iters=steps - 1, weight_decay=s["wd"],
                    beta1=s["beta1"], beta2=s["beta2"], grad_clip=s["clip"], eval_interval=100_000,
                    eval_iters=1, log_interval=1, always_save_checkpoint=False,
                    out_dir=str(storage / name))
        argv = torchrun + [side["nanogpt"], *(f"--{k}={v}" for k, v in args.items())]
        return argv, work, dict(side.get("env", {}))
    argv = torchrun + [str(ROOT / "cli.py"), "train", "--workers", side["workers"], "--preset", preset,
                       "--max-steps", str(steps), "--eval-every", str(steps), "--checkpoint-every",
                       "-1", "--set", "eval_windows=16", "--set", f"model.block_size={s['seq']}",
                       "--data", str(data), "--storage", str(storage), "--name", name, "--quiet"]
    for item in side.get("set", []):
        argv += ["--set", item]
    for item in side.get("worker_env", []):
        argv += ["--worker-env", item]
    if side["workers"] != "0":
        argv += ["--address", "local"]
    return argv, ROOT, dict(side.get("env", {}))


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of process `pid` and its descendants so far (Linux /proc)."""
    tick, total, todo = os.sysconf("SC_CLK_TCK"), 0.0, [pid]
    while todo:
        p = todo.pop()
        try:
            fields = Path(f"/proc/{p}/stat").read_text().rsplit(")", 1)[1].split()
            total += (int(fields[11]) + int(fields[12])) / tick
            for task in Path(f"/proc/{p}/task").iterdir():
                todo += [int(c) for c in (task / "children").read_text().split()]
        except (OSError, ValueError):  # gone meanwhile
            continue
    return total


def run_side(argv: list[str], cwd: Path, extra_env: dict, storage: Path, name: str, skip: int,
             nanogpt: bool) -> dict:
    """One run: its steady ms per step, seconds to the end of step 1, and the CPU seconds the
    launched process tree had used by then (with a Ray it starts: Ray's processes and workers
    too), what a busy machine changes least: the start-up's imports run on one thread."""
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "OMP_NUM_THREADS")}
    env.update(PYTHONPATH=str(ROOT), PYTHONUNBUFFERED="1", **extra_env)
    t0 = time.time()
    proc = subprocess.Popen(argv, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)
    lines: list[tuple[float, str]] = []
    reader = threading.Thread(target=lambda: lines.extend((time.time(), line) for line in proc.stdout))
    reader.start()
    metrics, first_cpu = storage / name / "metrics.jsonl", None
    while proc.poll() is None and first_cpu is None:
        seen = (any(line.startswith("iter 0:") for _, line in list(lines)) if nanogpt
                else metrics.is_file() and metrics.stat().st_size > 0)
        if seen:
            first_cpu = cpu_seconds(proc.pid)
        time.sleep(0.02)
    reader.join()
    if proc.wait() != 0:
        raise SystemExit(f"{' '.join(argv)} failed:\n{''.join(line for _, line in lines)[-3000:]}")
    if nanogpt:
        iters = {}
        for t, line in lines:
            if line.startswith("iter "):  # "iter 12: loss 3.1, time 98.41ms, mfu ..."
                i = int(line.split(":")[0].split()[1])
                iters[i] = (t, float(line.split("time ")[1].split("ms")[0]))
        steady = [ms for i, (_, ms) in iters.items() if i + 1 > skip]
        return {"ms_per_step": statistics.mean(steady), "first_step_s": iters[0][0] - t0,
                "first_step_cpu_s": first_cpu, "process_s": time.time() - t0}
    rows = [json.loads(line) for line in (storage / name / "metrics.jsonl").read_text().splitlines()]
    first = next(r for r in rows if r["step"] >= skip)
    last = rows[-1]
    return {"ms_per_step": (last["elapsed"] - first["elapsed"]) / (last["step"] - first["step"]) * 1e3,
            "first_step_s": rows[0]["first_step_unix"] - t0,
            "loop_begins_s": rows[0]["train_start_unix"] - t0, "threads": rows[0]["threads"],
            "first_step_cpu_s": first_cpu, "process_s": time.time() - t0}


def part_nanogpt(args) -> dict:
    if not args.nanogpt:
        raise SystemExit("--part nanogpt needs --nanogpt DIR: a checkout of karpathy/nanoGPT")
    data = Path(args.data).resolve()
    if not (data / "manifest.json").is_file():
        subprocess.run([sys.executable, str(ROOT / "cli.py"), "prepare", "--out", str(data)], check=True)
    work, used = workdir(Path(args.nanogpt), data)
    storage = Path(tempfile.mkdtemp(prefix="nanogpt-peer-runs-"))
    out, k = {"nanogpt_files": used}, 0
    for row in args.rows:
        preset, ranks, steps, skip = ROWS[row]
        sides = {**sides_of(ranks), **{e: EXTRA[e] for e in args.extra if ranks == 1}}
        got: dict[str, list[dict]] = {s: [] for s in sides}
        for r in range(args.rounds):
            order = list(sides)[r % len(sides):] + list(sides)[:r % len(sides)]
            for side in order:
                k += 1
                argv, cwd, env = command(sides[side], preset, ranks, steps, work, data, storage, f"r{k}")
                got[side].append({**run_side(argv, cwd, env, storage, f"r{k}", skip,
                                             "nanogpt" in sides[side]), "load": os.getloadavg()[0]})
                print(row, side, {key: round(v, 2) for key, v in got[side][-1].items()}, flush=True)
        ref = next(iter(sides))  # nanoGPT's side
        summary = {}
        for side, runs in got.items():
            ms = [x["ms_per_step"] for x in runs]
            first = [x["first_step_s"] for x in runs]
            paired = [a["ms_per_step"] / x["ms_per_step"] for a, x in zip(got[ref], runs)]
            cpu = [x["first_step_cpu_s"] for x in runs if x["first_step_cpu_s"] is not None]
            summary[side] = {"ms_per_step_median": statistics.median(ms), "ms_min": min(ms),
                             "first_step_cpu_s_median": statistics.median(cpu) if cpu else None,
                             "ms_max": max(ms), "speed_vs_nanogpt_median": statistics.median(paired),
                             "speed_vs_nanogpt_by_round": paired,
                             "first_step_s_median": statistics.median(first),
                             "first_step_s_min": min(first), "first_step_s_max": max(first),
                             "runs": runs}
        out[row] = {"preset": preset, "ranks": ranks, "steps": steps, "skip": skip, "sides": summary}
    shutil.rmtree(storage, ignore_errors=True)
    return out
