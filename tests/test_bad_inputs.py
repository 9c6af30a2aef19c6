"""Bad input from a file from elsewhere, a careless flag or a damaged run, through the CLI as a
user types it: one line `error: ...` on stderr, exit code 2, no traceback, and the folder the
command ran in exactly as it was (nothing written, nothing half-written, nothing deleted).

Every command runs in a fresh folder (its cwd, so a default such as data/pydoc or runs/ would
land there and show) with RAY_ADDRESS at a closed port: input let through to the point of
reaching a cluster fails there as "no Ray cluster answers" instead of with its own line.

docs/bad-inputs.md is this module's CASES plus test_cli_errors' BAD_PATHS and BAD_NAMES, one
line each; `python tests/test_bad_inputs.py` rewrites it, and a test fails when it differs.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shlex
import socket
import sys
import threading
from dataclasses import dataclass, field
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
import crafted  # noqa: E402
from conftest import ROOT, cli_here, run_cli  # noqa: E402
from test_cli_errors import BAD_NAMES, BAD_PATHS, assert_clean_error  # noqa: E402

TABLE = ROOT / "docs" / "bad-inputs.md"


@dataclass
class Bad:
    command: str  # as typed, in the case's folder; {data}: a prepared dataset, {port}: a port
    message: str  # what the one line says (a part of it)
    setup: str = ""  # what the folder holds first (SETUPS)
    env: dict = field(default_factory=dict)
    process: bool = False  # in a process of its own (else see SUBPROCESS)
    timeout: float = 120  # seconds (a process of its own): what hung before fails, not waits


def _torchrun(**changes: str) -> dict:
    """torchrun's variables for rank 0 of 2 on one node, with `changes`."""
    return {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2",
            "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500", **changes}


