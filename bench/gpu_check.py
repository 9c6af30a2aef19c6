"""One GPU, no Ray: does every layout's per-worker code run, how fast is the gpt2 step, and what
does the memory plan say against max_memory_allocated?

A prepared check for a machine with one GPU and torch alone (torch 2.11+, numpy; no Ray, pyarrow,
typer, yaml or tokenizers, no package index): its whole output survives whatever stops it.
1. Every layout a Ray Train worker runs, built and stepped by the worker's own code
   (bench/gpu_check_layout.py: step.TrainStep in a process group of one rank, mesh dims of one
   rank applied all the same) on random tokens from pinned host memory: DDP (with Ray's DDP
   arguments) in bf16, fp16 with the scaler, fp32 (TF32), full checkpointing; ZeRO-1, ZeRO-2,
   FSDP (bf16, fp16, selective checkpointing); tensor parallelism with and without sequence
   parallelism; pipelines (1F1B, GPipe; interleaved 1F1B on the Llama, whose head is untied);
   FSDP + TP + PP; the Llama under DDP and FSDP + TP; the mixture of experts (router, grouped
   matmul in bf16, the loop in fp32) under DDP and FSDP, and its expert-parallel all-to-all
   dispatch on one rank; compiled FSDP and Llama; the gpt2 preset through TrainStep (MFU), eager
   and compiled. Each row: the timed steps' metrics row
   (metrics.Meter: step time, tokens/s, MFU, data wait and the pipeline bubble through CUDA
   events), a validation, and for sharded layouts a DCP save and load round trip; every GPT
   layout must start from the same weights. Every row starts after a gc.collect() and records
   what was still allocated then (a row's peak is its own, not its predecessors' cycles).
   Attention rows, one per attention path (causal, a sliding window shorter than the sequence,
   documents where the model has them, a window in --cp 2's chunk order): the model's attention
   module alone, which SDPA kernel ran, which fused kernels take the path, its time; a masked
   path (the sliding window, documents, cp chunks: flex_attention's block mask) also against
   the same mask dense (its kernel, time, memory and the outputs' largest difference).
2. bench/gpu_throughput.py: the gpt2 step in its own plain loop, eager and compiled.
3. The memory plan (raytrain_lm.plan.estimate) against max_memory_allocated for the gpt2 rows.

Layouts run in a child process (one for all eager layouts, one per compiled layout, so no row
times another's compilation or residue): the eager ones, gpt2 compiled, gpu_throughput, then the
other compiled ones; each row goes to rows.jsonl the moment it is done and
its table line is printed at once, and gpu_check.json is rewritten after every row. A child that
dies (a CUDA fault, a watchdog abort) costs its current row only: the rest run in a new child.
Past --budget no new row starts; a SIGTERM (the outer `timeout`) writes what is done and stops.
Each row's expected seconds on an H100 (EXPECTED_S) add up to the run's expected length, printed
first: every row fits in the default --budget.

    timeout 480 python bench/gpu_check.py --out-dir bench/results/gpu   # one H100/H200, <= 8 min
    python bench/gpu_check.py --smoke --out-dir /tmp/gpu-smoke            # the same code on a CPU
Exit 0 when every layout ran and the GPT layouts started equal; 1 otherwise; 2 for bad usage.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import platform
import signal
import subprocess
import sys
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # run from a checkout: the package need not be installed
sys.path.insert(0, str(ROOT / "bench"))

ALL_DIMS = ("fsdp", "tp", "pp")
MOE = {"model.arch": "moe", "model.n_experts": 8, "model.top_k": 2}
# (name, TrainConfig settings, mesh dims forced on one rank)
LAYOUTS = [
    ("ddp", {}, ()),
    ("ddp fp16+scaler", {"precision": "fp16"}, ()),
    ("ddp fp32 (tf32)", {"precision": "fp32"}, ()),
    ("ddp full-ac", {"activation_checkpointing": "full"}, ()),
    ("zero1", {"strategy": "zero1", "grad_accum": 2}, ("fsdp",)),  # gathered once for both
    ("zero2", {"strategy": "zero2"}, ("fsdp",)),
    ("fsdp", {"strategy": "fsdp"}, ("fsdp",)),
    ("fsdp fp16+scaler", {"strategy": "fsdp", "precision": "fp16"}, ("fsdp",)),
    ("fsdp selective-ac", {"strategy": "fsdp", "activation_checkpointing": "selective"}, ("fsdp",)),
    ("tp", {}, ("tp",)),
    ("tp+sp", {"sequence_parallel": True}, ("tp",)),
    ("pp 1f1b", {}, ("pp",)),
    ("pp gpipe", {"pp_schedule": "gpipe"}, ("pp",)),
    ("fsdp+tp+pp", {"strategy": "fsdp"}, ALL_DIMS),
    ("llama ddp", {"model.arch": "llama"}, ()),
    ("llama pp interleaved-1f1b", {"model.arch": "llama", "pp_schedule": "interleaved-1f1b",
                                   "virtual_stages": 2}, ("pp",)),
    ("llama fsdp+tp", {"strategy": "fsdp", "model.arch": "llama"}, ("fsdp", "tp")),
    ("gpt2 ddp", {"model": "gpt2"}, ()),
    # the mixture of experts: its config takes no family defaults here, so n_experts is set
    ("moe ddp bf16", {**MOE, "precision": "bf16"}, ()),
    ("moe ddp fp32", {**MOE, "precision": "fp32"}, ()),
    ("moe fsdp bf16", {**MOE, "strategy": "fsdp", "precision": "bf16"}, ("fsdp",)),
    ("moe fsdp fp32", {**MOE, "strategy": "fsdp", "precision": "fp32"}, ("fsdp",)),
    ("moe ep all-to-all bf16", {**MOE, "precision": "bf16"}, ("ep",)),
    # the model's attention alone, per path (gpu_check_layout.run_attention)
    ("attention causal", {"attention": "causal"}, ()),
    ("attention sliding-window", {"attention": "sliding-window"}, ()),
    ("attention documents", {"attention": "documents"}, ()),
    ("attention cp-chunks", {"attention": "cp-chunks"}, ()),
    # each compiled layout in a process of its own (compiled DDP: gpt2's row)
    ("gpt2 ddp compile", {"model": "gpt2", "compile": True}, ()),
    ("fsdp compile", {"strategy": "fsdp", "compile": True}, ("fsdp",)),
    ("llama ddp compile", {"model.arch": "llama", "compile": True}, ()),
]
BY_NAME = {name: (settings, force) for name, settings, force in LAYOUTS}

# Expected seconds of each row on one H100, building, warm-up, timed steps, validation and DCP
# included: estimates from the work each does (the small model's step is tens of ms, a DCP round
# trip of its ~0.8 GB of weights and AdamW states about 2 s, a cold Inductor compile of it 30-40
# s, of gpt2 about a minute), until a GPU run's "seconds" replace them; plus each process's start
# (Python, torch, the CUDA context, NCCL) and gpu_throughput's run of gpt2, eager and compiled.
SHARDED_S, REPLICATED_S = 6, 4  # a sharded row adds its DCP round trip
EXPECTED_S = {name: (SHARDED_S if force and force != ("ep",) else REPLICATED_S)
              for name, settings, force in LAYOUTS if not settings.get("compile")}
EXPECTED_S.update({"gpt2 ddp": 8, "attention causal": 3, "attention sliding-window": 5,
                   "attention documents": 2, "attention cp-chunks": 2, "gpt2 ddp compile": 60, "fsdp compile": 45,
                   "llama ddp compile": 40})
PROCESS_START_S, THROUGHPUT_S = 10, 75
BUDGET_S = 420.0  # --budget's default: rows then, with the row in flight, inside `timeout 480`


def expected_seconds(names: list[str], throughput: bool = True) -> float:
    """The check's expected length on an H100 for these rows (EXPECTED_S): the rows, a process
    start for the eager rows' child and for each compiled row's, and gpu_throughput's run."""
    children = any(not BY_NAME[n][0].get("compile") for n in names) + \
        sum(bool(BY_NAME[n][0].get("compile")) for n in names)
    return sum(EXPECTED_S[n] for n in names) + PROCESS_START_S * children + \
        (THROUGHPUT_S if throughput else 0)


