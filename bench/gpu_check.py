"""One GPU, no Ray: does every layout's per-worker code run, and how fast is the gpt2 step?

A prepared check for a machine with one GPU (torch, pyarrow and typer; Ray need not be there):
1. every layout as a Ray Train worker builds and steps it (step.TrainStep, parallel.parallelize)
   in a process group of one rank: DDP (DistributedDataParallel in place of Ray's prepare_model),
   FSDP2, tensor parallelism (with sequence parallelism), a pipeline, all three at once, the
   Llama; activation checkpointing, bf16, fp16 with the gradient scaler, fp32 (TF32), compile.
   Mesh dims of one rank are applied all the same (parallelize's `force`), so the code that
   runs is the code of a larger run (not the interleaved schedule: its two stages on one rank
   would both hold the tied embedding, which no real layout does); a few steps each on random
   tokens. Each layout's initial
   weights are summed: every GPT layout must start from the same values (model.init_device);
2. the gpt2 preset's tokens/s and MFU, eager and compiled (bench/gpu_throughput.py);
3. the memory plan (raytrain_lm.plan) against the measured max_memory_allocated of that step.
Prints one table and writes JSON (--out). Targets on a GPU: every layout runs; gpt2 bf16 at 50%
MFU or more on one H100/H200.

    python bench/gpu_check.py --out bench/results/gpu_check.json      # about 5 minutes on an H100
    python bench/gpu_check.py --smoke --out /tmp/gpu_check.json       # the same on a CPU, small
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # run from a checkout: the package need not be installed
sys.path.insert(0, str(ROOT / "bench"))

from raytrain_lm.config.settings import TrainConfig  # noqa: E402

# (name, TrainConfig settings, dims forced on one rank); the model's shape comes from MODEL.
LAYOUTS = [
    ("ddp", {}, ()),
    ("ddp fp16+scaler", {"precision": "fp16"}, ()),
    ("ddp fp32 (tf32)", {"precision": "fp32"}, ()),
    ("ddp full-ac", {"activation_checkpointing": "full"}, ()),
    ("ddp compile", {"compile": True}, ()),
    ("fsdp", {"strategy": "fsdp"}, ("fsdp",)),
    ("fsdp selective-ac", {"strategy": "fsdp", "activation_checkpointing": "selective"}, ("fsdp",)),
    ("fsdp compile", {"strategy": "fsdp", "compile": True}, ("fsdp",)),
    ("tp+sp", {"sequence_parallel": True}, ("tp",)),
    ("pp 1f1b", {}, ("pp",)),
    ("fsdp+tp+pp", {"strategy": "fsdp"}, ("fsdp", "tp", "pp")),
    ("llama fsdp+tp", {"strategy": "fsdp", "model.arch": "llama"}, ("fsdp", "tp")),
]
MODEL = {"gpu": dict(vocab_size=50304, block_size=512, n_layer=4, n_head=8, n_embd=512),
         "smoke": dict(vocab_size=256, block_size=32, n_layer=2, n_head=2, n_embd=32)}
BATCH = {"gpu": (8, 512), "smoke": (4, 32)}  # (sequences, tokens each)


class RandomBatches:
    """What the loop's loader hands a step: (inputs, targets) on the device."""

    def __init__(self, vocab: int, batch: int, seq: int, device: torch.device, seed: int = 0):
        g = torch.Generator().manual_seed(seed)
        self.x = torch.randint(0, vocab, (batch, seq), generator=g).to(device)
        self.y = torch.roll(self.x, -1, dims=1)
        self.epoch = 0

    def next(self):
        return self.x, self.y


def one_rank_group(device: torch.device) -> None:
    """A process group of this one process, as Ray Train sets up on each worker."""
    if not dist.is_initialized():
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo",
                                store=dist.HashStore(), rank=0, world_size=1)