CASES = [
    # numbers that no check before launch caught (`nan <= 0` is False) ---------------- item 10
    Bad("train --data {data} --lr nan", "flags: lr must be a finite number, got nan"),
    Bad("train --data {data} --lr inf", "flags: lr must be a finite number, got inf"),
    Bad("train --data {data} --set beta1=1", "beta1 must be in [0, 1), got 1.0"),
    Bad("train --data {data} --set beta2=-0.5", "beta2 must be in [0, 1), got -0.5"),
    Bad("train --data {data} --set beta1=nan", "--set: beta1 must be a finite number, got 'nan'"),
    Bad("train --data {data} --set weight_decay=-0.1", "weight_decay must be >= 0, got -0.1"),
    Bad("train --data {data} --set grad_clip=nan", "--set: grad_clip must be a finite number"),
    Bad("train --data {data} --set grad_clip=0", "grad_clip must be positive"),
    Bad("train --data {data} --set cpus_per_worker=nan", "--set: cpus_per_worker must be a finite number"),
    Bad("train --data {data} --scale-timeout nan", "flags: scale_timeout must be a finite number"),
    Bad("train --data {data} --set model.dropout=nan", "--set: model.dropout must be a finite number"),
    Bad("train --data {data} --set min_lr_ratio=inf", "--set: min_lr_ratio must be a finite number"),
    Bad("train --data {data} --set gpu_memory_gb=-1", "gpu_memory_gb must be positive, got -1.0"),
    Bad("train --data {data} --checkpoint-every atuo", "--checkpoint-every must be a number of "
        "steps (0: only at the end; -1: none) or auto, got 'atuo'"),
    Bad("train --data {data} --checkpoint-every auto --mtbf 0", "--mtbf must be a positive number of "
        "GPU-hours, got 0.0"),
    Bad("train --data {data} --config nan.yaml", "config file nan.yaml: lr must be a finite number",
        setup="nan-config"),
    Bad("train --set lr=nan", "--set: lr must be a finite number"),  # before data/pydoc is made
    Bad("lr-find --data {data} --lr-max nan", "--lr-min and --lr-max must be finite numbers"),
    Bad("lr-find --data {data} --lr-min inf", "--lr-min and --lr-max must be finite numbers"),
    Bad("generate r --temperature nan", "--temperature must be a finite number, got nan"),
    Bad("tune --data {data} --lr 1e-4:nan", "search space: lr: 'nan' is not a finite number"),
    Bad("tune --data {data} --space beta1=0.5,1.5", "search space: the point beta1=1.5 is invalid: "
                                                     "beta1 must be in [0, 1)"),
    Bad("plan --gpu-memory-gb nan", "--gpu-memory-gb must be positive and finite, got nan"),
    Bad("plan --gpu-tflops inf", "--gpu-tflops must be positive and finite, got inf"),
    Bad("plan --gpu h300", "--gpu must be one of h100-sxm, h100-sxm-96gb-500w"),
    Bad("plan --hbm-tbps 0", "--hbm-tbps must be positive and finite, got 0"),
    Bad("prepare --tokenizer bpe --tokenizer-sample-mb inf",
        "--tokenizer-sample-mb must be positive and finite, got inf"),
    # sizes from input that drive allocation -------------------------------------------- item 9
    Bad("prepare --tokenizer bpe --vocab-size 4294967296",
        "--vocab-size must be at most 1,048,576, got 4,294,967,296"),
    Bad("prepare --input corp --tokenizer big-id.json --out ds",
        "big-id.json has a token id of 1,000,000,000; ids must be below 1,048,576", setup="big-id"),
    Bad("train --data {data} --set model.vocab_size=10000000000",
        "model.vocab_size must be between 1 and 1,048,576"),
    Bad("train --data ds", "ds is not a valid dataset: vocab_size 'x' is not a number of tokens",
        setup="dataset-vocab-x"),
    Bad("train --data ds", "ds is not a valid dataset: vocab_size 1000000000000 is not a number",
        setup="dataset-vocab-huge"),
    Bad("train --data ds", "ds is not a valid dataset: vocab_size 300 is not its tokenizer's (256)",
        setup="dataset-vocab-other"),
    Bad("generate r -n 2000000", "--max-new-tokens must be at most 1,048,576, got 2,000,000"),
    # --force replaces only what we wrote --------------------------------------------------- item 4
    Bad("prepare --input corp --out corp --force", "corp is not a dataset written by prepare, so "
                                                   "--force does not replace it", setup="corpus"),
    Bad("prepare --input corp --out notes --force", "notes is not a dataset written by prepare",
        setup="notes"),
    Bad("prepare --input corp --out afile --force", "afile is not a dataset written by prepare",
        setup="afile"),
    Bad("prepare --input corp --out ds --force", "ds is not a dataset written by prepare",
        setup="dataset-and-notes"),
    Bad("export r --out afile --force", "afile is not an export of raytrain-lm, so --force does "
                                        "not replace it", setup="afile"),
    Bad("export r --out notes --force", "notes is not an export of raytrain-lm", setup="notes"),
    # a local folder that is no folder ----------------------------------------------------- item 13
    Bad("export r --out s3://bucket/x", "export writes a local folder, not s3://bucket/x"),
    Bad("report r --out s3://bucket/r.png", "--out is a local file, not s3://bucket/r.png",
        setup="run"),
    Bad("report r --out notes.md", "notes.md exists and is not a figure written by report, so it is "
        "not replaced (--force neither)", setup="notes-and-run"),
    Bad("report r --out notes.png --force", "notes.png exists and is not a figure written by report",
        setup="notes-and-run"),
    Bad("report r --out link.png --force", "--out link.png is a symlink; give the file itself",
        setup="notes-and-run"),
    # damaged run files, files from elsewhere ------------------------------------------- item 11
    Bad("train --resume --name r", "cannot resume 'r': {tmp}/runs/r/config.json is damaged",
        setup="run-damaged-config"),
    Bad("train --resume --name r", "cannot resume 'r': {tmp}/runs/r/config.json is damaged: not a "
                                   "JSON object", setup="run-config-list"),
    Bad("report r", "{tmp}/runs/r/metrics.jsonl line 2 is damaged", setup="run-damaged-metrics"),
    Bad("report r", "{tmp}/runs/r/metrics.jsonl line 1 is damaged: nested too deeply", setup="run-deep-metrics"),
    Bad("train --data ds", "ds is not a valid dataset: manifest.json is nested too deeply",
        setup="dataset-deep"),
    Bad("train --data ds", "ds/manifest.json cannot be read: a symlink", setup="dataset-pagemap"),
    Bad("prepare --input deep.jsonl --no-ray", "deep.jsonl:1: expected a JSON object with a 'text' string field",
        setup="deep-jsonl"),
    Bad("prepare --input ints.parquet --no-ray", "ints.parquet: column 'text' holds int64, not text",
        setup="ints-parquet"),
    Bad("generate ck -n 3", "ck/meta.json is corrupted", setup="checkpoint-world-0"),
    Bad("export ck --out x", "ck/dcp/.metadata is corrupted: a byte range outside __0_0.distcp",
        setup="checkpoint-truncated-shard"),
    Bad("generate ck -n 3", "ck/dcp/extra.bin is corrupted (no commit record vouches for it)",
        setup="checkpoint-extra-file"),
    # a Hugging Face folder this project does not compute, or one a flag contradicts -------- issue 40
    Bad("train --data {data} --init-from gemma", "--init-from gemma holds a 'gemma' model; --init-from "
        "takes Hugging Face folders of model_type llama, qwen2, qwen3, mistral", setup="hf-gemma"),
    Bad("plan --init-from gemma", "--init-from gemma holds a 'gemma' model", setup="hf-gemma"),
    Bad("train --data {data} --init-from yarn", "--init-from yarn is a Qwen2ForCausalLM this project "
        "cannot compute: rope_type 'yarn' (the rotary embeddings computed here: default, linear, "
        "llama3)", setup="hf-yarn"),
    Bad("train --data {data} --init-from qwen --set model.n_layer=4", "--set model.n_layer=4 "
        "contradicts --init-from qwen, whose config.json makes model.n_layer=2: drop it (the "
        "folder is the model)", setup="hf-qwen"),
    # a Hugging Face folder that does not hold the model (issue 40) ---------------------------
    Bad("train --data {data} --init-from hf",
        "hf/model.safetensors.index.json names model-00002-of-00006.safetensors, which is not in "
        "hf (a download cut short?)", setup="hf-missing-shard"),
    Bad("train --data {data} --init-from hf", "model.layers.0.mlp.up_proj.weight in "
        "model-00001-of-00006.safetensors has shape [128, 352], its config.json says [352, 128]",
        setup="hf-wrong-shape"),
    Bad("train --data {data} --init-from hf", "--init-from hf: its tokenizer.json is "
        "not the dataset's tokenizer", setup="hf-other-tokenizer"),
    Bad("export r --format hf --dtype fp16 --out x", "--dtype must be one of bf16, fp32, got 'fp16'"),
    Bad("export r --format hf --max-shard-size 5XB --out x", "--max-shard-size must be a positive "
                                                              "size such as 5GB"),
    Bad("export r --dtype fp32 --out x", "--dtype and --max-shard-size are for --format hf"),
    # a second driver in one run folder ---------------------------------------------------- item 5
    Bad("train --data {data} --name r", "run 'r' in runs is in use by another driver (pid",
        setup="claimed", process=True),  # the claim is this process's: the driver another
    # a resumed sweep whose pickles someone else wrote --------------------------------------- item 7
    Bad("tune --resume --name s", "refusing to resume: {tmp}/runs/s/tuner.pkl was written by another "
                                  "user", setup="sweep-of-another-user"),
    # a local cluster without authentication ------------------------------------------------- item 8
    Bad("cluster local-up --port 6397", "RAY_AUTH_MODE=disabled would start a cluster without "
                                        "authentication", env={"RAY_AUTH_MODE": "disabled"}),
    # an address where something else listens ----------------------------------------------- item 12
    Bad("train --data {data} --address 127.0.0.1:{port}", "something listens at 127.0.0.1:{port} "
                                                          "but it is not a Ray cluster", setup="web-port"),
    Bad("prepare --address 127.0.0.1:{port}", "something listens at 127.0.0.1:{port} but it is "
                                              "not a Ray cluster", setup="web-port"),
    # what Ray Train's local mode (--workers 0: this process, no Ray) cannot do -------------- issue 41
    Bad("train --data {data} --workers 0 --address 127.0.0.1:6379",
        "--workers 0 trains in this process, without Ray: drop --address"),
    Bad("train --data {data} --workers 0-2", "0-2: MIN must be at least 1 (--workers 0 alone: no "
                                             "Ray cluster, Ray Train's local mode in this process)"),
    Bad("train --data {data} --workers 0 --set workers=2", "--workers 0 trains a fixed group (1 "
                                                           "rank: this process, or torchrun's)"),
    Bad("train --data {data} --workers 0 --max-failures 2",
        "--max-failures restarts Ray's worker groups; --workers 0 has none to restart"),
    Bad("train --data {data} --workers 0 --worker-env NCCL_DEBUG=INFO",
        "--worker-env sets the environment of Ray's worker processes; with --workers 0"),
    Bad("train --data {data} --workers 0 --layout auto", "--layout auto plans on the cluster Ray "
                                                         "reports; with --workers 0 give the layout"),
    Bad("train --data {data} --workers 0 --use-gpu", "--use-gpu: torch sees 0 CUDA GPUs here, and "
                                                     "each of this node's 1 rank needs one",
        env={"CUDA_VISIBLE_DEVICES": ""}),
    # tracking and evaluation (issue 45) ------------------------------------------------------------
    Bad("train --data {data} --track neptune", "--track must be one of mlflow, wandb, got 'neptune'"),
    Bad("train --data {data} --track mlflow", "MLFLOW_TRACKING_URI=mlruns is a local folder, which "
                                              "MLflow writes only with MLFLOW_ALLOW_FILE_STORE=true",
        env={"MLFLOW_TRACKING_URI": "mlruns", "MLFLOW_ALLOW_FILE_STORE": ""}),
    Bad("tune --resume --name s --track mlflow", "--resume continues the sweep as it was started; drop track"),
    Bad("evaluate r --tasks hellaswag", "no run 'r' in runs"),
    Bad("evaluate r --tasks ,", "--tasks needs at least one task name"),
    Bad("evaluate r --tasks hellaswag --limit 0", "--limit must be positive, got 0.0"),
    Bad("evaluate r --tasks hellaswag --include-path nowhere",
        "--include-path nowhere: not a folder of task YAML files"),
    # third round (issue 38): what hung, read outside a folder or ended "unexpected" ---------
    Bad("train --data {data} --config bomb.yaml", "config file bomb.yaml, line 2: aliases (*a) are "
        "not allowed in a config file", setup="alias-bomb", process=True, timeout=30),
    Bad("generate ck -n 3", "rank0.json names '../../../../../../../../proc/self/pagemap', which is "
        "not a file inside", setup="checkpoint-record-pagemap", process=True, timeout=30),
    Bad("generate ck -n 3", "rank0.json names '../secret.txt', which is not a file inside",
        setup="checkpoint-record-outside"),
    Bad("export ck --out x", "rank0.json names sub/a.txt, which leads out of", setup="checkpoint-record-symlink"),
    Bad("export ck --out x", "dcp/.metadata is corrupted: it names '../../shard.distcp', not a file of",
        setup="checkpoint-dcp-outside"),
    Bad("submit -- --config run.yaml", "--config run.yaml: run.yaml is a symlink; a job takes only "
        "files of this folder itself", setup="config-symlink"),
    Bad("submit -- --config conf/run.yaml", "--config conf/run.yaml: conf is a symlink",
        setup="config-symlink"),
    Bad("prepare --input corp --tokenizer empty.json --out ds", "empty.json has an empty vocabulary",
        setup="empty-vocab"),
    Bad("prepare --input two.parquet --no-ray", "two.parquet: 2 columns are named 'text'",
        setup="two-text-columns"),
    Bad("train --data {data} --config arch.yaml", "config file arch.yaml: model.arch must be str, "
        "got ['llama']", setup="arch-list"),
    Bad("train --data {data} --config preset.yaml", "preset must be the name of one, got ['tiny']",
        setup="preset-list"),
    Bad("train --data {data} --storage s3://", "storage s3:// names no bucket: give s3://BUCKET/PREFIX"),
    Bad("jobs --address 127.0.0.1:70000", "--address must be the dashboard's http://HOST:PORT"),
    Bad("generate r -n 2", "run 'r' has no checkpoints", setup="odd-checkpoint-name"),
    Bad("plan --gpus 1000000000", "--gpus must be at most 1,048,576, got 1,000,000,000", process=True,
        timeout=30),
    Bad("plan --set model.n_layer=1e30", "model.n_layer must be at most 1,048,576"),
    Bad("train --data {data} --set model.n_embd=1e30", "model.n_embd must be at most 16,777,216"),
    Bad("generate ck -n 3", "ck/meta.json is corrupted: step 'x'", setup="checkpoint-meta-step"),
    Bad("export ck --out x", "ck/state.pt is corrupted: its step is not meta.json's",
        setup="checkpoint-meta-step-other"),
    Bad("export ck --out x", "ck/meta.json is corrupted: version '3'", setup="checkpoint-meta-version"),
    Bad("generate ck -n 3", "ck/meta.json is corrupted: version 99: written by a newer raytrain-lm",
        setup="checkpoint-meta-newer"),
    Bad("export ck --out x", "ck/meta.json is corrupted: format 'zip'", setup="checkpoint-meta-format"),
    Bad("generate ck -n 3", "ck/meta.json is corrupted: val_loss [1]", setup="checkpoint-meta-val-loss"),
    Bad("export ck --out x", "ck/meta.json is corrupted: config: not a mapping: []",
        setup="checkpoint-meta-config"),
    Bad("train --data {data} --init-from ck", "ck/meta.json is corrupted: config: model.n_layer must "
        "be int, got 'x'", setup="checkpoint-meta-model"),
    Bad("generate ck -n 3", "ck/meta.json is corrupted: tokenizer ['bpe']",
        setup="checkpoint-meta-tokenizer"),
    Bad("train --data {data} --config llama.yaml --init-from hf", "hf: config.json's "
        "num_attention_heads must be a whole number >= 1, got 0", setup="hf-heads-0"),
    Bad("train --data {data} --config llama.yaml --init-from hf", "hf: config.json has no "
        "num_attention_heads", setup="hf-heads-missing"),
    Bad("train --data {data} --config llama.yaml --init-from hf", "hf: config.json's "
        "num_attention_heads must be a whole number >= 1, got '4'", setup="hf-heads-text"),
    Bad("train --data {data} --config llama.yaml --init-from hf", "hf: config.json's rope_scaling "
        "must be a JSON object, got 'linear'", setup="hf-rope-scaling-text"),
    Bad("train --data {data} --config llama.yaml --init-from hf", "hf: config.json's rope_theta must "
        "be a positive number, got '1e4'", setup="hf-rope-theta-text"),
    Bad("train --data {data} --config llama.yaml --init-from hf", "hf/config.json cannot be read: not "
        "UTF-8 text", setup="hf-config-not-utf8"),
    Bad("train --data {data} --config llama.yaml --init-from hf", "hf/config.json cannot be read: "
        "nested too deeply", setup="hf-config-deep"),
    Bad("train --data {data} --config llama.yaml --init-from hf", "model.safetensors.index.json names "
        "'../weights.safetensors', which is not a file inside", setup="hf-index-outside"),
    Bad("train --data {data} --config llama.yaml --init-from hf", "hf names model.safetensors, a "
        "symlink: only the folder's own files are read", setup="hf-symlinked-weights"),
    Bad("train --data {data} --config llama.yaml --init-from hf", "model.norm.weight in "
        "model.safetensors has shape [16], its config.json says [32]", setup="hf-weight-shape"),
    Bad("train --data {data} --config llama.yaml --init-from hf", "it holds "
        "model.layers.0.self_attn.q_proj.bias, not a weight of that model", setup="hf-weight-extra"),
    Bad("train --data {data} --config llama.yaml --init-from hf", "its weights do not fit its "
        "config.json: it lacks lm_head.weight", setup="hf-weight-missing"),
    Bad("train --data {data} --config llama.yaml --init-from hf", "model.safetensors is not a "
        "safetensors file (its header is not JSON)", setup="hf-header-damaged"),
    # a mixture of experts and expert parallelism (issue 43) ------------------------------------
    Bad("train --data {data} --preset moe-tiny --ep 3", "--ep 3 must divide model.n_experts (4): each "
                                                        "expert-parallel rank holds the same number of whole experts"),
    Bad("train --data {data} --preset moe-tiny --workers 6 --ep 4",
        "--ep 4 must divide the data-parallel size 6: expert parallelism splits the data-parallel ranks"),
    Bad("train --data {data} --preset moe-tiny --tp 2 --ep 2", "--ep 2 must divide the data-parallel size 1"),
    Bad("train --data {data} --preset moe-tiny --set model.top_k=5",
        "model.top_k (5) must be between 1 and model.n_experts (4)"),
    Bad("train --data {data} --preset moe-tiny --set model.n_experts=1",
        "model.arch moe needs model.n_experts of 2 or more, got 1 (one expert is the llama: --arch llama)"),
    Bad("train --data {data} --preset llama-tiny --ep 2",
        "--ep 2 splits a mixture of experts (model.arch moe); model.arch llama has no experts: drop --ep"),
    Bad("plan --preset mixtral-8x7b --gpus 16 --ep 3", "--ep 3 must divide model.n_experts (8)"),
    Bad("plan --preset llama3-8b --gpus 16 --ep 2", "--ep 2 splits a mixture of experts (model.arch moe)"),
    # fourth round (issue 48): sizes no bound held, numbers past float's range ------------ item 1
    Bad("plan --init-from mix", "--init-from mix: its config.json: model.n_experts must be at most "
        "1,048,576, got 1,000,000,000", setup="moe-mixtral-experts", process=True, timeout=30),
    Bad("train --data {data} --init-from mix", "--init-from mix: its config.json: model.n_experts must "
        "be at most 1,048,576", setup="moe-mixtral-experts"),
    Bad("train --data {data} --init-from qmoe", "--init-from qmoe: its config.json: model.n_experts "
        "must be at most 1,048,576", setup="moe-qwen3-experts"),
    Bad("train --data {data} --preset moe-tiny --set model.n_experts=1e9",
        "model.n_experts must be at most 1,048,576, got 1,000,000,000"),
    Bad("train --data {data} --preset llama-tiny --set model.head_size=1e12",
        "model.head_size must be at most 16,777,216, got 1,000,000,000,000"),
    Bad("train --data {data} --preset moe-tiny --set model.shared_ffn_dim=1e12",
        "model.shared_ffn_dim must be at most 16,777,216, got 1,000,000,000,000"),
    Bad("plan --preset mixtral-8x7b --set model.n_experts=1e9",
        "model.n_experts must be at most 1,048,576, got 1,000,000,000"),
    Bad("train --data {data} --preset moe-tiny --set model.n_experts=100000",
        "model.n_layer x model.n_experts (4 x 100,000) must be at most 262,144"),
    Bad("plan --preset llama3-8b --set model.n_layer=100000 --set model.n_embd=1048576",
        "the model would have about 10^18 parameters"),
    Bad("train --data {data} --preset llama-tiny --set model.ffn_multiplier=1e30",
        "the MLP's hidden size (model.ffn_dim) must be at most 16,777,216"),
    # ------------------------------------------------------------------------------------- item 2
    Bad("train --data {data} --config llama.yaml --init-from hf", "hf: config.json's rope_theta must "
        "be a positive number, got 100000000000000000...", setup="hf-rope-theta-huge"),
    Bad("plan --init-from hf", "hf: config.json's rope_theta must be a positive number",
        setup="hf-rope-theta-huge"),
    Bad("train --data {data} --config llama.yaml --init-from hf", "hf: config.json's rms_norm_eps "
        "must be a positive number", setup="hf-norm-eps-huge"),
    Bad("plan --init-from hf", "hf: config.json's factor must be a positive number",
        setup="hf-rope-factor-huge"),
    Bad("train --data {data} --config llama.yaml --init-from hf", "model.safetensors: the header's "
        "entry for 'model.norm.weight' is damaged: {{'data_offsets': [", setup="hf-dtype-list"),
    Bad("train --data {data} --config llama.yaml --init-from hf", "model.safetensors: the header's "
        "entry for 'model.norm.weight' is damaged", setup="hf-dtype-object"),
    # torchrun's environment (--workers 0 under torchrun) -------------------------------- item 3
    Bad("train --data {data} --workers 0", "torchrun's environment: RANK=3 with WORLD_SIZE=2: the "
        "ranks are 0 to 1", env=_torchrun(RANK="3", LOCAL_WORLD_SIZE="1")),
    Bad("train --data {data} --workers 0", "torchrun's environment: RANK='abc' is not a whole number "
        ">= 0", env=_torchrun(RANK="abc")),
    Bad("train --data {data} --workers 0", "torchrun's environment: MASTER_PORT=99999 is not a port "
        "(1 to 65535)", env=_torchrun(MASTER_PORT="99999")),
    Bad("train --data {data} --workers 0 --set rendezvous_timeout=0.5", "torchrun: rank 1 of 2 did not "
        "arrive at 127.0.0.1:{port} within 0.5 s (--set rendezvous_timeout=SECONDS); rank 0 gives up",
        setup="free-port", env=_torchrun(MASTER_PORT="{port}")),
    Bad("train --data {data} --workers 0 --set rendezvous_timeout=0.5", "torchrun: rank 0 did not "
        "answer at 127.0.0.1:{port} within 0.5 s", setup="free-port",
        env=_torchrun(RANK="1", LOCAL_RANK="1", MASTER_PORT="{port}")),
    # ------------------------------------------------------------------------------------- item 4
    Bad("train --data {data} --track mlflow", "MLFLOW_TRACKING_URI=file://***@localhost/mlruns is a "
        "local folder", env={"MLFLOW_TRACKING_URI": "file://alice:hunter2@localhost/mlruns",
                             "MLFLOW_ALLOW_FILE_STORE": ""}),
    # ------------------------------------------------------------------------------------- item 5
    Bad("evaluate hf --tasks hellaswag", "evaluate hf: model.norm.weight in model.safetensors has "
        "shape [16], its config.json says [32]", setup="hf-weight-shape"),
    Bad("evaluate hf --tasks hellaswag", "hf/model.safetensors is not a safetensors file (its header "
        "is not JSON)", setup="hf-header-damaged"),
    Bad("evaluate mix --tasks hellaswag", "evaluate mix: its config.json: model.n_experts must be at "
        "most 1,048,576", setup="moe-mixtral-experts"),
    # a model type no family here imports gets its files' checks (a GPT-2 export is evaluated so)
    Bad("evaluate gemma --tasks hellaswag", "gemma/model.safetensors is not a safetensors file",
        setup="hf-gemma"),
    # ------------------------------------------------------------------------------------- item 6
    Bad("prepare --input corp --tokenizer tok --out ds", "--tokenizer tok names tokenizer.json, a "
        "symlink: only the folder's own files are read", setup="tokenizer-symlink"),
    Bad("prepare --input corp --tokenizer /proc/self/pagemap --out ds", "/proc/self/pagemap yields "
        "more bytes than its size says: not a regular file", setup="corpus"),
]


