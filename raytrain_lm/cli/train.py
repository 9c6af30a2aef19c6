"""`train` and `plan`."""

from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Optional

import typer

from raytrain_lm.cli.app import app, examples
from raytrain_lm.cli.options import (
    CONFIG_FILE,
    JSON,
    PARAM,
    QUIET,
    SET,
    TRACK,
    VERBOSE,
    ConfigPath,
    SetList,
    only_json_on_stdout,
    say_for,
    settings,
)
from raytrain_lm.cluster.jobs import PATH_SETTINGS
from raytrain_lm.config.layout import STRATEGIES
from raytrain_lm.config.load import build_config
from raytrain_lm.config.presets import PRESETS, preset_help
from raytrain_lm.config.settings import default_storage
from raytrain_lm.config.sizes import parse_workers
from raytrain_lm.errors import UserError
from raytrain_lm.models import FAMILIES
from raytrain_lm.plan.estimate import check_cluster
from raytrain_lm.plan.goodput import DEFAULT_MTBF_GPU_HOURS, DEFAULT_RESTART_S, RunRisk
from raytrain_lm.plan.hardware import kind_cluster
from raytrain_lm.plan.kinds import DEFAULT_KIND, kinds
from raytrain_lm.plan.noise_scale import BatchAdvice
from raytrain_lm.plan.printout import plan_command
from raytrain_lm.results.tables import progress_line, results_table
from raytrain_lm.setting import listing, named
from raytrain_lm.store.hf_folder import folder_model
from raytrain_lm.tune.lr_scaling import apply_lr_scaling

# Help generated from the registries (models/family.py's FAMILIES, config/parallelism.py's
# STRATEGIES): a new family or strategy names itself here.
ARCH = typer.Option(None, help="The model's architecture: " + listing(named(
    {f.name: f.summary for f in FAMILIES.values()})) + " [default: the preset's]. The preset's "
    "shape in that architecture; model.* settings (--set) choose the rest.")
HF_RELEASES = ", ".join(r for f in FAMILIES.values() for r in f.hf_releases)
TRAIN_HELP = (f"Train a {listing([f.title for f in FAMILIES.values()])} model with Ray Train "
              f"(DDP over gloo on CPU, NCCL on GPU).")
# `--workers` is train's own option (N or MIN-MAX), not generated from the setting.
TRAIN_SETTINGS = ("use_gpu", "preset", "data", "max_steps", "batch_size", "seq_len", "lr",
                  "grad_accum", "log_every", "log_seconds", "eval_every", "checkpoint_every",
                  "keep_checkpoints",
                  "checkpoint_upload", "max_failures", "max_preemptions", "resize_interval",
                  "seed", "compile", "strategy", "tp", "pp", "ep", "microbatches", "pp_schedule",
                  "virtual_stages", "layout", "gpus_per_node", "gpu_memory_gb",
                  "sequence_parallel", "activation_checkpointing", "precision", "name", "storage",
                  "address", "scale_timeout",
                  "cp", "doc_mask", "mtbf")


def workers_value(text: str):
    """--workers as parsed: N as a number, MIN-MAX as given (both checked here, before anything
    starts or is sent to a cluster)."""
    try:
        low, high = parse_workers(text)
    except UserError as e:
        raise typer.BadParameter(str(e)) from None
    return high if str(text).strip().lstrip("-").isdigit() else f"{low}-{high}"


@app.command(epilog=examples("python cli.py train",
                             "python cli.py train --workers 2 --max-steps 300 --preset tiny",
                             "python cli.py train --workers 8 --use-gpu --preset gpt2 --data data/stdlib",
                             "python cli.py train --workers 2-8 --use-gpu --preset gpt2 --data s3://bucket/data/stdlib",
                             "python cli.py train --workers 4 --tp 2    # 2-way data x 2-way tensor parallel",
                             "python cli.py train --arch llama --preset tiny    # a small Llama",
                             "python cli.py train --preset llama-tiny --workers 4 --tp 2",
                             "python cli.py train --workers 4 --pp 2 --microbatches 8 --pp-schedule 1f1b",
                             "python cli.py train --workers 8 --tp 2 --pp 2 --strategy fsdp",
                             "python cli.py train --workers 16 --use-gpu --preset llama3-8b --layout auto",
                             "python cli.py train --init-from Llama-3.2-1B --data data/llama3 --use-gpu --layout auto",
                             "python cli.py train --config best.yaml --set model.dropout=0.1",
                             "python cli.py train --config best.yaml --workers 8 --scale-lr sqrt",
                             "python cli.py train --name my-run --resume",
                             "MLFLOW_TRACKING_URI=http://mlflow:5000 python cli.py train --track mlflow",
                             "WANDB_PROJECT=lm python cli.py train --track wandb --track mlflow"),
             help=TRAIN_HELP)