def config(kind: str, settings: dict) -> TrainConfig:
    cfg = TrainConfig()
    for k, v in MODEL[kind].items():
        setattr(cfg.model, k, v)
    cfg.batch_size, cfg.seq_len = BATCH[kind]
    cfg.lr, cfg.warmup_steps = 3e-4, 0
    for k, v in settings.items():
        if k.startswith("model."):
            setattr(cfg.model, k.split(".", 1)[1], v)
        else:
            setattr(cfg, k, v)
    if cfg.model.arch == "llama":
        cfg.model.bias, cfg.model.multiple_of = False, 32
    return cfg


def weights_sums(parallel) -> dict[str, float]:
    """Each parameter's sum by its name in the model (wrappers' name parts left out)."""
    from raytrain_lm.parallel.fsdp import local

    sums, seen = {}, set()
    for part in parallel.parts:
        for name, p in part.named_parameters():
            if id(p) in seen:
                continue
            seen.add(id(p))
            name = name.replace("_checkpoint_wrapped_module.", "").replace("_orig_mod.", "")
            sums[name] = float(local(p.detach()).double().sum())
    return sums


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def run_layout(name: str, settings: dict, force: tuple, kind: str, device: torch.device,
               steps: int) -> dict:
    from torch.nn.parallel import DistributedDataParallel

    from raytrain_lm.parallel.fsdp import to_float
    from raytrain_lm.worker.metrics import peak_memory_gb
    from raytrain_lm.worker.step import TrainStep

    cfg = config(kind, settings)
    row = {"layout": name, "settings": settings, "force": list(force), "status": "ok"}
    torch._dynamo.reset()
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    torch.manual_seed(cfg.seed)
    try:
        wrap = (lambda m: DistributedDataParallel(m, device_ids=[device] if device.type == "cuda"
                                                  else None)) if not force else None
        step = TrainStep(cfg, device, force=frozenset(force), ddp_wrap=wrap)
        row.update(precision=step.precision, fsdp_mixed=step.model.mixed_by_fsdp,
                   init_sums=weights_sums(step.model), arch=cfg.model.arch)
        batches = RandomBatches(cfg.model.vocab_size, cfg.batch_size, cfg.seq_len, device)
        step.train()
        losses, times = [], []
        for _ in range(steps + 1):  # the first: compilation, allocation
            t0 = time.perf_counter()
            loss, norm, _ = step(batches, cfg.lr)
            sync(device)
            times.append(time.perf_counter() - t0)
            losses.append(float(loss))
        row.update(loss_first=losses[0], loss_last=losses[-1], grad_norm=to_float(norm),
                   first_step_s=times[0], step_ms=1e3 * sorted(times[1:])[len(times[1:]) // 2],
                   peak_mem_gb=peak_memory_gb(device),
                   scale=step.scaler.get_scale() if step.scaler.is_enabled() else None)
        if not all(math.isfinite(x) for x in losses):
            row["status"] = "non-finite loss"
        elif not losses[-1] <= losses[0]:  # (fp16: the scaler may skip a first step)
            row["status"] = "loss did not fall"
        del step
    except Exception as e:  # one layout's failure is a row, not the end of the check
        row.update(status=f"error: {type(e).__name__}: {str(e).splitlines()[0][:160]}")
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return row


def throughput(kind: str, out_dir: Path, batch: int) -> dict:
    """bench/gpu_throughput.py in this process: the gpt2 step eager and compiled."""
    import gpu_throughput

    out = out_dir / "gpu_throughput.json"
    argv = ["--out", str(out)] + (["--smoke"] if kind == "smoke" else
                                  ["--batch-sizes", str(batch), "--modes", "eager,compile",
                                   "--steps", "20", "--warmup", "5"])
    gpu_throughput.main(argv)
    return json.loads(out.read_text())


def memory_plan(result: dict, kind: str) -> list[dict]:
    """The plan's memory for each measured (batch, mode) against max_memory_allocated."""
    import gpu_throughput
    from raytrain_lm.config.presets import preset_config
    from raytrain_lm.models.family import ModelConfig
    from raytrain_lm.plan.estimate import estimate
    from raytrain_lm.plan.hardware import GB

    model = ModelConfig(**gpu_throughput.SMOKE["model"]) if kind == "smoke" else \
        preset_config("gpt2").model
    model.vocab_size = result["model"]["vocab_size"]
    gpu = result["machine"]["device"].startswith("cuda")
    rows = []
    for r in result["results"]:
        if r["status"] != "ok":
            continue
        plan = estimate(model, 1, "ddp", "none", r["batch_size"], result["model"]["seq_len"],
                        gpu=gpu)
        rows.append({"mode": r["mode"], "batch_size": r["batch_size"], "plan_gb": plan.total / GB,
                     "measured_gb": r["peak_mem_gb"], "ratio": plan.total / GB / r["peak_mem_gb"]})
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, help="JSON file for the results")
    p.add_argument("--smoke", action="store_true", help="a small model on the CPU: the same code")
    p.add_argument("--steps", type=int, default=None, help="timed steps per layout [3; smoke 2]")
    p.add_argument("--layouts", default=None, help="comma-separated layout names [all]")
    p.add_argument("--batch-size", type=int, default=16, help="gpt2's micro-batch [16]")
    p.add_argument("--skip-throughput", action="store_true", help="layouts only")
    a = p.parse_args(argv)
    kind = "smoke" if a.smoke else "gpu"
    if kind == "gpu" and not torch.cuda.is_available():
        print("error: no CUDA GPU here; pass --smoke for the same check on a CPU", file=sys.stderr)
        return 2
    device = torch.device("cuda", 0) if kind == "gpu" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
        torch.set_float32_matmul_precision("high")  # as a GPU worker does (loop.py)
    one_rank_group(device)
    steps = a.steps or (3 if kind == "gpu" else 2)
    wanted = set(a.layouts.split(",")) if a.layouts else None
    started = time.perf_counter()
    rows = [run_layout(name, s, f, kind, device, steps) for name, s, f in LAYOUTS
            if wanted is None or name in wanted]
    sums = [r.pop("init_sums") for r in rows if "init_sums" in r and r["arch"] == "gpt"]
    for r in rows:
        r.pop("init_sums", None)
    result = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
              "torch": torch.__version__, "cuda": torch.version.cuda,
              "ray_imported": "ray" in sys.modules, "layouts": rows,
              "gpt_layouts_start_equal": bool(sums) and all(x == sums[0] for x in sums)}
    if not a.skip_throughput:
        with tempfile.TemporaryDirectory() as tmp:
            result["gpt2"] = throughput(kind, Path(tmp), a.batch_size)
        result["memory_plan"] = memory_plan(result["gpt2"], kind)
    result["seconds"] = time.perf_counter() - started
    dist.destroy_process_group()

    print(f"\n{'layout':20} {'status':8} {'prec':5} {'ms/step':>8} {'first s':>8} "
          f"{'mem GB':>7} {'loss':>13}")
    for r in rows:
        if r["status"] == "ok":
            print(f"{r['layout']:20} {'ok':8} {r['precision']:5} {r['step_ms']:8.1f} "
                  f"{r['first_step_s']:8.1f} {r['peak_mem_gb']:7.2f} "
                  f"{r['loss_first']:6.3f}>{r['loss_last']:6.3f}")
        else:
            print(f"{r['layout']:20} {r['status']}")
    print(f"GPT layouts start from the same weights: {result['gpt_layouts_start_equal']}")
    for r in result.get("gpt2", {}).get("results", []):
        mfu = f"{100 * r['mfu']:.1f}%" if r.get("mfu") is not None else "-"
        print(f"gpt2 {r['mode']:8} batch {r['batch_size']}: {r.get('tokens_per_second', 0):,.0f} "
              f"tok/s, MFU {mfu}")
    for r in result.get("memory_plan", []):
        print(f"memory plan, {r['mode']} batch {r['batch_size']}: planned {r['plan_gb']:.2f} GB, "
              f"max_memory_allocated {r['measured_gb']:.2f} GB ({r['ratio']:.2f}x)")
    Path(a.out).write_text(json.dumps(result, indent=2) + "\n")
    print(f"{result['seconds']:.0f} s; written: {a.out}")
    ok = all(r["status"] == "ok" for r in rows) and result["gpt_layouts_start_equal"]
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
