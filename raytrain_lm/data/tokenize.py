"""Tokenizing a planned corpus (data/sources.py units), in corpus order: in threads of this
process, or in parallel Ray tasks, which scales `prepare` from a laptop to a cluster.

Either way every unit is tokenized by the same function, and the results are taken in the
units' order, so the shards written from them are byte-identical whatever the number of CPUs.
The tasks read their units themselves (pyarrow filesystems: local paths, s3://, gs://), a large
file in ~1 MiB pieces.

Why plain tasks and not Ray Data: its read_text reads each file whole into one task and splits
it into lines, dropping the line endings, so a text file would neither be one document nor come
back byte for byte, and read_json infers one schema across rows; and as a scheduler for our own
units it was slower than these tasks in every repetition on 2 CPUs (bench/prepare.py: medians
1.01-1.15x one process against 1.33-1.54x). One threaded actor per run, sharing one tokenizer,
was no faster than these tasks (1.52x and 1.69x against 1.46x and 1.70x), and a task is retried
when its node dies where an actor's call is not.
"""

from __future__ import annotations

import collections
from typing import TYPE_CHECKING, Callable, Iterator, Optional

import numpy as np

from raytrain_lm.data.sources import Unit, read_unit
from raytrain_lm.data.tokenizer import BPETokenizer, ByteTokenizer, Tokenizer
from raytrain_lm.store.files import TOKENIZER

if TYPE_CHECKING:
    import ray


Tokens = tuple[np.ndarray, Optional[np.ndarray], bool]


def tokenize_unit(unit: Unit, tok: Tokenizer) -> Tokens:
    """(token ids of the unit, each token's share of the text's bytes as read or None where the
    tokenizer is exact, whether the unit opens a document). Documents inside a unit are joined by
    the tokenizer's separator (which counts for no bytes); the writer puts one before a unit that
    opens a document when something came before it.

    One text at a time on purpose: a BPE's encode_batch would spread over Rust threads, and in a
    Ray task (1 CPU each) those threads only compete with the other tasks."""
    texts = read_unit(unit)
    sep = tok.separator()
    parts: list[np.ndarray] = []
    shares: list[np.ndarray] = []
    for i, text in enumerate(texts):
        if i:
            parts.append(sep)
            shares.append(np.zeros(len(sep), dtype=np.int64))
        ids, counts = tok.encode_counted(text, continued=i == 0 and not unit.opens_document)
        parts.append(ids)
        if counts is not None:
            shares.append(counts)
    ids = np.concatenate(parts).astype(tok.dtype, copy=False) if parts else np.empty(0, tok.dtype)
    counts = None
    if not tok.exact:
        counts = np.concatenate(shares) if shares else np.empty(0, np.int64)
    return ids, counts, unit.opens_document and bool(texts)


def tokenize_here(units: list[Unit], tok: Tokenizer, threads: int = 1) -> Iterator[Tokens]:
    """The units tokenized in this process, `threads` at once (a BPE's encode releases the GIL),
    taken in the units' order; at most 2 x `threads` units' tokens are held here."""
    if threads <= 1:
        for unit in units:
            yield tokenize_unit(unit, tok)
        return
    from concurrent.futures import ThreadPoolExecutor

    ahead = 2 * threads
    with ThreadPoolExecutor(threads) as pool:
        pending = collections.deque(pool.submit(tokenize_unit, u, tok) for u in units[:ahead])
        for i in range(len(units)):
            result = pending.popleft().result()
            if i + ahead < len(units):
                pending.append(pool.submit(tokenize_unit, units[i + ahead], tok))
            yield result


# A Ray worker process runs many tasks: each builds a tokenizer once (parsing a BPE's JSON
# takes up to a second) and keeps it, keyed by the reference to its JSON.
_TOKENIZERS: dict[str, Tokenizer] = {}


def task_tokenizer(raw_ref: list) -> Tokenizer:
    """The tokenizer behind `raw_ref` ([ObjectRef] of (its JSON, None for bytes; its documents'
    begin ids; their end ids)), built once per worker process."""
    import ray

    key = raw_ref[0].hex()
    if key not in _TOKENIZERS:
        raw, begin, end = ray.get(raw_ref[0])
        _TOKENIZERS.clear()  # one prepare at a time per process: keep only the current one
        tok = ByteTokenizer() if raw is None else BPETokenizer(TOKENIZER, raw=raw)
        tok.doc_begin, tok.doc_end = begin, end
        _TOKENIZERS[key] = tok
    return _TOKENIZERS[key]


def _tokenize_task(unit_json: str, raw_ref: list) -> tuple[bytes, Optional[bytes], bool]:
    """A Ray task: one unit -> (its tokens as bytes, their byte shares as int64 bytes or None,
    whether it opens a document)."""
    ids, counts, opens = tokenize_unit(Unit.from_json(unit_json), task_tokenizer(raw_ref))
    return ids.tobytes(), None if counts is None else counts.tobytes(), opens


def tokenize_on_ray(units: list[Unit], tok: Tokenizer,
                    cpus: Optional[int] = None) -> Iterator[Tokens]:
    """The same results as tokenize_here, from Ray tasks of one CPU, `cpus` at once (default: one
    per CPU of the cluster Ray is connected to). A task that finishes early gets the next unit at
    once and its result waits here for its turn, up to 2 x `cpus` units' tokens held here."""
    import ray

    tasks = tasks_at_once(cpus, len(units))
    # The tokenizer's JSON (up to megabytes) is put once; tasks get a reference inside a list,
    # which Ray passes as is rather than resolving it for every task.
    raw_ref = [ray.put((tok.raw, tok.doc_begin, tok.doc_end))]
    remote = ray.remote(num_cpus=1)(_tokenize_task)
    for data, counts, opens in results_in_order(lambda i: remote.remote(units[i].to_json(), raw_ref),
                                                len(units), tasks):
        yield (np.frombuffer(data, dtype=tok.dtype),
               None if counts is None else np.frombuffer(counts, dtype=np.int64), opens)


def tasks_at_once(cpus: Optional[int], count: int) -> int:
    """How many of `count` calls run on Ray at once: `cpus`, else one per CPU of the cluster Ray
    is connected to, and never more than there are calls."""
    import ray

    return min(cpus or max(1, int(ray.cluster_resources().get("CPU", 1))), count)


def results_in_order(submit: Callable[[int], "ray.ObjectRef"], count: int,
                     at_once: int) -> Iterator:
    """The values of submit(0), ..., submit(count - 1), in that order, `at_once` of them running:
    one that finishes early makes room for the next, and its value waits here for its turn, at
    most 2 x `at_once` values held."""
    import ray

    running: dict = {}  # reference -> its index
    done: dict = {}
    submitted = 0
    for turn in range(count):
        while True:
            while submitted < count and len(running) < at_once and len(running) + len(done) < 2 * at_once:
                running[submit(submitted)] = submitted
                submitted += 1
            if turn in done:
                break
            ready, _ = ray.wait(list(running), num_returns=1)
            done[running.pop(ready[0])] = ray.get(ready[0])
        yield done.pop(turn)