# ---------------------------------------------------------------- what the folder holds first

def _run(tmp: Path, metrics: str | None = None, config: str | None = None) -> None:
    from raytrain_lm.config.load import build_config

    run = tmp / "runs" / "r"
    run.mkdir(parents=True)
    rows = [{"step": s, "loss": 3 - s / 100, "lr": 1e-3, "tokens_per_second": 1e3} for s in (10, 20, 30)]
    (run / "metrics.jsonl").write_text(metrics if metrics is not None else
                                       "".join(json.dumps(r) + "\n" for r in rows))
    (run / "config.json").write_text(config if config is not None else
                                     json.dumps(build_config(flags={"name": "r"}).to_dict()))
    (run / "summary.json").write_text(json.dumps({"status": "completed", "name": "r", "steps": 30}))


def _dataset(tmp: Path, data: Path, **changes) -> None:
    import shutil

    shutil.copytree(data, tmp / "ds")
    manifest = json.loads((tmp / "ds" / "manifest.json").read_text())
    (tmp / "ds" / "manifest.json").write_text(json.dumps({**manifest, **changes}))


def _checkpoint(tmp: Path) -> Path:
    return crafted.checkpoint(tmp)  # a copy of one written once


def _rerecord(folder: Path) -> None:
    """Recompute rank 0's commit record, as whoever changed the files could."""
    from raytrain_lm.store.digest import sha256_file

    record = json.loads((folder / "rank0.json").read_text())
    (folder / "rank0.json").write_text(json.dumps({rel: sha256_file(folder / rel) for rel in record}))


