#!/usr/bin/env python
"""Loading a Hugging Face folder on 2 FSDP workers, and exporting one, against transformers.

1. A sharded folder is generated (bf16, safetensors shards of --shard-size with an index, a
   config.json): by default Llama 3.2 1B's shape with an untied head (1.50B parameters, 3.0 GB).
2. Two worker processes (gloo, one thread each, the project's own build: parallelize with
   --strategy fsdp, then worker/hf_load.load_hf_weights, what `train --init-from` runs on each
   Ray Train worker) load it. Per worker: seconds to build (meta -> sharded -> materialised) and
   to load; peak resident memory while loading (the kernel's VmHWM, reset just before the load
   with /proc/self/clear_refs) above the worker's RSS before its model existed, against its
   share (the bytes of the parameters it holds) + the folder's largest tensor; bytes read.
   Then the workers save a checkpoint of the model (the project's format, dcp/).
3. `export --format hf` of that checkpoint in a process of its own (bf16, --shard-size):
   seconds and peak RSS above the process's RSS before the export.
4. transformers in one process: `AutoModelForCausalLM.from_pretrained` of the same folder
   (seconds, peak RSS above the process's RSS after importing transformers), as it loads by
   default (the folder's bf16, mapped from the files: read at first use), the same with every
   weight then read once, and in float32 (every weight read and converted, as our workers hold
   it); then the export is loaded the same way and every tensor compared with the
   folder's (bf16 -> fp32 -> bf16 is exact).

    python bench/hf_load.py --dir /tmp/hfbench                 # ~3 GB folder, ~10 GB of disk
    python bench/hf_load.py --dir /tmp/hfbench --layers 2      # a quick run

The machine's other load moves the seconds; the phases run one after another, never together.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Optional

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

GB = 1e9


def rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def reset_peak() -> None:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # VmHWM := VmRSS


def peak() -> int:
    with open("/proc/self/status") as f:
        line = next(x for x in f if x.startswith("VmHWM:"))
    return int(line.split()[1]) * 1024


def model_sets(args) -> list[str]:
    return ["model.arch=llama", "model.bias=false", f"model.vocab_size={args.vocab}",
            f"model.n_layer={args.layers}", f"model.n_embd={args.width}", f"model.n_head={args.heads}",
            f"model.n_kv_head={args.kv_heads}", f"model.ffn_dim={args.ffn}", "model.block_size=2048",
            "model.rope_theta=500000", "model.dropout=0"]


def train_config(args):
    from raytrain_lm.config.load import build_config

    return build_config(sets=model_sets(args), flags=dict(workers=2, strategy="fsdp", batch_size=1,
                                                          seq_len=128, name="hf-bench"))


def synthetic_tokenizer(vocab: int) -> bytes:
    """A byte-level BPE tokenizer.json of `vocab` ids (the 256 bytes, <|endoftext|>, filler
    tokens no merge reaches): what export needs to keep every row of the embedding."""
    from raytrain_lm.data.tokenizer import EOT
    from raytrain_lm.data.vocab import bytes_to_unicode

    table = {c: i for i, c in enumerate(bytes_to_unicode().values())}
    table.update({f"t{i}": i for i in range(257, vocab)})
    return json.dumps({
        "version": "1.0", "truncation": None, "padding": None, "normalizer": None,
        "added_tokens": [{"id": 256, "content": EOT, "single_word": False, "lstrip": False,
                          "rstrip": False, "normalized": False, "special": True}],
        "pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True,
                          "use_regex": True},
        "post_processor": None, "decoder": {"type": "ByteLevel", "add_prefix_space": True,
                                            "trim_offsets": True, "use_regex": True},
        "model": {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": None,
                  "end_of_word_suffix": None, "fuse_unk": False, "byte_fallback": False,
                  "ignore_merges": False, "vocab": {**table, EOT: 256}, "merges": []},
    }).encode()


def tiny(args) -> argparse.Namespace:
    """A one-layer model of the same family: loaded first on each side, so neither side's
    timing includes its first-use imports."""
    return argparse.Namespace(**{**vars(args), "layers": 1, "width": 64, "heads": 2, "kv_heads": 1,
                                 "ffn": 128, "vocab": 512})


def make_folder(args, folder: Path) -> dict:
    """The sharded bf16 folder, written a tensor at a time with export's writer."""
    import torch

    from raytrain_lm.models import hf_adapter
    from raytrain_lm.results.export import parse_size
    from raytrain_lm.results.hf_export import SHARD_NAME, plan, split
    from raytrain_lm.store.hf_folder import HF_CONFIG, HF_INDEX
    from raytrain_lm.store.safetensors_io import SafetensorsWriter

    m = train_config(args).model
    tensors = plan(m, m.vocab_size, torch.bfloat16)
    shards = split([e for _, e in tensors], parse_size(args.shard_size))
    folder.mkdir(parents=True)
    weight_map, g = {}, torch.Generator().manual_seed(0)
    for i, entries in enumerate(shards):
        name = SHARD_NAME.format(i + 1, len(shards))
        writer = SafetensorsWriter(folder / name, entries, metadata={"format": "pt"})
        for hf, dtype, shape in entries:
            t = torch.randn(shape, generator=g) * 0.02 if len(shape) > 1 else torch.ones(shape)
            writer.write(hf, t.to(dtype))
            weight_map[hf] = name
        writer.close()
    sizes = [e[1].itemsize * int(torch.Size(e[2]).numel()) for _, e in tensors]
    (folder / HF_INDEX).write_text(json.dumps({"metadata": {"total_size": sum(sizes)},
                                               "weight_map": weight_map}, indent=2))
    config = {**hf_adapter(m).hf_config(m, m.vocab_size, 256), "dtype": "bfloat16"}
    (folder / HF_CONFIG).write_text(json.dumps(config, indent=2))
    (folder / "tokenizer.json").write_bytes(synthetic_tokenizer(m.vocab_size))
    return {"bytes": sum(sizes), "largest_tensor_bytes": max(sizes), "shards": len(shards),
            "parameters": sum(sizes) // 2}


def worker(rank: int, port: int, args, folder: str, ckpt: Optional[str], out: str) -> None:
    import torch
    import torch.distributed as dist

    from raytrain_lm.parallel import parallelize
    from raytrain_lm.worker.hf_load import load_hf_weights

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2)
    warm = parallelize(train_config(tiny(args)), torch.device("cpu"), init=False)
    load_hf_weights(Path(folder).parent / "warmup", warm.parts, warm.cfg.model)
    del warm
    cfg = train_config(args)
    floor = rss()
    t0 = time.perf_counter()
    built = parallelize(cfg, torch.device("cpu"), init=False)  # as train --init-from builds it
    t1 = time.perf_counter()
    built_rss = rss()
    reset_peak()
    stats = load_hf_weights(folder, built.parts, cfg.model)
    t2 = time.perf_counter()
    load_peak = peak()
    share = sum(p.to_local().nbytes if hasattr(p, "to_local") else p.nbytes
                for part in built.parts for p in part.parameters())
    dist.barrier()
    t3 = t4 = time.perf_counter()
    if ckpt is not None:
        t3, t4 = save(built, cfg, rank, folder, ckpt)
    Path(out, f"rank{rank}.json").write_text(json.dumps({
        "build_s": t1 - t0, "load_s": t2 - t1, "save_s": t4 - t3, "floor_rss": floor,
        "built_rss": built_rss, "load_peak_rss": load_peak, "share_bytes": share,
        "bytes_read": stats.bytes_read, "files": stats.files, "tensors": stats.tensors}))
    dist.destroy_process_group()


