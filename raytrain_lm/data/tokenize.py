"""Tokenizing a planned corpus (data/sources.py units), in corpus order: in this process, or in
parallel Ray tasks on Ray Data, which scales `prepare` from a laptop to a cluster.

Either way every unit is tokenized by the same function, and the results come back in the
units' order (Ray Data's preserve_order), so the shards written from them are byte-identical
whatever the number of CPUs.

Why not Ray Data's read_text: it reads each file whole into one task and splits it into lines,
dropping the line endings (`splitlines`), so a text file would neither be one document nor come
back byte for byte; and read_json infers one schema across rows. Our units are read by the tasks
themselves (pyarrow filesystems: local paths, s3://, gs://), a large file in ~1 MiB pieces.
"""

from __future__ import annotations

from typing import Iterator, Optional

import numpy as np

from raytrain_lm.data.sources import Unit, read_unit
from raytrain_lm.files import TOKENIZER
from raytrain_lm.tokenizer import Tokenizer


def tokenize_unit(unit: Unit, tok: Tokenizer) -> tuple[np.ndarray, bool]:
    """(token ids of the unit, whether it opens a document). Documents inside a unit are joined
    by the tokenizer's separator; the writer puts one before a unit that opens a document when
    something came before it.

    One text at a time on purpose: a BPE's encode_batch would spread over Rust threads, and in a
    Ray task (1 CPU each) those threads only compete with the other tasks."""
    texts = read_unit(unit)
    sep = tok.separator()
    parts: list[np.ndarray] = []
    for i, text in enumerate(texts):
        if i:
            parts.append(sep)
        parts.append(tok.encode(text))
    ids = np.concatenate(parts).astype(tok.dtype, copy=False) if parts else np.empty(0, tok.dtype)
    return ids, unit.opens_document and bool(texts)


def tokenize_here(units: list[Unit], tok: Tokenizer) -> Iterator[tuple[np.ndarray, bool]]:
    for unit in units:
        yield tokenize_unit(unit, tok)


# A Ray worker process runs many tasks: each builds a tokenizer once (parsing a BPE's JSON
# takes up to a second) and keeps it, keyed by the reference to its JSON.
_TOKENIZERS: dict[str, Tokenizer] = {}


def _tokenize_batch(batch: dict, raw_ref: list) -> dict:
    """A Ray Data task: the units of `batch` (one, in practice) -> their tokens, as bytes."""
    import ray

    from raytrain_lm.tokenizer import BPETokenizer, ByteTokenizer

    key = raw_ref[0].hex()
    if key not in _TOKENIZERS:
        raw = ray.get(raw_ref[0])
        _TOKENIZERS.clear()  # one prepare at a time per process: keep only the current one
        _TOKENIZERS[key] = ByteTokenizer() if raw is None else BPETokenizer(TOKENIZER, raw=raw)
    tok = _TOKENIZERS[key]
    tokens, opens = [], []
    for text in batch["unit"]:
        ids, o = tokenize_unit(Unit.from_json(text), tok)
        tokens.append(ids.tobytes())
        opens.append(o)
    return {"tokens": np.array(tokens, dtype=object), "opens": np.array(opens, dtype=bool)}


def tokenize_on_ray(units: list[Unit], tok: Tokenizer,
                    cpus: Optional[int] = None) -> Iterator[tuple[np.ndarray, bool]]:
    """The same results as tokenize_here, from at most `cpus` Ray Data tasks at once (default:
    one per CPU of the cluster Ray is connected to). Results stream back in order, as the writer
    takes them. Tasks, not an actor pool: Ray 2.60 warns about every Ray Data actor's arguments."""
    import logging

    import ray
    import ray.data

    ctx = ray.data.DataContext.get_current()
    ctx.execution_options.preserve_order = True  # results in the units' order: the same shards
    ctx.enable_progress_bars = False  # `prepare` shows its own progress line
    ctx.print_on_execution_start = False
    # Ray Data reserves part of the cluster for each operator's outputs; with one operator on a
    # small cluster that kept a CPU idle (measured on 2 CPUs: 9-10 s with it, 7.8 s without, for
    # the stdlib corpus). There is nothing downstream to reserve for: the writer is this process.
    ctx.op_resource_reservation_enabled = False
    logging.getLogger("ray.data").setLevel(logging.ERROR)  # its start/finish notices
    tasks = min(cpus or max(1, int(ray.cluster_resources().get("CPU", 1))), len(units))
    # The tokenizer's JSON (up to megabytes) is put once; tasks get a reference inside a list,
    # which Ray passes as is rather than resolving it for every task.
    raw_ref = [ray.put(tok.raw)]
    ds = ray.data.from_items([{"unit": u.to_json()} for u in units], override_num_blocks=len(units))
    ds = ds.map_batches(_tokenize_batch, fn_kwargs={"raw_ref": raw_ref}, batch_size=1, num_cpus=1,
                        compute=ray.data.TaskPoolStrategy(size=tasks))
    for batch in ds.iter_batches(batch_size=None, batch_format="numpy"):
        for data, opens in zip(batch["tokens"], batch["opens"]):
            yield np.frombuffer(data, dtype=tok.dtype), bool(opens)
