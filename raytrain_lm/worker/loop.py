"""`train_loop_per_worker`: what every Ray Train worker runs, top to bottom.

restore (if this run has a checkpoint) -> model -> parallelize + optimizer -> data -> steps, a
metrics row every few steps, sent with a `ray.train.report` about once per `--log-seconds`. A
report is a barrier across ranks, so every rank follows the same deterministic cadence
(`Cadence`) of rows, reports, validations and checkpoints, plus a checkpoint at once when a node
of the run is about to be preempted (`PreemptionWatch`, the same on every rank). The worker
group may be any of the run's sizes (config/sizes.py): every size takes the same global batch
per step.
"""

from __future__ import annotations

import math
import time

import ray.train
import ray.train.torch
import torch

from raytrain_lm.config.inputs import WorkerInputs
from raytrain_lm.config.layout import Layout
from raytrain_lm.config.settings import TrainConfig
from raytrain_lm.config.sizes import fit_to_world
from raytrain_lm.data.loaders import Validation, train_stream
from raytrain_lm.data.manifest import dataset_tokenizer
from raytrain_lm.data.resolve import resolve_dataset
from raytrain_lm.errors import UserError
from raytrain_lm.models import family, flops_per_token
from raytrain_lm.parallel.mesh import all_reduce
from raytrain_lm.store import checkpoint_format as ckpt_io
from raytrain_lm.worker.cadence import Cadence
from raytrain_lm.worker.checkpointer import Checkpointer, load_init_from, restore_rng
from raytrain_lm.worker.drills import WindowLog, fault_drill, hold_drill, nan_drill
from raytrain_lm.worker.metrics import Meter, check_device_memory, gpu_peak_tflops, peak_memory_gb
from raytrain_lm.worker.optim import lr_at
from raytrain_lm.worker.preemption import PreemptionWatch
from raytrain_lm.worker.step import TrainStep