def save(built, cfg, rank: int, folder: str, ckpt: str) -> tuple[float, float]:
    """The workers' checkpoint of the model, in the project's format: (start, end) times."""
    import torch
    import torch.distributed as dist

    from raytrain_lm.data.tokenizer import BPETokenizer
    from raytrain_lm.store.checkpoint_format import save_checkpoint

    tok = BPETokenizer(Path(folder) / "tokenizer.json")
    # a checkpoint of the model alone: SGD without momentum holds no state (AdamW's two moments
    # would double what the workers save, and the export reads the model only)
    step = type("Step", (), {"parts": built.parts,
                             "optimizers": [torch.optim.SGD(p.parameters(), lr=0.0) for p in built.parts]})
    state = {"scaler": None, "step": 0, "tokens": 0, "data": {}, "world_size": 2, "val_loss": None,
             "recent_metrics": [], "config": cfg.to_dict(), "tokenizer": tok.spec()} if rank == 0 else None
    t3 = time.perf_counter()
    save_checkpoint(Path(ckpt), rank, step, state, tokenizer_raw=tok.raw if rank == 0 else None)
    dist.barrier()
    return t3, time.perf_counter()


def run_workers(args, folder: Path, ckpt: Optional[Path], out: Path) -> list[dict]:
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out.mkdir()
    mp.start_processes(worker, args=(port, args, str(folder), ckpt and str(ckpt), str(out)), nprocs=2,
                       start_method="spawn")
    return [json.loads(Path(out, f"rank{r}.json").read_text()) for r in range(2)]