@settings(*TRAIN_SETTINGS)
def train(
    settings: dict,
    workers: Optional[str] = typer.Option(None, "--workers", metavar="N|MIN-MAX", show_default=False,
                                          parser=workers_value,
                                          help="Ray Train workers (one process each): N, or "
                                          "MIN-MAX to start as soon as MIN fit and grow and "
                                          "shrink with the cluster (elastic); 0: no Ray cluster, "
                                          "Ray Train's local mode in this process (under "
                                          "torchrun: its ranks) [default: 2]."),
    force: bool = typer.Option(False, help="Launch even if the memory plan says it will not fit."),
    config: ConfigPath = CONFIG_FILE,
    set_: SetList = SET,
    resume: bool = typer.Option(False, help="Continue the run --name from its latest checkpoint."),
    init_from: Optional[Path] = typer.Option(None, help="Start from these weights with a fresh "
                                             "optimizer: a checkpoint, a run (its best), or a "
                                             f"Hugging Face folder ({HF_RELEASES}), "
                                             "whose config.json is the model."),
    arch: Optional[str] = ARCH,
    param: Optional[str] = PARAM,
    scale_lr: str = typer.Option("none", help="Scale lr to this run's global batch from the one it was "
                                 "chosen at (ref_batch_tokens): none, linear or sqrt (recommended for AdamW); under "
                                 "--param sp also x sqrt(ref_width / width), under mup not (its groups carry the "
                                 "width)."),
    worker_env: SetList = typer.Option(None, "--worker-env", help="An environment variable of the "
                                       "worker processes, KEY=VALUE (e.g. NCCL_DEBUG=INFO); repeat for several."),
    track: SetList = TRACK,
    verbose: bool = VERBOSE,
    quiet: bool = QUIET,
    as_json: bool = JSON,
) -> None:
    """Train a model with Ray Train (its help: TRAIN_HELP, from the families)."""
    from raytrain_lm.run.driver import run_training, saved_config

    local = workers is not None and str(workers) == "0"  # Ray Train's local mode (run/in_process.py)
    if local:  # this process, or torchrun's ranks: a fixed size
        from raytrain_lm.run.in_process import local_place

        settings["min_workers"] = settings["workers"] = local_place()[1]
    elif workers is not None:  # N is a fixed size: MIN = MAX
        settings["min_workers"], settings["workers"] = parse_workers(str(workers))
    if arch is not None:
        settings["model"] = {"arch": arch}
    if param is not None:
        settings["model"] = {**(settings.get("model") or {}), "param": param}
    base = None
    if resume:  # the run continues where it is found: --storage, else the default storage
        settings = {**settings, "storage": settings["storage"] or default_storage()}
        base = saved_config(settings["storage"], settings["name"])
    cfg = build_config(config_file=str(config) if config else None, flags=settings, sets=set_,
                       base=base, folder=folder_model(init_from) if init_from else None)
    worker_env = parse_env(worker_env or [])
    if local:
        from raytrain_lm.run.in_process import check_local, run_local

        check_local(cfg, (base or {}).get("max_failures", 0), worker_env)
        launch = functools.partial(run_local, verbose=verbose)
    else:
        launch = functools.partial(run_training, verbose=verbose, worker_env=worker_env)
    say = say_for(quiet, as_json)
    scaled = apply_lr_scaling(cfg, scale_lr)
    if scaled:
        say(scaled)
    # the gradient noise scale's batch hint: once during the run, when settled, and after it
    advice = BatchAdvice(cfg.tokens_per_step / cfg.seq_len)

    def show(row) -> None:
        hint = advice.update(row)
        if not (quiet or as_json):
            typer.echo(progress_line(row, cfg.max_steps))
            if hint:
                typer.echo(f"hint: {hint}")
    with only_json_on_stdout(as_json) as stdout:
        summary = launch(cfg, resume=resume, init_from=str(init_from) if init_from else None,
                         force=force, say=say, on_metrics=show, track=track, figure=curves)
        if summary is None:  # a torchrun rank other than 0: rank 0 prints
            return
        if as_json:
            typer.echo(json.dumps({k: v for k, v in summary.items() if k != "config"}, indent=2),
                       file=stdout)
            return
    typer.echo(results_table(summary))
    typer.echo(f"results: {summary['run_dir']}/summary.json, metrics.jsonl")
    hint = advice.after_run()
    if hint:
        typer.echo(f"hint: {hint}")


