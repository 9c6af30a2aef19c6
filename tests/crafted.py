"""Files from elsewhere, crafted as an attacker or a damaged disk would make them, for the cases of
test_bad_inputs.py: a YAML alias bomb, checkpoints whose commit records, .metadata or meta.json
name or say what they should not, Hugging Face folders whose config.json, index or weights do not
hold what they claim. Each `setup(tmp, data)` writes into the case's folder; SETUPS and HOLDS
join test_bad_inputs' own."""

from __future__ import annotations

import hashlib
import json
import os
import pickle
from pathlib import Path

# A 340-byte YAML file whose last line stands for 9^9 (387 million) strings.
ALIAS_BOMB = "".join(
    [f"lr: [&a {json.dumps(['lol'] * 9)},\n"]
    + [f"  &{b} [{', '.join([f'*{a}'] * 9)}],\n" for a, b in zip("abcdefg", "bcdefgh")]
    + [f"  [{', '.join(['*h'] * 9)}]]\n"])


_MADE: dict[str, Path] = {}  # what each kind of base folder was made into once, to copy


def _copy_of(kind: str, make, dest: Path) -> Path:
    """A copy at `dest` of the folder `make(path)` writes, made once per test process (a
    checkpoint or a model folder takes a model built and saved; a copy takes a few ms)."""
    import shutil
    import tempfile

    if kind not in _MADE:
        _MADE[kind] = Path(tempfile.mkdtemp(prefix=f"crafted-{kind}-")) / kind
        make(_MADE[kind])
    shutil.copytree(_MADE[kind], dest, symlinks=True)
    return dest


def checkpoint(tmp: Path) -> Path:
    from test_checkpoint import write_checkpoint

    return _copy_of("ck", write_checkpoint, tmp / "ck")


def _record(folder: Path, **entries: str) -> None:
    """Add entries (name -> the sha256 of the bytes given) to rank 0's commit record."""
    record = json.loads((folder / "rank0.json").read_text())
    record.update({rel: hashlib.sha256(data.encode()).hexdigest() for rel, data in entries.items()})
    (folder / "rank0.json").write_text(json.dumps(record))


def _rerecord(folder: Path, rel: str) -> None:
    record = json.loads((folder / "rank0.json").read_text())
    record[rel] = hashlib.sha256((folder / rel).read_bytes()).hexdigest()
    (folder / "rank0.json").write_text(json.dumps(record))


def record_to_pagemap(tmp: Path) -> None:
    """A record naming a file that reads as ~256 GB although its size says 0."""
    _record(checkpoint(tmp), **{"../../../../../../../../proc/self/pagemap": ""})


def record_outside(tmp: Path) -> None:
    """A record naming a real file outside the checkpoint, with its real digest."""
    (tmp / "secret.txt").write_text("the user's own file")
    _record(checkpoint(tmp), **{"../secret.txt": "the user's own file"})


def record_through_symlink(tmp: Path) -> None:
    """A record naming a file under a symlinked folder of the checkpoint that leads outside."""
    (tmp / "elsewhere").mkdir()
    (tmp / "elsewhere" / "a.txt").write_text("outside")
    os.symlink(tmp / "elsewhere", checkpoint(tmp) / "sub")
    _record(tmp / "ck", **{"sub/a.txt": "outside"})


def dcp_metadata_outside(tmp: Path) -> None:
    """dcp/.metadata (recorded) saying a tensor's bytes are in a file outside dcp/."""
    import torch.distributed.checkpoint  # noqa: F401  (the classes .metadata names)

    folder = checkpoint(tmp)
    (tmp / "shard.distcp").write_bytes(b"\0" * 4096)
    metadata = pickle.loads((folder / "dcp" / ".metadata").read_bytes())
    next(iter(metadata.storage_data.values())).relative_path = "../../shard.distcp"
    (folder / "dcp" / ".metadata").write_bytes(pickle.dumps(metadata))
    _rerecord(folder, "dcp/.metadata")


def meta_with(**changes):
    """A checkpoint whose meta.json (rank 0's commit record: no checksum covers it) says otherwise."""
    def setup(tmp: Path) -> None:
        folder = checkpoint(tmp)
        meta = json.loads((folder / "meta.json").read_text())
        (folder / "meta.json").write_text(json.dumps({**meta, **changes}))
    return setup