def phase_export(args) -> dict:
    """In a process of its own: export --format hf of the workers' checkpoint."""
    import torch

    from raytrain_lm.results.hf_export import export_checkpoint_hf
    from raytrain_lm.store.checkpoint_format import read_meta

    torch.set_num_threads(2)
    base = Path(args.dir)
    floor = rss()
    reset_peak()
    t0 = time.perf_counter()
    meta = read_meta(base / "ckpt")  # what export checks first: every file's sha256
    t1 = time.perf_counter()
    config = export_checkpoint_hf(base / "ckpt", base / "export", dtype="bf16", meta=meta,
                                  max_shard_size=args.shard_size)
    t2 = time.perf_counter()
    return {"export_s": t2 - t0, "checksums_s": t1 - t0, "floor_rss": floor, "peak_rss": peak(),
            "files": config["files"]}


def phase_transformers(args) -> dict:
    """In a process of its own: from_pretrained of the folder, timed, three ways."""
    import torch
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(2)
    base = Path(args.dir)
    AutoModelForCausalLM.from_pretrained(base / "warmup")
    timed = {}
    # default: the folder's bf16, which transformers maps from the files and reads at first use;
    # "default, read": the same, then every weight read once (what a first forward pass pays);
    # float32: every weight read and converted, as our workers hold them
    for kind in ("default", "default, read", "float32"):
        floor = rss()
        reset_peak()
        t0 = time.perf_counter()
        model = AutoModelForCausalLM.from_pretrained(
            base / "folder", **({"dtype": torch.float32} if kind == "float32" else {}))
        if kind == "default, read":
            with torch.no_grad():
                for p in model.parameters():
                    p.sum()
        timed[kind] = {"from_pretrained_s": time.perf_counter() - t0, "floor_rss": floor,
                       "peak_rss": peak(), "dtype": str(next(model.parameters()).dtype)}
        del model
    return timed


def phase_verify(args) -> dict:
    """In a process of its own: the export loaded by transformers, every tensor compared with
    the folder's."""
    import torch
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM

    base = Path(args.dir)
    exported = AutoModelForCausalLM.from_pretrained(base / "export").state_dict()
    index = json.loads((base / "folder" / "model.safetensors.index.json").read_text())["weight_map"]
    same = 0
    for name, file in index.items():
        with safe_open(base / "folder" / file, "pt") as f:
            if not torch.equal(f.get_tensor(name), exported[name]):
                raise SystemExit(f"the export's {name} differs from the folder's")
        same += 1
    return {"export_tensors_equal": same, "export_tensors": len(exported)}


def in_process(phase: str, args) -> dict:
    cmd = [sys.executable, __file__, "--phase", phase, "--dir", args.dir, "--shard-size", args.shard_size]
    r = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(ROOT),
                                                                 "TRANSFORMERS_VERBOSITY": "error",
                                                                 "HF_HUB_OFFLINE": "1"})
    if r.returncode:
        raise SystemExit(f"{phase} failed:\n{r.stderr[-3000:]}")
    return json.loads(r.stdout.strip().splitlines()[-1])


def spread(values: list[float]) -> str:
    return f"{statistics.median(values):.2f} ({min(values):.2f}-{max(values):.2f})"