def import_all() -> list[str]:
    """Import every module the check and its children use (a host without one fails here, in
    a second, not after minutes of GPU time); returns the project's modules."""
    import importlib

    import gpu_check_layout
    import gpu_throughput  # noqa: F401

    for m in gpu_check_layout.MODULES:
        importlib.import_module(m)
    return sorted(m for m in sys.modules if m.startswith("raytrain_lm"))


def machine() -> dict:
    import torch

    info = {"python": platform.python_version(), "torch": torch.__version__,
            "cuda": torch.version.cuda, "numpy": __import__("numpy").__version__}
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        info.update(device=props.name, capability=f"{props.major}.{props.minor}",
                    memory_gb=props.total_memory / 2**30, cudnn=torch.backends.cudnn.version(),
                    nccl=".".join(map(str, torch.cuda.nccl.version())))
    else:
        info["device"] = "cpu"
    return info


# ---------------------------------------------------------------- the child: layouts in order

def child(names: list[str], kind: str, steps: int, rows_file: Path) -> int:
    import torch
    import torch.distributed as dist

    from gpu_check_layout import release, run_layout

    modules = import_all()
    if kind == "smoke":
        # The CPU smoke's compiled rows compile with aot_eager: Dynamo's capture, its graph breaks
        # and AOTAutograd's joint graph are the GPU's code; inductor's CPU backend (C++) is not
        # a GPU's Triton, and compiling with it cost most of the smoke. (--compile's inductor on a CPU:
        # tests/test_step_variants.py, test_compile_on_cpu_trains_like_eager.)
        torch.compile = functools.partial(torch.compile, backend="aot_eager")
    device = torch.device("cuda", 0) if kind == "gpu" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
        torch.set_float32_matmul_precision("high")  # as a GPU worker does (loop.py)
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo",
                            store=dist.HashStore(), rank=0, world_size=1)
    for name in names:
        append(rows_file, {"event": "start", "layout": name})
        settings, force = BY_NAME[name]
        t0 = time.perf_counter()
        try:
            row = run_layout(name, settings, force, kind, device, steps)
        except Exception as e:  # one layout's failure is a row, not the end of the check
            row = {"layout": name, "status": f"error: {type(e).__name__}: "
                                             f"{str(e).splitlines()[0][:200] if str(e) else ''}",
                   "traceback": traceback.format_exc()[-3000:]}
        row["seconds"] = time.perf_counter() - t0
        append(rows_file, row)
        print(table_line(row), flush=True)
        release(device)
    loaded = sorted(m for m in sys.modules if m.startswith("raytrain_lm"))
    append(rows_file, {"event": "modules", "imported": modules, "loaded": loaded,
                       "ray_imported": "ray" in sys.modules})
    dist.destroy_process_group()
    return 0


