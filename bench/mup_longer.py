"""A longer look at one point of bench/mup_transfer.py's sweeps: is a wide mup model better than
its base once training leaves the first plateau? The base (width 64) and width 256 under mup at
the base's best lr of the short sweep (2^-9), and width 256 under sp at its own best (2^-10),
each --steps steps (the sweep's settings otherwise: depth 2, batch 8 x 32 bytes, warmup 10%,
cosine; one seed), the final validation loss of each.

    PYTHONPATH=. nice -n 10 python bench/mup_longer.py --out bench/results/mup_longer.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))

from mup_coord_check import corpus_bytes  # noqa: E402
from mup_transfer import train_run  # noqa: E402

POINTS = (("mup", 64, -9), ("mup", 256, -9), ("sp", 256, -10))


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=600)
    p.add_argument("--out", default=str(ROOT / "bench" / "results" / "mup_longer.json"))
    args = p.parse_args(argv)
    import torch

    torch.set_num_threads(1)
    data = corpus_bytes()
    cut = int(0.9 * len(data))
    out = {"steps": args.steps, "runs": []}
    for param, width, log2_lr in POINTS:
        t0 = time.time()
        loss = train_run(width, param, 64, 2.0 ** log2_lr, args.steps, data[:cut], data[cut:],
                         depth=2, batch=8, seq=32)
        out["runs"].append(dict(param=param, width=width, log2_lr=log2_lr, val_loss=loss,
                                seconds=time.time() - t0))
        print(out["runs"][-1], flush=True)
        Path(args.out).write_text(json.dumps(out, indent=1))
    return out


if __name__ == "__main__":
    main()
