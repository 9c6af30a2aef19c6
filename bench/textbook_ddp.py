"""The outsider's baseline for `bench/overhead.py`: a textbook torchrun DDP loop, no Ray, no project loop.

What someone would write from PyTorch's DDP tutorial and nanoGPT: the project's `GPT` (the only
thing shared, so the model costs the same), random windows cut from the same Arrow token shards,
AdamW, gradient clipping, the preset's learning rate held constant, and one loss all-reduce every
10 steps. No metrics rows, no validation, no checkpoints: the whole process is timed from outside.

    OMP_NUM_THREADS=1 torchrun --standalone --nproc_per_node 2 bench/textbook_ddp.py \
        --data data/pydoc --max-steps 300
"""

from __future__ import annotations

import argparse
import os

import numpy as np
import pyarrow as pa
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from raytrain_lm.config.load import build_config
from raytrain_lm.data.manifest import load_manifest
from raytrain_lm.models.gpt.gpt import GPT


def load_tokens(data_dir: str) -> np.ndarray:
    """Every train token, memory-mapped from the Arrow shards and joined."""
    shards = []
    for shard in load_manifest(data_dir)["train"]["shards"]:
        source = pa.memory_map(os.path.join(data_dir, shard["file"]), "r")
        shards.append(pa.ipc.open_file(source).get_batch(0).column(0).to_numpy(zero_copy_only=True))
    return np.concatenate(shards)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="tiny")
    p.add_argument("--data", default="data/pydoc")
    p.add_argument("--max-steps", type=int, default=300)
    args = p.parse_args(argv)
    cfg = build_config(preset=args.preset, flags={"data": args.data})
    cfg.model.vocab_size = cfg.model.vocab_size or load_manifest(args.data)["vocab_size"]

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    tokens = load_tokens(args.data)
    rng = np.random.default_rng(cfg.seed + rank)
    torch.manual_seed(cfg.seed)
    model = DDP(GPT(cfg.model))
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr, betas=(0.9, 0.95),
                                  weight_decay=cfg.weight_decay)
    loss_sum = torch.zeros(())
    for step in range(1, args.max_steps + 1):
        starts = rng.integers(0, len(tokens) - cfg.seq_len - 1, cfg.batch_size)
        batch = torch.from_numpy(np.stack([tokens[s: s + cfg.seq_len + 1] for s in starts]).astype(np.int64))
        _, loss = model(batch[:, :-1], batch[:, 1:])
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        loss_sum += loss.detach()
        if step % 10 == 0:
            dist.all_reduce(loss_sum)
            if rank == 0 and step % 100 == 0:
                print(f"step {step} loss {loss_sum.item() / 10 / dist.get_world_size():.4f}", flush=True)
            loss_sum.zero_()
    dist.barrier()  # no rank tears gloo down while its peer still talks (SIGABRT at exit)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