def append(path: Path, record: dict) -> None:
    with open(path, "a") as f:
        f.write(json.dumps(record) + "\n")
        f.flush()
        os.fsync(f.fileno())


def table_line(r: dict) -> str:
    if r["status"] != "ok":
        return f"{r['layout']:26} {r['status']}"
    if "attention" in r:
        mem = f"{r['peak_mem_gb']:6.2f} GB" if r["peak_mem_gb"] is not None else "-"
        dense = "" if "dense_step_time" not in r else \
            (f"  dense mask: {1e3 * r['dense_step_time']:.2f} ms kernel {r['dense_kernel']} "
             f"max diff {r['dense_max_diff']:.1e}")
        return (f"{r['layout']:26} ok   {r['precision']:8} {1e3 * r['step_time']:8.2f} ms fwd+bwd  "
                f"kernel {r['kernel']}  fused {','.join(r['fused_kernels']) or 'none'}  "
                f"mem {mem}  {r['seconds']:.0f} s{dense}")
    mfu = f"{100 * r['mfu']:5.1f}%" if r.get("mfu") is not None else "     -"
    bubble = f"{r['bubble']:.2f}" if r.get("bubble") is not None else "-"
    val = f"{r['val_loss']:.3f}" if r.get("val_loss") is not None else "-"
    return (f"{r['layout']:26} ok   {r['precision']:5} {1e3 * r['step_time']:8.1f} ms "
            f"{r['tokens_per_second']:>10,.0f} tok/s MFU {mfu}  mem {r['peak_mem_gb']:6.2f} GB  "
            f"loss {r['loss_first']:.3f}>{r['loss_last']:.3f}  val {val}  "
            f"bubble {bubble}  dcp {r.get('dcp', '-')}  {r['seconds']:.0f} s")