def train_loop_per_worker(inputs: WorkerInputs) -> None:
    began = time.time()  # this group's start-up, a restart's cost for --checkpoint-every auto
    cfg = TrainConfig.from_dict(inputs.train)
    cfg.data = resolve_dataset(cfg.data)  # s3://... -> verified local cache on this node
    ctx = ray.train.get_context()
    rank, world, device = ctx.get_world_rank(), ctx.get_world_size(), ray.train.torch.get_device()
    sized = fit_to_world(cfg, world)  # this size's micro-batches: the same global batch
    if sized is None:  # the trainer starts only sizes that can (scaling.py)
        raise UserError(f"a group of {world} workers cannot split this run's global batch evenly")
    check_device_memory(sized, device, inputs.force)  # the GPU's real memory
    if device.type == "cuda":
        Layout.of(sized).check_tp_within_node(ctx.get_local_world_size())  # NVLink, not the network
        torch.set_float32_matmul_precision("high")  # TF32 for any matmul left in fp32
    tokenizer = dataset_tokenizer(cfg.data)  # a BPE's file travels into every checkpoint
    checkpointer = Checkpointer(cfg, rank, world, tokenizer, inputs.fail_at, inputs.run_name,
                                inputs.hold_at)
    found = checkpointer.find_latest()  # this run's newest valid checkpoint, or None
    state, rng = ckpt_io.load_resume_state(found.path, found.meta, rank) if found else (None, None)
    coords = Layout.of(sized).coords(rank)

    # --- the model as this rank holds it (built sharded where the layout shards it), then its
    # state: a resumed run's own, else --init-from's weights, else the initial values
    baseline_mem = peak_memory_gb(device)
    # a resumed run's checkpoint or --init-from's weights fill every parameter: no initial values
    step_fn = TrainStep(sized, device, init=found is None and not inputs.init_from,
                        separator=tokenizer.eot_id)  # documents' openers, for --doc-mask
    build_mem = peak_memory_gb(device) - baseline_mem  # built sharded: only this rank's shards
    # drills.py: which windows each rank reads
    log = WindowLog.for_group(checkpointer.fs, checkpointer.run_path, rank, world) \
        if inputs.log_windows else None
    batches = train_stream(sized, coords.dp, step_fn.dp, log)  # tp, pp peers: same rows
    validation = Validation(sized, coords.dp, step_fn.dp, tokenizer.text_byte_lengths())
    if found is not None:
        step, tokens = checkpointer.restore(found, state, step_fn, batches)
    else:
        step, tokens = 0, 0
        if inputs.init_from:  # a checkpoint, or a Hugging Face folder
            checkpointer.release = load_init_from(inputs.init_from, step_fn, rank)
    restore_rng(rng, cfg.seed, rank // cfg.tp)  # the saved RNG states, else a dropout stream per rank

    n_params = family(cfg.model).counts(cfg.model).total
    fpt = flops_per_token(cfg.model, cfg.seq_len)
    cadence, preemption = Cadence(cfg, start=step), PreemptionWatch()
    step_tokens = sized.batch_size * cfg.seq_len * sized.grad_accum * step_fn.dp
    peak = gpu_peak_tflops(device, cfg.peak_tflops, step_fn.precision)
    meter = Meter(device, world, fpt, peak, n_params, baseline_mem, build_mem,
                  loss_ranks=step_fn.dp, scaler_skips=step_fn.scaler.is_enabled(),
                  noise_batches=step_fn.noise_batches)
    step_fn.train()
    while step < cfg.max_steps:
        lr = lr_at(step, cfg)
        nan_drill(inputs.nan_at, step + 1, step_fn)
        hold_drill(inputs.hold_at, step + 1, rank, world, checkpointer.fs, checkpointer.run_path)
        loss, grad_norm = step_fn(batches, lr)
        step, tokens = step + 1, tokens + step_tokens
        meter.add_step(loss, step_tokens, grad_norm, step_fn.small_sq)
        fault_drill(inputs.fail_at, step, rank, inputs.run_name)
        preempted = preemption.check(step)  # a node of the run is going: checkpoint now
        if not (cadence.rows(step) or preempted):
            continue
        # threads: what the launch line said (run/cpus.py); a preemption: the driver names it
        # as the reason of the restart
        meter.keep(step, lr, grad_norm, step_fn, tokens=tokens, epoch=batches.epoch, workers=world,
                   threads=torch.get_num_threads(), **({"preemption": preempted} if preempted else {}),
                   **cadence.take_note())
        save = cadence.checkpoints(step) or bool(preempted)
        if not (save or cadence.sends(step)):  # the row waits on this rank for the next send
            meter.next_interval(exclude_since_row=False)
            continue
        rows = meter.rows()  # every rank's values, one collective per send
        if meter.nonfinite:  # every rank alike: the run stops here, saving nothing
            checkpointer.report_stop(step, meter.nonfinite, rows[:meter.first_bad])
            return
        row = rows[-1]
        stopped = time.perf_counter()
        if cadence.validates(step):
            val, bpb = step_fn.evaluate(validation)
            row.update(val_loss=val, val_ppl=math.exp(min(val, 50.0)), val_bpb=bpb)
        if save and step_fn.replicated:
            row["replica_spread"] = meter.replica_spread(step_fn.parts[0])  # 0.0: they agree
        checkpointer.report(rows, save=save, step_fn=step_fn, stream=batches)
        if cadence.measures(step):  # --checkpoint-every auto: the same numbers on every rank
            stop_s, restart_s = all_reduce(torch.tensor(
                [time.perf_counter() - stopped, meter.first_step_unix - began], dtype=torch.float64,
                device=device), op="max").tolist()
            said = cadence.decide(step, meter.slowest_step_time, stop_s, world, restart_s)
            if rank == 0:
                print(f"[checkpoint] {said}", flush=True)
        cadence.paced(step, meter.slowest_step_time)
        meter.next_interval(exclude_since_row=save or cadence.validates(step))
    checkpointer.report_final_rows(meter.start_unix)