def damaged_newest(tmp: Path) -> None:
    """A run with two checkpoints, the newer's meta.json edited (its step a string)."""
    from test_checkpoint import write_checkpoint

    run = tmp / "runs" / "r"
    for step in (3, 6):
        write_checkpoint(run / f"checkpoint_{step:08d}")
    (run / "metrics.jsonl").write_text(json.dumps({"step": 3, "loss": 3.0}) + "\n")
    meta_path = run / "checkpoint_00000006" / "meta.json"
    meta_path.write_text(json.dumps({**json.loads(meta_path.read_text()), "step": "six"}))


# ---------------------------------------------------------------- Hugging Face folders

# The Llama of the Hugging Face cases, as a config file for `train --config` (the dataset's 256
# byte tokens), and the folder's matching weights: made with safetensors from the shapes alone.
LLAMA_YAML = ("model:\n  arch: llama\n  bias: false\n  n_layer: 2\n  n_embd: 32\n  n_head: 4\n"
              "  n_kv_head: 2\n  multiple_of: 32\n  vocab_size: 256\n")


def hf_folder(tmp: Path) -> Path:
    """Our Llama's weights under transformers' names (hf_llama.ADAPTER.to_hf), as an export writes
    them, with llama.yaml, the run's model settings, beside it."""
    (tmp / "llama.yaml").write_text(LLAMA_YAML)
    return _copy_of("hf", _write_hf_folder, tmp / "hf")


def _write_hf_folder(folder: Path) -> None:
    from safetensors.torch import save_file

    from raytrain_lm.config.load import build_config
    from raytrain_lm.data.vocab import byte_tokenizer_json
    from raytrain_lm.models import build_model
    from raytrain_lm.models.llama import hf_llama

    (folder.parent / "llama.yaml").write_text(LLAMA_YAML)
    cfg = build_config(config_file=str(folder.parent / "llama.yaml")).model
    folder.mkdir()
    save_file(hf_llama.ADAPTER.to_hf(build_model(cfg, seed=0).state_dict(), cfg, 256),
              str(folder / "model.safetensors"), metadata={"format": "pt"})
    (folder / "config.json").write_text(json.dumps(hf_llama.ADAPTER.hf_config(cfg, 256, None)))
    (folder / "tokenizer.json").write_text(byte_tokenizer_json())


def hf_config_with(**changes):
    def setup(tmp: Path) -> None:
        path = hf_folder(tmp) / "config.json"
        config = {**json.loads(path.read_text()), **changes}
        path.write_text(json.dumps({k: v for k, v in config.items() if v != "(left out)"}))
    return setup


def hf_config_bytes(data: bytes):
    def setup(tmp: Path) -> None:
        (hf_folder(tmp) / "config.json").write_bytes(data)
    return setup


def hf_index_outside(tmp: Path) -> None:
    """An index whose weight_map sends the weights to a file outside the folder."""
    folder = hf_folder(tmp)
    (folder / "model.safetensors").rename(tmp / "weights.safetensors")
    (folder / "model.safetensors.index.json").write_text(json.dumps(
        {"weight_map": {"model.norm.weight": "../weights.safetensors"}}))


def hf_symlinked_weights(tmp: Path) -> None:
    folder = hf_folder(tmp)
    (folder / "model.safetensors").rename(tmp / "weights.safetensors")
    os.symlink(tmp / "weights.safetensors", folder / "model.safetensors")


def hf_weights_edit(edit):
    def setup(tmp: Path) -> None:
        from safetensors.torch import load_file, save_file

        path = hf_folder(tmp) / "model.safetensors"
        weights = load_file(str(path))
        edit(weights)
        save_file(weights, str(path), metadata={"format": "pt"})
    return setup


def hf_header_damaged(tmp: Path) -> None:
    path = hf_folder(tmp) / "model.safetensors"
    data = path.read_bytes()
    path.write_bytes(data[:8] + b"[" * 40 + data[48:])


def hf_header_entry(name: str, **changes):
    """model.safetensors with one tensor's header entry changed (the header rewritten whole, its
    length too: the data offsets count from the header's end)."""
    def setup(tmp: Path) -> None:
        path = hf_folder(tmp) / "model.safetensors"
        data = path.read_bytes()
        n = int.from_bytes(data[:8], "little")
        header = json.loads(data[8:8 + n])
        header[name].update(changes)
        raw = json.dumps(header).encode()
        raw += b" " * (-len(raw) % 8)
        path.write_bytes(len(raw).to_bytes(8, "little") + raw + data[8 + n:])
    return setup


