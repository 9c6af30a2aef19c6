#!/usr/bin/env python
"""What `--doc-mask` costs a CPU step, measured: one process, the Llama (GQA 8/2), a window of
--seq tokens packing documents of --doc tokens each, forward and backward of the model:

  causal  no span: SDPA's causal path (the fused CPU flash kernel, no mask tensor)
  doc     --doc-mask's span: SDPA with the dense additive mask of the block-causal rule

alternated for --rounds rounds (the machine's load drifts): the median step time of each, and
the peak of live tensors beyond the model's own (torch's MemTracker) of one step each.

    python bench/doc_mask_cost.py                 # 4 layers, width 256, 2048 tokens, 256-token docs
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from cp_ring import peak_bytes


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--width", type=int, default=256)
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--doc", type=int, default=256)
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()

    from raytrain_lm.models import build_model
    from raytrain_lm.models.attention import using
    from raytrain_lm.models.family import ModelConfig
    from raytrain_lm.parallel.cp import ContextParallel

    torch.set_num_threads(1)
    m = ModelConfig(arch="llama", bias=False, vocab_size=256, block_size=args.seq, n_layer=args.layers,
                    n_head=8, n_kv_head=2, n_embd=args.width, multiple_of=32)
    model = build_model(m, seed=1)
    window = torch.randint(1, 256, (1, args.seq + 1), generator=torch.Generator().manual_seed(0))
    window[:, ::args.doc] = 0  # token 0 opens each document
    x, y = window[:, :-1], window[:, 1:]

    def span():
        return ContextParallel(1, 0, None, separator=0).shard(x, y)[2]

    def step(s):
        model.zero_grad(set_to_none=True)
        with using(s):
            model(x, y)[1].backward()

    times = {"causal": [], "doc": []}
    step(None), step(span())  # warm-up
    for _ in range(args.rounds):
        for name in times:
            s = span() if name == "doc" else None  # the mask is built per step, as training does
            t = time.perf_counter()
            step(s)
            times[name].append(time.perf_counter() - t)
    report = {name: {"step_s": statistics.median(t), "spread_s": [min(t), max(t)],
                     "peak_mib": peak_bytes(model, x, y, span() if name == "doc" else None) / 2**20}
              for name, t in times.items()}
    report["doc_over_causal_time"] = report["doc"]["step_s"] / report["causal"]["step_s"] - 1
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