def _truncate_shard(folder: Path) -> None:
    shard = next((folder / "dcp").glob("*.distcp"))
    shard.write_bytes(shard.read_bytes()[:100])


def _world_0(tmp: Path) -> None:
    folder = _checkpoint(tmp)
    meta = json.loads((folder / "meta.json").read_text())
    (folder / "meta.json").write_text(json.dumps({**meta, "world_size": 0}))
    _truncate_shard(folder)  # no record checked: nothing would notice


def _truncated(tmp: Path) -> None:
    folder = _checkpoint(tmp)
    _truncate_shard(folder)
    _rerecord(folder)  # the checksums pass: the damage shows only as dcp reads it


def _extra_file(tmp: Path) -> None:
    (_checkpoint(tmp) / "dcp" / "extra.bin").write_bytes(b"x")


def _hf_folder(tmp: Path, data: Path, damage: str) -> None:
    """A Llama folder (llama-tiny's shape on `data`'s bytes), in 6 shards with an index, made by
    transformers, then damaged."""
    from safetensors.torch import load_file, save_file

    from conftest import save_hf_llama
    from raytrain_lm.config.load import build_config
    from raytrain_lm.data.manifest import load_manifest
    from raytrain_lm.data.tokenizer import train_bpe
    from raytrain_lm.data.vocab import byte_tokenizer_json
    from raytrain_lm.run.preflight import fit_model_to_data

    cfg = build_config(flags={"preset": "llama-tiny", "data": str(data)})
    fit_model_to_data(cfg, load_manifest(data))
    folder = tmp / "hf"
    save_hf_llama(folder, cfg.model, byte_tokenizer_json().encode(), max_shard_size="700KB")
    if damage == "missing-shard":
        (folder / "model-00002-of-00006.safetensors").unlink()
    elif damage == "wrong-shape":
        name = "model.layers.0.mlp.up_proj.weight"
        shard = folder / "model-00001-of-00006.safetensors"  # where transformers put it
        tensors = load_file(shard)
        save_file({**tensors, name: tensors[name].t().contiguous()}, shard, metadata={"format": "pt"})
    else:
        (folder / "tokenizer.json").write_bytes(train_bpe(["some words of text. " * 50], 300).raw)