# ---------------------------------------------------------------- the parent: children, files

class Check:
    def __init__(self, a, kind: str, out: Path):
        self.a, self.kind, self.out = a, kind, out
        self.rows_file = out / "rows.jsonl"
        self.rows: dict[str, dict] = {}
        self.modules: list[dict] = []
        self.result = {"benchmark": "gpu_check", "kind": kind, "machine": machine(),
                       "command": " ".join([Path(sys.argv[0]).name, *sys.argv[1:]]),
                       "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                       "ray_imported": "ray" in sys.modules, "layouts": []}
        self.started = time.perf_counter()
        self.proc = None
        self.seen = 0  # lines of rows.jsonl read

    def left(self) -> float:
        return self.a.budget - (time.perf_counter() - self.started)

    def write(self) -> None:
        """gpu_check.json, whole, through a rename: a reader never sees half a file."""
        self.result["layouts"] = list(self.rows.values())
        self.result["seconds"] = time.perf_counter() - self.started
        tmp = self.out / "gpu_check.json.tmp"
        tmp.write_text(json.dumps(self.result, indent=2) + "\n")
        tmp.replace(self.out / "gpu_check.json")

    def read_rows(self) -> list[str]:
        """The records rows.jsonl got since the last read: rows kept; returns the layouts
        started."""
        text = self.rows_file.read_text() if self.rows_file.exists() else ""
        lines = text.split("\n")[:-1]  # whole lines only: the last may be in the writing
        started = []
        for line in lines[self.seen:]:
            r = json.loads(line)
            if r.get("event") == "start":
                started.append(r["layout"])
            elif r.get("event") == "modules":
                self.modules.append(r)
            else:
                self.rows[r["layout"]] = r
        if len(lines) > self.seen:
            self.seen = len(lines)
            self.write()
        return started

    def run_child(self, names: list[str]) -> list[str]:
        """Run `names` in one child; returns the ones it did not reach (it died or ran out of
        time: the layout it was on gets an error row)."""
        cmd = [sys.executable, str(Path(__file__).resolve()), "--child", "--out-dir", str(self.out),
               "--layouts", ",".join(names), "--steps", str(self.a.steps)] + \
            (["--smoke"] if self.kind == "smoke" else [])
        self.proc = subprocess.Popen(cmd)
        current = None
        while True:
            code = self.proc.poll()
            started = self.read_rows()
            current = started[-1] if started else current
            if code is not None:
                break
            if self.left() <= 0:
                self.proc.kill()
                self.proc.wait()
                code = "killed: out of --budget"
            time.sleep(0.5)
        self.proc = None
        missing = [n for n in names if n not in self.rows]
        if current in missing:
            why = f"exit {code}" if isinstance(code, int) else code
            self.rows[current] = {"layout": current, "status": f"error: its process ended ({why})"}
            print(table_line(self.rows[current]), flush=True)
            missing.remove(current)
            self.write()
        return missing

    def run(self, names: list[str]) -> None:
        eager = [n for n in names if not BY_NAME[n][0].get("compile")]
        jobs = [eager] + [[n] for n in names if n not in eager]
        while jobs:
            job = jobs.pop(0)
            if not job:
                continue
            if self.left() <= 0:
                for n in job:
                    self.rows[n] = {"layout": n, "status": "skipped: out of --budget"}
                continue
            rest = self.run_child(job)
            if rest:
                jobs.insert(0, rest)
        self.write()

    def throughput(self) -> None:
        """bench/gpu_throughput.py in a process of its own: gpt2 eager and compiled."""
        out = self.out / "gpu_throughput.json"
        args = ["--smoke"] if self.kind == "smoke" else [
            "--batch-sizes", "16", "--modes", "eager,compile", "--steps", "20", "--warmup", "5"]
        if self.left() <= 0:
            self.result["gpt2"] = {"status": "skipped: out of --budget"}
            return
        try:
            subprocess.run([sys.executable, str(ROOT / "bench" / "gpu_throughput.py"), "--out",
                            str(out), *args], check=True, timeout=max(1.0, self.left()))
            self.result["gpt2"] = json.loads(out.read_text())
        except (subprocess.SubprocessError, OSError, ValueError) as e:
            self.result["gpt2"] = {"status": f"error: {type(e).__name__}: {e}"}
        self.write()

    def finish(self) -> int:
        import gpu_check_memory

        gpt = [r.pop("init_sums") for r in self.rows.values()
               if "init_sums" in r and r.get("arch") == "gpt" and r["settings"].get("model") != "gpt2"]
        for r in self.rows.values():
            r.pop("init_sums", None)
        self.result["gpt_layouts_start_equal"] = bool(gpt) and all(s == gpt[0] for s in gpt)
        self.result["modules"] = self.modules
        self.result["memory_plan"] = gpu_check_memory.memory_plan(self.result, self.kind)
        self.write()
        print(f"GPT layouts start from the same weights: {self.result['gpt_layouts_start_equal']}")
        for line in gpu_check_memory.lines(self.result):
            print(line)
        print(f"{self.result['seconds']:.0f} s; written: {self.out / 'gpu_check.json'}")
        # a row whose path this tree lacks (document masking) is no failure
        ok = self.rows and all(r["status"] == "ok" or r["status"].startswith("not available")
                               for r in self.rows.values())
        return 0 if ok and self.result["gpt_layouts_start_equal"] else 1


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out-dir", required=True, help="folder for gpu_check.json, rows.jsonl and "
                   "gpu_throughput.json (created if need be; its earlier files replaced)")
    p.add_argument("--smoke", action="store_true", help="small models on the CPU: the same code")
    p.add_argument("--steps", type=int, default=None, help="timed steps per layout [5; smoke 3]")
    p.add_argument("--layouts", default=None, help="comma-separated layout names [all]")
    p.add_argument("--budget", type=float, default=None,
                   help="seconds for the layouts and gpt2 [420; smoke 1500]; none starts later")
    p.add_argument("--skip-throughput", action="store_true", help="layouts only")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    kind = "smoke" if a.smoke else "gpu"
    a.steps = a.steps or (5 if kind == "gpu" else 3)
    a.budget = a.budget or (BUDGET_S if kind == "gpu" else 1500.0)
    names = [n.strip() for n in a.layouts.split(",")] if a.layouts else [n for n, _, _ in LAYOUTS]
    unknown = [n for n in names if n not in BY_NAME]
    if unknown or a.steps < 1:
        print(f"error: unknown layout {unknown[0]!r}; the layouts: {', '.join(BY_NAME)}" if unknown
              else "error: --steps must be at least 1", file=sys.stderr)
        return 2
    out = Path(a.out_dir)
    if a.child:
        return child(names, kind, a.steps, out / "rows.jsonl")
    import torch

    if kind == "gpu" and not torch.cuda.is_available():
        print("error: no CUDA GPU here; pass --smoke for the same check on a CPU", file=sys.stderr)
        return 2
    try:
        import_all()
    except ImportError as e:
        print(f"error: this host cannot run the check: {e}", file=sys.stderr)
        return 2
    out.mkdir(parents=True, exist_ok=True)
    (out / "rows.jsonl").write_text("")  # this run's rows only
    check = Check(a, kind, out)
    check.result["expected_s"] = expected_seconds(names, not a.skip_throughput)
    print(f"{len(names)} rows; expected on an H100: {check.result['expected_s']:.0f} s "
          f"(--budget {a.budget:.0f} s)", flush=True)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # the outer timeout: write, stop
    # The most wanted figures first, should the budget run out: every eager layout, gpt2
    # compiled (its MFU), gpt2 in gpu_throughput's loop, then the other compiled layouts.
    later = [n for n in names if BY_NAME[n][0].get("compile") and BY_NAME[n][0].get("model") != "gpt2"]
    try:
        check.write()
        check.run([n for n in names if n not in later])
        if not a.skip_throughput:
            check.throughput()
        check.run(later)
    finally:
        if check.proc is not None:
            check.proc.kill()
        check.read_rows()  # whatever a child finished before it was stopped
        check.write()
    return check.finish()


if __name__ == "__main__":
    raise SystemExit(main())