# Mixture-of-experts config.json files as transformers 5 writes them (MixtralConfig(...),
# Qwen3MoeConfig(...).to_json_string(); the Hub's Qwen3-MoE folders name the count num_experts),
# with 10^9 experts: 300 bytes that list 6 x 10^9 tensor names if nothing bounds them first.
MIXTRAL_CONFIG = {
    "attention_dropout": 0.0, "bos_token_id": 1, "eos_token_id": 2, "head_dim": None,
    "hidden_act": "silu", "hidden_size": 64, "initializer_range": 0.02, "intermediate_size": 128,
    "max_position_embeddings": 128, "model_type": "mixtral", "num_attention_heads": 4,
    "num_experts_per_tok": 2, "num_hidden_layers": 2, "num_key_value_heads": 2,
    "num_local_experts": 8, "output_router_logits": False, "pad_token_id": None,
    "rms_norm_eps": 1e-05, "rope_parameters": {"rope_theta": 1000000.0, "rope_type": "default"},
    "router_aux_loss_coef": 0.001, "router_jitter_noise": 0.0, "sliding_window": None,
    "tie_word_embeddings": False, "transformers_version": "5.24.0", "use_cache": True,
    "vocab_size": 256}
QWEN3_MOE_CONFIG = {
    "attention_bias": False, "attention_dropout": 0.0, "bos_token_id": None, "decoder_sparse_step": 1,
    "eos_token_id": None, "head_dim": 16, "hidden_act": "silu", "hidden_size": 64,
    "initializer_range": 0.02, "intermediate_size": 128, "max_position_embeddings": 128,
    "mlp_only_layers": [], "model_type": "qwen3_moe", "moe_intermediate_size": 32,
    "norm_topk_prob": False, "num_attention_heads": 4, "num_experts_per_tok": 8,
    "num_hidden_layers": 2, "num_key_value_heads": 2, "num_experts": 8,
    "output_router_logits": False, "pad_token_id": None, "rms_norm_eps": 1e-06,
    "rope_parameters": {"rope_theta": 10000.0, "rope_type": "default"},
    "router_aux_loss_coef": 0.001, "sliding_window": None, "tie_word_embeddings": False,
    "transformers_version": "5.24.0", "use_cache": True, "use_sliding_window": False,
    "vocab_size": 256}


def moe_config(name: str, config: dict):
    """A folder `name` of a config.json and an (empty) model.safetensors: what is refused is
    read from config.json, before any weight."""
    def setup(tmp: Path) -> None:
        (tmp / name).mkdir()
        (tmp / name / "config.json").write_text(json.dumps(config, indent=2))
        (tmp / name / "model.safetensors").write_bytes(b"")
    return setup


def tokenizer_symlink(tmp: Path) -> None:
    """tok/, a folder whose tokenizer.json is a symlink to a (valid) one outside it."""
    from raytrain_lm.data.tokenizer import train_bpe

    (tmp / "corp").mkdir()
    (tmp / "corp" / "a.txt").write_text("some words of text. " * 200)
    (tmp / "elsewhere").mkdir()
    (tmp / "elsewhere" / "tokenizer.json").write_bytes(train_bpe(["some words of text. " * 50], 300).raw)
    (tmp / "tok").mkdir()
    (tmp / "tok" / "tokenizer.json").symlink_to(tmp / "elsewhere" / "tokenizer.json")


def config_symlinks(tmp: Path) -> None:
    """run.yaml, and conf/ (a folder), symlinks in the project to files outside it."""
    (tmp / "elsewhere").mkdir()
    (tmp / "elsewhere" / "run.yaml").write_text("aws_secret_access_key: not-for-the-cluster\n")
    (tmp / "run.yaml").symlink_to(tmp / "elsewhere" / "run.yaml")
    (tmp / "conf").symlink_to(tmp / "elsewhere")


def empty_vocabulary(tmp: Path) -> None:
    from raytrain_lm.data.tokenizer import train_bpe

    (tmp / "corp").mkdir()
    (tmp / "corp" / "a.txt").write_text("some words of text. " * 200)
    tok = json.loads(train_bpe(["some words of text. " * 50], 300).raw)
    tok["model"].update(vocab={}, merges=[])
    tok["added_tokens"] = []
    (tmp / "empty.json").write_text(json.dumps(tok))


def two_text_columns(tmp: Path) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table([pa.array(["some text"] * 3), pa.array(["more"] * 3)], names=["text", "text"]),
                   tmp / "two.parquet")


def manifest_to_pagemap(tmp: Path, data: Path) -> None:
    import shutil

    shutil.copytree(data, tmp / "ds")
    (tmp / "ds" / "manifest.json").unlink()
    (tmp / "ds" / "manifest.json").symlink_to("/proc/self/pagemap")