def _big_id(tmp: Path) -> None:
    from raytrain_lm.data.tokenizer import train_bpe

    (tmp / "corp").mkdir()
    (tmp / "corp" / "a.txt").write_text("some words of text. " * 200)
    tok = json.loads(train_bpe(["some words of text. " * 50], 300).raw)
    vocab = tok["model"]["vocab"]
    vocab[next(reversed(vocab))] = 10 ** 9
    (tmp / "big-id.json").write_text(json.dumps(tok))


def _sweep_of_another_user(tmp: Path) -> None:
    sweep = tmp / "runs" / "s"
    sweep.mkdir(parents=True)
    (sweep / "sweep.json").write_text("{}")
    (sweep / "tuner.pkl").write_bytes(b"\x80\x04N.")
    try:
        os.chown(sweep / "tuner.pkl", 4242, 4242)
    except PermissionError:
        pytest.skip("giving a file to another user needs root")


@contextlib.contextmanager
def _claimed(tmp: Path):
    """Another driver's live claim on runs/r: this test process's."""
    from raytrain_lm.store.claims import RunClaim
    from raytrain_lm.store.storage import RunFolder

    (tmp / "runs").mkdir()
    with RunClaim(RunFolder(str(tmp / "runs"), "r")):
        yield {}


@contextlib.contextmanager
def _silent_port(tmp: Path):
    """A port where something listens, accepts and never says a word (not a Ray cluster)."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(8)
    held = []

    def accept() -> None:
        with contextlib.suppress(OSError):  # closed: the case is over
            while True:
                held.append(server.accept()[0])

    threading.Thread(target=accept, daemon=True).start()
    try:
        yield {"port": server.getsockname()[1]}
    finally:
        server.close()


@contextlib.contextmanager
def _free_port(tmp: Path):
    """A port where nothing listens (for a rendezvous that rank 0 serves, or no one does)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    yield {"port": port}


