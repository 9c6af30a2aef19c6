"""What counting bytes as read costs `prepare`: for a tokenizer that rewrites text (Qwen's NFC,
Llama 2's Prepend/Replace, Mistral's Metaspace) each document is encoded with offsets and every
token's share of the document's bytes is computed (Tokenizer.encode_counted); an exact tokenizer
(Llama 3) encodes without offsets. Per family, the built-in pydoc corpus (every topic, one
document each) encoded both ways in one thread, the order alternated each repetition.

The tokenizers are tests/hub_tokenizers.py's folders (transformers' converters, vocabularies of
600-700 tokens trained here), so tokens per second are not a release's; the ratio is what this
measures.

    nice -n 10 python bench/byte_shares.py --reps 5
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

FAMILIES = ("qwen2", "llama2", "mistral", "llama3")


def timed(fn, docs) -> float:
    t0 = time.perf_counter()
    for d in docs:
        fn(d)
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "byte_shares.json"))
    args = ap.parse_args()
    os.environ.setdefault("RAYON_NUM_THREADS", "1")

    from hub_tokenizers import family_folder
    from raytrain_lm.data.sources import _pydoc_topics
    from raytrain_lm.data.tokenizer import make_tokenizer

    docs = _pydoc_topics()
    mb = sum(len(d.encode()) for d in docs) / 1e6
    rows = []
    for name in FAMILIES:
        tok = make_tokenizer(str(family_folder(name)))
        sides = {"encode": tok.encode, "encode_counted": tok.encode_counted}
        times = {k: [] for k in sides}
        for rep in range(args.reps):
            for k in (list(sides) if rep % 2 == 0 else list(reversed(sides))):
                times[k].append(timed(sides[k], docs))
        med = {k: statistics.median(v) for k, v in times.items()}
        rows.append({"family": name, "exact": tok.exact, "mb": mb,
                     **{f"{k}_s": v for k, v in times.items()},
                     "ratio": med["encode_counted"] / med["encode"]})
        print(f"{name:8} exact={tok.exact!s:5} encode {mb / med['encode']:.2f} MB/s "
              f"(min {min(times['encode']):.3f} max {max(times['encode']):.3f} s), counted "
              f"{mb / med['encode_counted']:.2f} MB/s (min {min(times['encode_counted']):.3f} max "
              f"{max(times['encode_counted']):.3f} s): {rows[-1]['ratio']:.2f}x the time")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(rows, indent=2) + "\n")


if __name__ == "__main__":
    main()