def report(folder: dict, rounds: list[dict], export: dict, verify: dict) -> None:
    largest = folder["largest_tensor_bytes"]
    workers = [w for r in rounds for w in r["ours"]]
    worst = max(workers, key=lambda w: (w["load_peak_rss"] - w["floor_rss"]) / (w["share_bytes"] + largest))
    above, bound = worst["load_peak_rss"] - worst["floor_rss"], worst["share_bytes"] + largest
    print(f"per worker, the worst of {len(workers)}: peak RSS while loading {above / GB:.2f} GB above its "
          f"floor = {above / bound:.3f} x (share {worst['share_bytes'] / GB:.2f} GB + largest tensor "
          f"{largest / GB:.3f} GB): {'within' if above <= 1.1 * bound else 'OVER'} the 1.1 x bound; "
          f"{worst['bytes_read'] / GB:.2f} GB read from {worst['files']} files")
    ours = [max(w["load_s"] for w in r["ours"]) for r in rounds]
    built = [max(w["build_s"] + w["load_s"] for w in r["ours"]) for r in rounds]
    print(f"ours, 2 FSDP workers: load {spread(ours)} s, build + load {spread(built)} s "
          f"(median, range over {len(rounds)} rounds); save {rounds[0]['ours'][0]['save_s']:.1f} s")
    for kind in rounds[0]["transformers"]:
        theirs = [r["transformers"][kind] for r in rounds]
        t = [x["from_pretrained_s"] for x in theirs]
        ratio = [o / x for o, x in zip(built, t)]
        print(f"transformers from_pretrained, one process, {kind} ({theirs[0]['dtype']}): {spread(t)} s, "
              f"peak RSS {max(x['peak_rss'] - x['floor_rss'] for x in theirs) / GB:.2f} GB above its floor; "
              f"ours (build + load) / it, same round: {spread(ratio)}")
    above = export["peak_rss"] - export["floor_rss"]
    print(f"export --format hf (bf16, {len(export['files'])} files): {export['export_s']:.1f} s (checking "
          f"the checkpoint's checksums {export['checksums_s']:.1f} s of it), peak RSS {above / GB:.2f} GB "
          f"above its floor = {above / (2 * largest):.2f} x the largest tensor as the checkpoint holds it "
          f"(fp32, {2 * largest / GB:.3f} GB); transformers loads it, {verify['export_tensors_equal']}/"
          f"{verify['export_tensors']} tensors equal to the folder's")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dir", required=True, help="a new folder for the Hub folder, checkpoint and export")
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--width", type=int, default=2048)
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--ffn", type=int, default=8192)
    ap.add_argument("--vocab", type=int, default=128256)
    ap.add_argument("--shard-size", default="1GB", help="the folder's and the export's shards")
    ap.add_argument("--reps", type=int, default=3, help="rounds of ours and transformers' loads, "
                    "alternating which goes first")
    ap.add_argument("--phase", choices=list(PHASES), help=argparse.SUPPRESS)
    ap.add_argument("--out", help="write the figures as JSON here")
    args = ap.parse_args()
    if args.phase:
        print(json.dumps(PHASES[args.phase](args)))
        return
    base = Path(args.dir)
    base.mkdir(parents=True, exist_ok=False)
    make_folder(tiny(args), base / "warmup")
    t0 = time.perf_counter()
    folder = make_folder(args, base / "folder")
    print(f"folder: {folder['parameters'] / 1e9:.2f}B parameters, {folder['bytes'] / GB:.2f} GB bf16 in "
          f"{folder['shards']} shards, largest tensor {folder['largest_tensor_bytes'] / GB:.3f} GB "
          f"({time.perf_counter() - t0:.0f} s to write)", flush=True)
    rounds = []
    for i in range(args.reps):  # ours first in even rounds, transformers first in odd ones
        got = {}
        for side in ("ours", "transformers")[::1 if i % 2 == 0 else -1]:
            got[side] = run_workers(args, base / "folder", base / "ckpt" if i == 0 else None,
                                    base / f"ranks{i}") if side == "ours" else in_process("transformers", args)
        rounds.append(got)
        print(f"round {i + 1}: ours load {max(w['load_s'] for w in got['ours']):.1f} s, transformers "
              + ", ".join(f"{k} {v['from_pretrained_s']:.1f} s" for k, v in got["transformers"].items()),
              flush=True)
    export = in_process("export", args)
    verify = in_process("verify", args)
    report(folder, rounds, export, verify)
    if args.out:
        Path(args.out).write_text(json.dumps({"folder": folder, "rounds": rounds, "export": export,
                                              "verify": verify, "machine": platform.processor() or
                                              platform.machine()}, indent=2))


PHASES = {"export": phase_export, "transformers": phase_transformers, "verify": phase_verify}

if __name__ == "__main__":
    main()