SETUPS = {
    "alias-bomb": lambda tmp: (tmp / "bomb.yaml").write_text(ALIAS_BOMB),
    "config-symlink": config_symlinks,
    "empty-vocab": empty_vocabulary,
    "two-text-columns": two_text_columns,
    "arch-list": lambda tmp: (tmp / "arch.yaml").write_text("model:\n  arch: [llama]\n"),
    "preset-list": lambda tmp: (tmp / "preset.yaml").write_text("preset: [tiny]\n"),
    "checkpoint-record-pagemap": record_to_pagemap,
    "checkpoint-record-outside": record_outside,
    "checkpoint-record-symlink": record_through_symlink,
    "checkpoint-dcp-outside": dcp_metadata_outside,
    "checkpoint-meta-step": meta_with(step="x"),
    "checkpoint-meta-step-other": meta_with(step=4),  # valid, but not state.pt's 3
    "checkpoint-meta-version": meta_with(version="3"),
    "checkpoint-meta-newer": meta_with(version=99),
    "checkpoint-meta-format": meta_with(format="zip"),
    "checkpoint-meta-val-loss": meta_with(val_loss=[1]),
    "checkpoint-meta-config": meta_with(config=[]),
    "checkpoint-meta-model": meta_with(config={"model": {"n_layer": "x"}}),
    "checkpoint-meta-tokenizer": meta_with(tokenizer=["bpe"]),
    "hf": lambda tmp: hf_folder(tmp),
    "hf-heads-0": hf_config_with(num_attention_heads=0),
    "hf-heads-missing": hf_config_with(num_attention_heads="(left out)"),
    "hf-heads-text": hf_config_with(num_attention_heads="4"),
    "hf-rope-scaling-text": hf_config_with(rope_parameters=None, rope_scaling="linear"),
    "hf-rope-theta-text": hf_config_with(rope_parameters={"rope_type": "default", "rope_theta": "1e4"}),
    "hf-config-not-utf8": hf_config_bytes(b'{"model_type": "\xff"}'),
    "hf-config-deep": hf_config_bytes(b"[" * 100_000 + b"]" * 100_000),
    "hf-index-outside": hf_index_outside,
    "hf-symlinked-weights": hf_symlinked_weights,
    "hf-weight-shape": hf_weights_edit(lambda w: w.update({"model.norm.weight": w["model.norm.weight"][:16]})),
    "hf-weight-extra": hf_weights_edit(lambda w: w.update({"model.layers.0.self_attn.q_proj.bias":
                                                           w["model.norm.weight"].clone()})),
    "hf-weight-missing": hf_weights_edit(lambda w: w.pop("lm_head.weight")),
    "hf-header-damaged": hf_header_damaged,
    # round 4 (issue 48): sizes and numbers past any bound, dtypes that are no name
    "moe-mixtral-experts": moe_config("mix", {**MIXTRAL_CONFIG, "num_local_experts": 10 ** 9}),
    "moe-qwen3-experts": moe_config("qmoe", {**QWEN3_MOE_CONFIG, "num_experts": 10 ** 9}),
    "hf-rope-theta-huge": hf_config_with(rope_parameters={"rope_type": "default", "rope_theta": 10 ** 400}),
    "hf-norm-eps-huge": hf_config_with(rms_norm_eps=10 ** 400),
    "hf-rope-factor-huge": hf_config_with(rope_parameters={"rope_type": "linear", "factor": 10 ** 400,
                                                           "rope_theta": 10000.0}),
    "hf-dtype-list": hf_header_entry("model.norm.weight", dtype=["F32"]),
    "hf-dtype-object": hf_header_entry("model.norm.weight", dtype={"F32": 4}),
    "tokenizer-symlink": tokenizer_symlink,
}

HOLDS = {
    "alias-bomb": "bomb.yaml",
    "config-symlink": "run.yaml and conf/, symlinks to elsewhere/ (a secret in YAML)",
    "empty-vocab": "empty.json, corp/", "two-text-columns": "two.parquet", "arch-list": "arch.yaml",
    "preset-list": "preset.yaml",
    **{k: "ck/ (a checkpoint, crafted)" for k in SETUPS if k.startswith("checkpoint-")},
    **{k: "hf/ (a Hugging Face folder, crafted)" for k in SETUPS if k.startswith("hf")},
    "moe-mixtral-experts": "mix/ (a Mixtral's config.json: 10^9 experts)",
    "moe-qwen3-experts": "qmoe/ (a Qwen3-MoE's config.json: 10^9 experts)",
    "tokenizer-symlink": "corp/, tok/tokenizer.json (a symlink to elsewhere/tokenizer.json)",
}