def curves(runs) -> bytes:
    """The report's figure of `runs` (for the tracking runs: matplotlib imported only then)."""
    from raytrain_lm.results.plots import plot_runs

    return plot_runs(runs)


def parse_env(items: list[str]) -> dict[str, str]:
    """["KEY=VALUE", ...] -> {KEY: VALUE}."""
    env = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key.strip() or not key.replace("_", "").isalnum():
            raise UserError(f"--worker-env expects KEY=VALUE, got {item!r}")
        env[key.strip()] = value
    return env


def parse_train_args(args: list[str]) -> dict:
    """What `train` would parse from `args` (after `--` of `submit`): {parameter: value}. Bad
    arguments fail here, before anything is sent to a cluster."""
    import typer.main

    command = typer.main.get_command(app).commands["train"]
    args = args[1:] if args[:1] == ["train"] else args
    with command.make_context("train", list(args)) as ctx:
        return dict(ctx.params)


def train_paths(args: list[str]) -> dict:
    """The paths `train` would get from `args`: storage, data, config, init_from (None if absent)."""
    parsed = parse_train_args(args)
    return {k: None if parsed[k] is None else str(parsed[k]) for k in PATH_SETTINGS}


@app.command(epilog=examples("python cli.py plan --preset gpt2 --gpus 8",
                             "python cli.py plan --preset qwen2.5-7b --gpus 16 --gpu-memory-gb 80",
                             "python cli.py plan --init-from Llama-3.2-1B --gpus 8",
                             "python cli.py plan --preset gpt-70b --gpus 64 --gpus-per-node 8 --gpu-memory-gb 80",
                             "python cli.py plan --preset gpt-70b --gpus 512 --tp 8 --strategy fsdp --json",
                             "python cli.py plan --preset llama3-8b --gpus 8 --explain tp=1,pp=1,strategy=fsdp",
                             "python cli.py plan --preset llama2-70b --gpus 64 --gpus-per-node 8 --gpu-memory-gb 80",
                             "python cli.py plan --preset small --set model.n_layer=24 --batch-size 32"))
@settings("batch_size", "seq_len", "grad_accum", "precision",
          help={"batch_size": "Sequences per GPU per micro-step under plain data parallelism: the "
                              "global batch, the same for every layout, is GPUs x this x "
                              "--grad-accum unless --global-batch gives it [default: the "
                              "preset's].",
                "precision": "The run's precision: activations, checkpointed block inputs, "
                             "gathered parameters and pipeline sends take 2 bytes in bf16/fp16, "
                             "4 in fp32; auto: bf16 on GPU, fp32 with --cpu."})
