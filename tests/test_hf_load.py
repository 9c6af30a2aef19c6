"""--init-from a Hugging Face folder at any size (worker/hf_load.py), on two real gloo processes
and no Ray: each rank reads only the slices it keeps, shard file by shard file, and what it
keeps is the folder's tensor (checked by gathering the shards with DTensor's own full_tensor).
The folder is a tied, sharded one made by transformers (no lm_head.weight, an index naming
several files), as Llama 3.2 1B ships. Every layout training from such a folder:
test_parallel_layouts.py (the local harness)."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from conftest import LLAMA_SETTINGS, save_hf_llama
from raytrain_lm.config.load import build_config
from raytrain_lm.errors import UserError
from raytrain_lm.models import build_model

os.environ["TRANSFORMERS_VERBOSITY"] = "error"

MODEL = [*LLAMA_SETTINGS, "model.n_layer=2", "model.n_head=4", "model.n_embd=64",
         "model.block_size=32", "model.vocab_size=320", "model.dropout=0", "model.tie_embeddings=true"]
# Two ranks each: FSDP splits every tensor by rows, tp by rows (q/k/v, gate/up, embedding) or
# columns (o, down), a pipeline by layers (the last stage's head read from the tied embedding).
LAYOUTS = {"fsdp": dict(strategy="fsdp"), "tp2": dict(tp=2),
           "pp2": dict(pp=2, pp_schedule="1f1b", microbatches=2)}


def config(**flags):
    return build_config(sets=MODEL, flags={"workers": 2, "batch_size": 4, "seq_len": 32, **flags})


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    """(folder, {our name: transformers' tensor}): tied and in 9 shards of at most 20 kB."""
    from raytrain_lm.data.vocab import byte_tokenizer_json
    from raytrain_lm.models.llama.hf_llama import ADAPTER

    out = tmp_path_factory.mktemp("hf-tied")
    hf = save_hf_llama(out, config().model, byte_tokenizer_json().encode(), seed=3, tied=True,
                       max_shard_size="20KB")
    state = hf.state_dict()
    with torch.device("meta"):
        names = list(build_model(config().model).state_dict())
    m = config().model
    return out, {n: state[ADAPTER.hf_name(n, m)] for n in names}  # the tied head: the embedding


def worker(rank, store, folder, out):
    from raytrain_lm.parallel import parallelize
    from raytrain_lm.worker.hf_load import load_hf_weights

    torch.set_num_threads(1)
    # a file store: a free port picked before the ranks bind it may be taken by then
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    results = {}
    for layout, flags in LAYOUTS.items():
        built = parallelize(config(**flags), torch.device("cpu"), init=False)  # as train does
        stats = load_hf_weights(folder, built.parts, built.cfg.model)
        full = {name: (t.full_tensor() if hasattr(t, "full_tensor") else t).detach().clone()
                for part in built.parts for name, t in part.state_dict().items()}
        results[layout] = (full, stats.bytes_read, stats.files)
    torch.save(results, f"{out}/rank{rank}.pt")
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def loaded(folder, tmp_path_factory):
    import torch.distributed.checkpoint  # noqa: F401  (imported once, before the fork)
    from torch.distributed.fsdp import fully_shard  # noqa: F401
    from torch.distributed.pipelining import PipelineStage  # noqa: F401

    out = tmp_path_factory.mktemp("loaded")
    mp.start_processes(worker, args=(str(out / "store"), str(folder[0]), str(out)), nprocs=2,
                       start_method="fork")
    return [torch.load(out / f"rank{r}.pt") for r in range(2)]


@pytest.mark.parametrize("layout", LAYOUTS)
def test_every_rank_holds_the_folders_weights(folder, loaded, layout):
    """Gathered from the ranks' shards, every tensor is transformers' (the head the tied
    embedding); each pipeline stage holds its own layers. Built without initial values, as
    `train --init-from` builds it: a tensor the load missed would show as it was allocated."""
    _, theirs = folder
    held = set()
    for rank in loaded:
        full = rank[layout][0]
        held |= set(full)
        for name, t in full.items():
            assert torch.equal(t, theirs[name]), (layout, name)
    assert held == set(theirs)


def test_each_rank_reads_its_share_of_the_bytes(folder, loaded):
    """FSDP reads the model once between its ranks, each about half; the pipeline too (its last
    stage reads the embedding again for its copy of a tied head); tp reads the norms on both
    ranks (replicated), the rest once (o_proj and down_proj by columns). "The model once": each
    of its parameters' tensors in the folder, the tied pair once."""
    from raytrain_lm.models.llama.hf_llama import ADAPTER
    from raytrain_lm.store import hf_folder

    infos = hf_folder.tensors(folder[0])
    with torch.device("meta"):
        model = build_model(config().model)
    tied = model.lm_head.weight is model.wte.weight
    once = sum(infos[ADAPTER.hf_name(n, config().model)].nbytes
               for n, _ in model.named_parameters())
    embedding = infos["model.embed_tokens.weight"].nbytes
    norms = sum(i.nbytes for n, i in infos.items() if n.endswith("norm.weight"))
    fsdp = [r["fsdp"][1] for r in loaded]
    assert sum(fsdp) == once and max(fsdp) < 0.55 * once
    assert sum(r["pp2"][1] for r in loaded) == once + tied * embedding
    assert sum(r["tp2"][1] for r in loaded) == once + norms
    assert all(r["fsdp"][2] == len(hf_folder.weight_files(folder[0])) for r in loaded)


def _rss_file() -> int:
    with open("/proc/self/status") as f:
        return int(next(line for line in f if line.startswith("RssFile:")).split()[1]) * 1024


def test_a_mapped_tensor_is_the_files_and_its_pages_leave_once_released(tmp_path):
    """MappedFile: a tensor is a view of the file at its header's offset, in its dtype, and a
    block of it the same block; the pages a copy touched count in this process's memory until
    `release` drops them (what keeps a loading rank to its share plus one block)."""
    from safetensors.torch import save_file

    from raytrain_lm.store.hf_folder import read_header
    from raytrain_lm.store.safetensors_io import MappedFile, block_of

    t = torch.randn(7, 5, 3, generator=torch.Generator().manual_seed(0)).bfloat16()
    big = torch.ones(2560, 4096)  # 40 MiB
    save_file({"a": torch.zeros(3), "t": t, "big": big}, tmp_path / "x.safetensors")
    infos = read_header(tmp_path / "x.safetensors")
    with MappedFile(tmp_path / "x.safetensors") as mapped:
        got = mapped.tensor(infos["t"])
        assert got.dtype == torch.bfloat16 and torch.equal(got, t)
        assert torch.equal(block_of(got, (2, 1, 0), (4, 3, 2)), t[2:6, 1:4, 0:2])
        before = _rss_file()
        assert mapped.tensor(infos["big"]).sum().item() == big.numel()  # every page touched
        touched = _rss_file() - before
        mapped.release(infos["big"])
        assert touched > 30 << 20 and _rss_file() - before < 4 << 20, touched
        del got


def test_a_tensor_of_another_shape_or_kind_is_refused_in_one_line(folder, tmp_path):
    """What the driver checked before launch (run/preflight.check_hf_init_from), a rank checks
    again as it reads: a folder changed since, or a model built otherwise."""
    import shutil

    from safetensors.torch import load_file, save_file

    from raytrain_lm.worker.hf_load import load_hf_weights

    other = tmp_path / "other"
    shutil.copytree(folder[0], other)
    model = build_model(config().model, seed=0)
    shard = next(p for p in sorted(other.glob("model-*.safetensors"))
                 if "model.norm.weight" in load_file(p))
    tensors = load_file(shard)
    save_file({**tensors, "model.norm.weight": tensors["model.norm.weight"].to(torch.int32)}, shard,
              metadata={"format": "pt"})
    with pytest.raises(UserError, match=r"model.norm.weight in model-\d+-of-\d+.safetensors holds "
                                        r"I32, not floating point"):
        load_hf_weights(other, [model], model.cfg)
    save_file({**tensors, "model.norm.weight": tensors["model.norm.weight"][:32]}, shard,
              metadata={"format": "pt"})
    with pytest.raises(UserError, match=r"model.norm.weight in .* has shape \[32\], the model's "
                                        r"ln_f.weight is \[64\]"):
        load_hf_weights(other, [model], model.cfg)


def test_a_weight_file_cut_short_while_mapped_is_named_not_a_bus_error(tmp_path):
    """A weight file cut short after its header was checked and the file mapped (a copy still
    writing it): touching the mapping past the file's new end would kill the rank with SIGBUS and
    no message; the read names the file instead. In a forked child, so that the bus error,
    where it happens, fails this test rather than killing the test process."""
    import os
    import signal

    from safetensors.torch import save_file

    from raytrain_lm.store.hf_folder import read_header
    from raytrain_lm.store.safetensors_io import MappedFile

    path = tmp_path / "x.safetensors"
    save_file({"a": torch.arange(4.0), "b": torch.ones(256, 1024)}, path)  # b: 1 MiB after a
    infos = read_header(path)
    pid = os.fork()
    if pid == 0:  # the child: map, cut, read
        code = 3
        try:
            with MappedFile(path) as mapped:
                os.truncate(path, infos["b"].offset + 4096)
                assert torch.equal(mapped.tensor(infos["a"]), torch.arange(4.0))  # still whole
                try:
                    mapped.tensor(infos["b"]).sum()
                except UserError as e:
                    code = 0 if str(e).startswith(f"{path} changed while it was read") else 4
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert not os.WIFSIGNALED(status), f"the read died of {signal.Signals(os.WTERMSIG(status)).name}"
    assert os.WEXITSTATUS(status) == 0, os.WEXITSTATUS(status)