@contextlib.contextmanager
def _web_port(tmp: Path):
    """A port where a web server answers (HTTP/1.1, not gRPC's HTTP/2): refused at its first
    bytes, with no wait for a silence to end."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(8)

    def answer() -> None:
        with contextlib.suppress(OSError):  # closed: the case is over
            while True:
                conn = server.accept()[0]
                with conn:
                    conn.recv(64)
                    conn.sendall(b"HTTP/1.1 400 Bad Request\r\nContent-Length: 0\r\n\r\n")

    threading.Thread(target=answer, daemon=True).start()
    try:
        yield {"port": server.getsockname()[1]}
    finally:
        server.close()


def _hf_config_only(tmp: Path, name: str, **config) -> None:
    """A Hugging Face folder's config.json (a small Qwen2's, with `config`) beside a weights
    file: what is refused is read from config.json before any weight."""
    (tmp / name).mkdir()
    (tmp / name / "config.json").write_text(json.dumps({
        "model_type": "qwen2", "vocab_size": 320, "hidden_size": 64, "intermediate_size": 96,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "max_position_embeddings": 128, **config}))
    (tmp / name / "model.safetensors").write_bytes(b"")


def _writer(fn):
    @contextlib.contextmanager
    def setup(tmp: Path, data: Path):
        fn(tmp, data)
        yield {}
    return setup


SETUPS = {
    "": _writer(lambda tmp, data: None),
    "afile": _writer(lambda tmp, data: ((tmp / "corp").mkdir(), (tmp / "corp" / "a.txt").write_text(
        "text. " * 100), (tmp / "afile").write_text("a file"))),
    "corpus": _writer(lambda tmp, data: ((tmp / "corp").mkdir(), (tmp / "corp" / "a.txt").write_text(
        "some words of text. " * 500))),
    "notes": _writer(lambda tmp, data: ((tmp / "corp").mkdir(), (tmp / "corp" / "a.txt").write_text(
        "text. " * 100), (tmp / "notes").mkdir(), (tmp / "notes" / "todo.txt").write_text("mine"))),
    "dataset-and-notes": _writer(lambda tmp, data: (_dataset(tmp, data), (tmp / "corp").mkdir(),
                                                    (tmp / "corp" / "a.txt").write_text("text. " * 100),
                                                    (tmp / "ds" / "notes.txt").write_text("mine"))),
    "nan-config": _writer(lambda tmp, data: (tmp / "nan.yaml").write_text("lr: .nan\n")),
    "big-id": _writer(lambda tmp, data: _big_id(tmp)),
    "dataset-vocab-x": _writer(lambda tmp, data: _dataset(tmp, data, vocab_size="x")),
    "dataset-vocab-huge": _writer(lambda tmp, data: _dataset(tmp, data, vocab_size=10 ** 12)),
    "dataset-vocab-other": _writer(lambda tmp, data: _dataset(tmp, data, vocab_size=300)),
    "dataset-pagemap": _writer(crafted.manifest_to_pagemap),
    "dataset-deep": _writer(lambda tmp, data: (_dataset(tmp, data), (tmp / "ds" / "manifest.json").write_text(
        "[" * 100_000 + "]" * 100_000))),
    "deep-jsonl": _writer(lambda tmp, data: (tmp / "deep.jsonl").write_text(
        '{"text": ' + "[" * 100_000 + "]" * 100_000 + "}\n")),
    "ints-parquet": _writer(lambda tmp, data: __import__("pyarrow.parquet").parquet.write_table(
        __import__("pyarrow").table({"text": [1, 2, 3]}), tmp / "ints.parquet")),
    "run": _writer(lambda tmp, data: _run(tmp)),
    "odd-checkpoint-name": _writer(lambda tmp, data: (_run(tmp), (tmp / "runs" / "r" / "checkpoint_\u00b20").mkdir())),
    "notes-and-run": _writer(lambda tmp, data: (_run(tmp), (tmp / "notes.md").write_text("mine"),
                                                (tmp / "notes.png").write_bytes(b"\x89PNG\r\n\x1a\nmine"),
                                                (tmp / "link.png").symlink_to("notes.md"))),
    "run-damaged-config": _writer(lambda tmp, data: _run(tmp, config='{"lr": 0.001, "max_st')),
    "run-config-list": _writer(lambda tmp, data: _run(tmp, config="[1, 2]")),
    "run-damaged-metrics": _writer(lambda tmp, data: _run(
        tmp, metrics='{"step": 10, "loss": 3.0, "lr": 0.001, "tokens_per_second": 1000.0}\n{"st\n'
                     '{"step": 30, "loss": 2.0, "lr": 0.001, "tokens_per_second": 1000.0}\n')),
    "run-deep-metrics": _writer(lambda tmp, data: _run(tmp, metrics="[" * 100_000 + "]" * 100_000 + "\n")),
    "checkpoint-world-0": _writer(lambda tmp, data: _world_0(tmp)),
    "checkpoint-truncated-shard": _writer(lambda tmp, data: _truncated(tmp)),
    "checkpoint-extra-file": _writer(lambda tmp, data: _extra_file(tmp)),
    **{f"hf-{damage}": _writer(lambda tmp, data, damage=damage: _hf_folder(tmp, data, damage))
       for damage in ("missing-shard", "wrong-shape", "other-tokenizer")},
    "sweep-of-another-user": _writer(lambda tmp, data: _sweep_of_another_user(tmp)),
    "hf-gemma": _writer(lambda tmp, data: _hf_config_only(tmp, "gemma", model_type="gemma")),
    "hf-yarn": _writer(lambda tmp, data: _hf_config_only(
        tmp, "yarn", rope_scaling={"rope_type": "yarn", "factor": 4.0})),
    "hf-qwen": _writer(lambda tmp, data: _hf_config_only(tmp, "qwen")),
    "claimed": lambda tmp, data: _claimed(tmp),
    "web-port": lambda tmp, data: _web_port(tmp),
    "free-port": lambda tmp, data: _free_port(tmp),
    **{name: _writer(lambda tmp, data, fn=fn: fn(tmp)) for name, fn in crafted.SETUPS.items()},
}

# What the folder holds before (and so after) each case, for the table.
HOLDS = {
    "afile": "afile (a file)", "corpus": "corp/ (a corpus)", "notes": "notes/ (someone's folder)",
    "dataset-and-notes": "ds/ (a dataset with someone's notes.txt in it)", "nan-config": "nan.yaml",
    "big-id": "big-id.json", "run": "runs/r/",
    "odd-checkpoint-name": "runs/r/ (with a folder checkpoint_\u00b20)",
    "notes-and-run": "runs/r/, notes.md, notes.png (someone's PNG), link.png (a symlink to notes.md)",
    "claimed": "runs/r/ (another driver's claim)",
    "sweep-of-another-user": "runs/s/", "deep-jsonl": "deep.jsonl", "ints-parquet": "ints.parquet",
    "hf-gemma": "gemma/ (a Gemma's Hugging Face folder)",
    "hf-yarn": "yarn/ (a Qwen2 folder with yarn rope scaling)", "hf-qwen": "qwen/ (a Qwen2 folder)",
    **{k: "ds/ (its manifest changed)" for k in SETUPS if k.startswith("dataset-") and k != "dataset-and-notes"},
    **{k: "runs/r/ (a file of it damaged)" for k in SETUPS if k.startswith("run-")},
    **{k: "ck/ (a checkpoint, damaged)" for k in SETUPS if k.startswith("checkpoint-")},
    **crafted.HOLDS,
    **{k: "hf/ (a Hugging Face folder, damaged)" for k in SETUPS if k.startswith("hf-")},
}


def _tree(root: Path) -> dict[str, str]:
    """Every path under `root` with what it is: a folder, or a file's sha256 (claims, which
    their driver renews, by name only)."""
    out = {}
    for p in sorted(root.rglob("*")):
        rel = p.relative_to(root).as_posix()
        if p.is_symlink():  # where it points (its target may be /proc/self/pagemap)
            out[rel] = f"-> {os.readlink(p)}"
        elif p.is_dir():
            out[rel] = "dir"
        elif p.name.startswith(".claim-"):
            out[rel] = "claim"
        else:
            out[rel] = hashlib.sha256(p.read_bytes()).hexdigest()
    return out


def _in_a_process(case: Bad) -> bool:
    """The first case of each command runs as a user runs it, `python cli.py` in a process of its
    own, and so does a case that needs another process; the others run in this process through
    cli.main() (conftest.cli_here), which is what decides what a bad input prints and returns."""
    first = {}
    for c in CASES:
        first.setdefault(c.command.split()[0], c)
    return case.process or first[case.command.split()[0]] is case


@pytest.mark.parametrize("case", CASES, ids=[f"{c.command} [{c.setup}]" if c.setup else c.command
                                             for c in CASES])
def test_a_bad_input_is_one_line_exit_2_and_changes_nothing(case, tmp_path, pydoc_data):
    with SETUPS[case.setup](tmp_path, pydoc_data) as fields:
        fields = {"data": pydoc_data, "tmp": tmp_path, **fields}
        before = _tree(tmp_path)
        result = (run_cli if _in_a_process(case) else cli_here)(
            *shlex.split(case.command.format(**fields)), cwd=tmp_path,
            env={"RAY_ADDRESS": "127.0.0.1:1", **{k: v.format(**fields) for k, v in case.env.items()}},
            timeout=case.timeout)
        assert_clean_error(result, case.message.format(**fields))
        assert _tree(tmp_path) == before


def test_a_silent_listener_is_refused_when_its_timeout_ends(tmp_path):
    """The address check every command makes (the `--address` cases above meet a web server,
    refused at its first bytes): a listener that accepts and never answers is refused once the
    check's timeout ends, with the same one line, not waited on as Ray's client would (minutes)."""
    import time

    from raytrain_lm.cluster.connect import check_reachable
    from raytrain_lm.errors import UserError

    with _silent_port(tmp_path) as fields:
        address = f"127.0.0.1:{fields['port']}"
        t0 = time.monotonic()
        with pytest.raises(UserError, match=f"something listens at {address} but it is not a Ray "
                                            r"cluster \(it did not answer as one within 0.3 s\)"):
            check_reachable(address, timeout=0.3)
        assert 0.3 <= time.monotonic() - t0 < 0.3 + 2


# ---------------------------------------------------------------- docs/bad-inputs.md

def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def table() -> str:
    """docs/bad-inputs.md as the cases above and test_cli_errors' lists make it."""
    rows = [(c.command.replace("{data}", "DATA").replace("{port}", "PORT"),
             c.message.replace("{port}", "PORT").replace("{tmp}/", ""),
             "nothing" + (f"; {HOLDS[c.setup]} as it was" if c.setup in HOLDS else ""))
            for c in CASES]
    rows += [(c.replace("{tmp}", "TMP"), m.replace("{tmp}", "TMP"),
              "nothing; TMP's files and folders as they were") for c, m in BAD_PATHS]
    short = lambda name: name if len(name) < 40 else f"{name[:3]}...({len(name)} characters)"  # noqa: E731
    rows += [(f"{' '.join(command)} --name {shlex.quote(short(name))}",
              f"--name {short(name)!r} is not a valid name: use letters, digits ...", "nothing")
             for command, name in _names()]
    lines = ["# Bad inputs the suite tries", "",
             "Each is run as a user types it (tests/test_bad_inputs.py, tests/test_cli_errors.py): "
             "the one line on stderr holds the message, the exit code is 2, there is no traceback, "
             "and the folder the command ran in is as it was. DATA is a prepared dataset, TMP the "
             "test's folder, PORT a port where something that is not Ray listens. Generated from "
             "the tests by `python tests/test_bad_inputs.py`; a test fails when this file differs.",
             "", f"{len(rows)} inputs.", "",
             "| input | message (part of the line) | exit | left on disk |", "|---|---|---|---|"]
    lines += [f"| `{_cell(cmd)}` | {_cell(msg)} | 2 | {left} |" for cmd, msg, left in rows]
    return "\n".join(lines) + "\n"


def _names():
    """The (command, name) cases of test_cli_errors' name test, as it parametrizes them."""
    import test_cli_errors

    marks = test_cli_errors.test_names_that_are_not_one_plain_folder_are_refused.pytestmark
    [params] = [m for m in marks if m.name == "parametrize"]
    return params.args[1]


def test_the_table_of_bad_inputs_in_docs_is_the_suites():
    assert len(CASES) + len(BAD_PATHS) + len(_names()) >= 60
    assert BAD_NAMES  # the name cases come from the same list as test_cli_errors'
    assert TABLE.read_text() == table(), "run `python tests/test_bad_inputs.py` to rewrite it"


if __name__ == "__main__":
    TABLE.write_text(table())
    print(f"wrote {TABLE}")