def plan(
    settings: dict,
    preset: Optional[str] = typer.Option(None, help=preset_help() + " Any field overridable "
                                         "with --set [default: gpt2, or --init-from's model]."),
    init_from: Optional[Path] = typer.Option(None, help="Plan the model of this Hugging Face "
                                             "folder (its config.json)."),
    gpus: int = typer.Option(8, "--gpus", "--workers", help="GPUs (workers) in all."),
    gpu: str = typer.Option(DEFAULT_KIND, "--gpu", help="The GPU kind, whose peak, memory, HBM, "
                            "links, node and achievable rates the plan takes (raytrain_lm/plan/"
                            "gpu_kinds.json, with sources): " + ", ".join(kinds()) + "; the flags "
                            "below override its figures."),
    gpus_per_node: Optional[int] = typer.Option(None, help="GPUs per node: tensor parallelism stays "
                                                "inside one [default: the kind's node: 8 GPUs, a GH200's 4]."),
    gpu_memory_gb: Optional[float] = typer.Option(None, help="Memory per GPU in GiB, as cards are "
                                                  "sold (80 for an 80 GB card, 80 x 2^30 bytes), "
                                                  "less 1 GiB for CUDA and NCCL [default: the "
                                                  "kind's]."),
    global_batch: Optional[int] = typer.Option(None, help="Sequences per step, any number a "
                                               "layout's data-parallel size divides [default: "
                                               "GPUs x --batch-size x --grad-accum]."),
    intra_node_gbps: Optional[float] = typer.Option(None, help="GPU links inside a node, Gb/s per "
                                                    "GPU per direction [default: the kind's; "
                                                    "H100 NVLink 4: 450 GB/s = 3600 Gb/s]."),
    inter_node_gbps: Optional[float] = typer.Option(None, help="The node's NICs between nodes, Gb/s "
                                                    "per GPU per direction: all NICs' Gb/s over the "
                                                    "GPUs per node [default: the kind's node; "
                                                    "DGX H100: 8 x 400 / 8 = 400]."),
    gpu_tflops: Optional[float] = typer.Option(None, help="Peak dense bf16 TFLOP/s per GPU (fp16 "
                                               "on a GPU without bf16 units) [default: the kind's]."),
    hbm_tbps: Optional[float] = typer.Option(None, help="HBM bandwidth per GPU, TB/s [default: "
                                             "the kind's]."),
    compute_efficiency: Optional[float] = typer.Option(None, help="A constant fraction of the "
                                                       "peak for every FLOP of every layout, "
                                                       "instead of plan/kernels.py's rates."),
    peak_fraction: Optional[float] = typer.Option(None, help="The fraction of the peak large "
                                                  "matmuls reach [default: the kind's measured "
                                                  "MAMF / peak, x the fitted clock factor of a "
                                                  "power-capped part]."),
    tp: Optional[int] = typer.Option(None, help="Only layouts with this tensor-parallel degree."),
    pp: Optional[int] = typer.Option(None, help="Only layouts with this many pipeline stages."),
    ep: Optional[int] = typer.Option(None, help="A mixture of experts: only layouts with this "
                                     "expert-parallel degree [default: every one that divides the "
                                     "data-parallel size and the experts]."),
    strategy: Optional[str] = typer.Option(None, help="Only layouts whose data-parallel dimension is "
                                           f"this: {listing(STRATEGIES)}."),
    virtual_stages: Optional[int] = typer.Option(None, help="Only pipelines of interleaved-1f1b "
                                                 "with this many stages per GPU [default: 2 to "
                                                 "8 tried]."),
    explain: Optional[str] = typer.Option(None, metavar="LAYOUT", help="Explain one layout: its "
                                          "step time (compute, exposed tp, bubble, exposed pp, "
                                          "exposed dp) and memory, by part. LAYOUT: a row "
                                          "number, or keys such as tp=8,pp=4,strategy=ddp,"
                                          "ac=full (tp, pp, dp, strategy, ac, sp, schedule, v, b)."),
    top: int = typer.Option(10, help="Layouts shown, fastest first."),
    show_all: bool = typer.Option(False, "--all", help="Show every layout planned."),
    mtbf: float = typer.Option(DEFAULT_MTBF_GPU_HOURS, help="Goodput: GPU-hours between failures of "
                               "one GPU (its share of node, NIC and switch failures); the job's MTBF "
                               "is this over the GPUs [default: Llama 3 405B's, 419 interruptions in "
                               "54 days on 16,384 H100s]."),
    storage_gbps: Optional[float] = typer.Option(None, help="Goodput: the checkpoint storage's "
                                                 "bandwidth in all, GB/s [default: Llama 3's 2 TB/s "
                                                 "over 16,384 GPUs, times --gpus]."),
    restart_min: float = typer.Option(DEFAULT_RESTART_S / 60, help="Goodput: minutes from a failure "
                                      "to training again, before reading the checkpoint (an "
                                      "assumption: docs/planner.md#goodput)."),
    tokens: Optional[float] = typer.Option(None, help="Goodput: tokens to train, for the run's "
                                           "length [default: 20 a parameter, Chinchilla's]."),
    vocab_size: Optional[int] = typer.Option(None, help="The tokenizer's vocabulary, padded "
                                             "[default: the preset's (Llama 2: 32000, Llama 3: "
                                             "128256), else GPT-2's BPE, 50304; the byte "
                                             "tokenizer: 256]."),
    arch: Optional[str] = ARCH,
    cpu: bool = typer.Option(False, help="Plan for CPU workers (fp32 activations)."),
    budget: Optional[str] = typer.Option(None, metavar="FLOPS|Ngpu-h", help="A compute budget in "
                                         "FLOPs (C = 6 N D) or GPU-hours (e.g. 1e6gpu-h: converted "
                                         "at the 6N FLOPs per second of the planner's fastest "
                                         "layout for the model): plan the compute-optimal model of "
                                         "--law for it (its shape replaces the preset's), its "
                                         "tokens and steps."),
    law: str = typer.Option("chinchilla", help="With --budget: 'chinchilla' (Hoffmann et al.'s "
                            "published approach-3 fit) or a fit's JSON (tune --scaling's scaling.json)."),
    tokens_per_param: Optional[float] = typer.Option(None, help="With --budget: this many tokens per "
                                                     "parameter instead of the law's optimum "
                                                     "(Chinchilla's approaches 1-2: about 20)."),
    noise_scale: Optional[float] = typer.Option(None, help="With --budget: a measured gradient noise "
                                                "scale B_simple in sequences (train's progress line "
                                                "'B_noise'): the global batch is the power of two "
                                                "nearest it."),
    set_: SetList = SET,
    as_json: bool = JSON,
) -> None:
    """Every (dp, tp, pp) layout of the GPUs: memory per GPU, communication, estimated step time;
    the fastest that fits, and why. With --budget: first the compute-optimal model for it."""
    cluster = kind_cluster(gpu, gpus, gpus_per_node=gpus_per_node, memory_gb=gpu_memory_gb,
                           intra_gbps=intra_node_gbps, inter_gbps=inter_node_gbps, tflops=gpu_tflops,
                           hbm_tbps=hbm_tbps, efficiency=compute_efficiency,
                           peak_fraction=peak_fraction, gpu=not cpu,
                           precision=settings.get("precision") or "auto")
    check_cluster(cluster)
    risk = RunRisk(mtbf, storage_gbps, restart_min * 60, tokens)
    folder = folder_model(init_from) if init_from else None
    if init_from and folder is None:
        raise UserError(f"--init-from {init_from} is not a Hugging Face model folder (config.json "
                        f"and safetensors): plan takes one, or --preset")
    if folder is None:
        preset = preset or "gpt2"
        preset_vocab = PRESETS.get(preset, {}).get("model", {}).get("vocab_size")
        vocab_size = vocab_size or preset_vocab or 50304
    model = {**({"vocab_size": vocab_size} if vocab_size else {}), **({"arch": arch} if arch else {})}
    cfg = build_config(preset=preset, sets=set_, flags={**settings, "workers": gpus, "model": model},
                       folder=folder)
    if budget is not None:  # plan/budget.py: the model and the batch for the budget
        from raytrain_lm.plan.budget import budget_plan, gpu_hours_plan, load_law, parse_budget, planner_rate

        amount, in_hours = parse_budget(budget)
        sizing = dict(law=load_law(law), base=cfg.model, seq_len=cfg.seq_len, noise_scale=noise_scale,
                      tokens_per_param=tokens_per_param)
        if in_hours:
            rate = planner_rate(cluster, cfg.seq_len, lambda s: global_batch or s.global_batch or
                                cluster.gpus * cfg.batch_size * cfg.grad_accum, tp=tp, pp=pp,
                                strategy=strategy, virtual_stages=virtual_stages, ep=ep)
            sized = gpu_hours_plan(amount, rate, cluster.tflops * 1e12, **sizing)
        else:
            sized = budget_plan(amount, **sizing)
        cfg.model = sized.model
        preset = f"the compute-optimal {cfg.model.arch} for {sized.flops:.3g} FLOPs"
        global_batch = global_batch or sized.global_batch
        if tokens is None:  # the goodput's run trains the budget's tokens
            risk = RunRisk(mtbf, storage_gbps, restart_min * 60, sized.tokens)
        if as_json:
            out = json.loads(plan_command(cfg, cluster, tp=tp, pp=pp, strategy=strategy, top=top,
                                          show_all=show_all, as_json=True, global_batch=global_batch,
                                          virtual_stages=virtual_stages, explain=explain, ep=ep,
                                          risk=risk))
            typer.echo(json.dumps({"budget": sized.as_dict(), **out}, indent=2))
            return
        typer.echo(sized.text() + "\n")
    typer.echo(plan_command(cfg, cluster, tp=tp, pp=pp, strategy=strategy, top=top,
                            show_all=show_all, as_json=as_json, global_batch=global_batch,
                            virtual_stages=virtual_stages, explain=explain, ep=ep,
                            name=f"the {cfg.model.arch} of {init_from}" if folder else
                            preset if budget is not None else None,
                            risk=risk))
